//! The collectives a communicator has queued and not yet seen finish, and the watchdog that
//! aborts it when one is stuck past its deadline.
//!
//! Nothing on the host waits for a collective: [`NcclComm`](super::NcclComm) queues it and
//! returns. So a peer that never joins would leave this GPU spinning forever, and a host that
//! then reads a tensor back would hang. The watchdog, a thread a communicator, looks at the
//! oldest collective every [`TICK`]; past the deadline it aborts the communicator. NCCL's
//! kernels then return, the GPU moves on, and the next call on the group fails with
//! [`CommError::Timeout`] naming the stuck collective.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent};
use cudarc::nccl::result as nccl;

use super::{Comm, Payload};
use crate::error::CommError;

/// How often the watchdog looks.
const TICK: Duration = Duration::from_millis(100);

/// A communicator's live state, shared with its watchdog.
pub(super) struct Flights {
    label: String,
    timeout: Duration,
    ctx: Arc<CudaContext>,
    comm: Mutex<Option<Comm>>,
    queue: Mutex<VecDeque<Flight>>,
    /// The collective the watchdog found stuck, once it has aborted the communicator.
    stuck: Mutex<Option<&'static str>>,
}

/// One queued collective.
struct Flight {
    collective: &'static str,
    since: Instant,
    /// Recorded on the NCCL stream after the collective.
    done: CudaEvent,
    /// Kept alive until NCCL is done with them: a buffer dropped by its owner could otherwise
    /// be handed out again, on another CubeCL stream, while NCCL still reads or writes it.
    _buffers: Vec<Payload>,
}

impl Flights {
    /// Starts the watchdog; it ends when the flights are dropped.
    pub(super) fn start(label: String, timeout: Duration, ctx: Arc<CudaContext>, comm: Comm) -> Arc<Self> {
        let flights = Arc::new(Self {
            label,
            timeout,
            ctx,
            comm: Mutex::new(Some(comm)),
            queue: Mutex::default(),
            stuck: Mutex::default(),
        });
        let watched = Arc::downgrade(&flights);
        std::thread::Builder::new()
            .name("burn-megatron-nccl-watchdog".into())
            .spawn(move || watch(watched))
            .expect("spawn the NCCL watchdog");
        flights
    }

    /// The communicator, unless it was aborted: then the error that says why.
    pub(super) fn comm(&self, collective: &'static str) -> Result<MutexGuard<'_, Option<Comm>>, CommError> {
        self.reap()?;
        let guard = self.comm.lock().expect("communicator lock");
        match guard.is_some() {
            true => Ok(guard),
            false => Err(self.aborted(collective)),
        }
    }

    pub(super) fn push(&self, collective: &'static str, done: CudaEvent, buffers: Vec<Payload>) {
        let flight = Flight {
            collective,
            since: Instant::now(),
            done,
            _buffers: buffers,
        };
        self.queue.lock().expect("flights lock").push_back(flight);
    }

    /// Waits on the host until every queued collective has finished, or aborts at the deadline.
    pub(super) fn drain(&self) -> Result<(), CommError> {
        loop {
            self.reap()?;
            if self.queue.lock().expect("flights lock").is_empty() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Drops the finished collectives; aborts the communicator if the oldest is overdue.
    fn reap(&self) -> Result<(), CommError> {
        self.look(true)
    }

    /// Aborts the communicator if its oldest unfinished collective is overdue. `drop_finished`
    /// lets the finished ones go (the rank's own calls); the watchdog only looks.
    fn look(&self, drop_finished: bool) -> Result<(), CommError> {
        let mut queue = self.queue.lock().expect("flights lock");
        let mut next = 0;
        while let Some(oldest) = queue.get(next) {
            let finished = oldest
                .done
                .try_is_complete()
                .map_err(|e| self.failure(oldest.collective, e))?;
            if finished {
                match drop_finished {
                    true => drop(queue.pop_front()),
                    false => next += 1,
                }
                continue;
            }
            if oldest.since.elapsed() < self.timeout {
                return Ok(());
            }
            let collective = oldest.collective;
            drop(queue);
            self.abort(collective);
            return Err(self.aborted(collective));
        }
        match *self.stuck.lock().expect("stuck lock") {
            Some(collective) => Err(self.aborted(collective)),
            None => Ok(()),
        }
    }

    fn abort(&self, collective: &'static str) {
        self.stuck.lock().expect("stuck lock").get_or_insert(collective);
        if let Some(comm) = self.comm.lock().expect("communicator lock").take() {
            let _ = self.ctx.bind_to_thread();
            // Safety: aborting a live communicator; it is not used again.
            unsafe {
                let _ = nccl::comm_abort(comm.0);
            }
            std::mem::forget(comm);
        }
    }

    fn aborted(&self, collective: &'static str) -> CommError {
        let stuck = self.stuck.lock().expect("stuck lock").unwrap_or(collective);
        CommError::Timeout {
            group: self.label.clone(),
            collective: stuck,
            seq: 0,
            timeout: self.timeout,
            missing: vec![],
        }
    }

    fn failure(&self, collective: &'static str, error: impl std::fmt::Debug) -> CommError {
        CommError::Transport {
            group: self.label.clone(),
            collective,
            detail: format!("{error:?}"),
        }
    }
}

fn watch(flights: Weak<Flights>) {
    loop {
        std::thread::sleep(TICK);
        let Some(flights) = flights.upgrade() else { return };
        if flights.stuck.lock().expect("stuck lock").is_some() {
            return;
        }
        let _ = flights.ctx.bind_to_thread();
        // A failure here is kept (`stuck`) and reported by the rank's next call.
        let _ = flights.look(false);
    }
}
