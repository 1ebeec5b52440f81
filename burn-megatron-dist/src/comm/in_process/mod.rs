//! The in-process transport: ranks are threads of one process, each driving its own Burn device.
//!
//! Ranks meet at a rendezvous (one per call), leave their tensor there and each computes its
//! own result from everybody's tensors, moved to its device. It works on any Burn device; CI
//! runs it on the CPU. Results are reduced in group-rank order, so every rank gets the same
//! bits.
//!
//! When every rank of a group drives a GPU of its own, the data goes through NCCL instead
//! ([`nccl`]), ordered on the GPU; the rendezvous then only carries the agreement checks and
//! the shapes of point-to-point messages.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Collective, Payload, ProcessGroup, ReduceOp, Ticket, Transport};
#[cfg(feature = "cuda")]
use crate::comm::nccl::Wait;

#[cfg(feature = "cuda")]
mod nccl;
use crate::error::CommError;

/// How long a rank waits for its peers before it gives up, unless told otherwise. Comfortably
/// inside the minute within which a stalled peer must be reported.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(45);

/// How often a waiting rank looks for an aborted world.
const POLL: Duration = Duration::from_millis(20);

/// The ranks of one process and the groups among them.
#[derive(Clone, Debug)]
pub struct InProcessWorld {
    state: Arc<WorldState>,
}

/// A group's axis name and members.
type GroupKey = (String, Vec<usize>);

#[derive(Debug)]
struct WorldState {
    size: usize,
    timeout: Duration,
    groups: Mutex<HashMap<GroupKey, Arc<Shared>>>,
    /// Set when a rank died: (its global rank, why).
    aborted: Mutex<Option<(usize, String)>>,
}

impl InProcessWorld {
    pub fn new(size: usize) -> Self {
        Self::with_timeout(size, DEFAULT_TIMEOUT)
    }

    pub fn with_timeout(size: usize, timeout: Duration) -> Self {
        let state = WorldState { size, timeout, groups: Mutex::default(), aborted: Mutex::default() };
        Self { state: Arc::new(state) }
    }

    pub fn size(&self) -> usize {
        self.state.size
    }

    /// This rank's handle on the group `members` (global ranks in group-rank order). Every
    /// member calls this with the same `axis` and `members` to join the same group.
    pub fn group(&self, axis: &str, members: Vec<usize>, global_rank: usize) -> ProcessGroup {
        let group_rank = members
            .iter()
            .position(|&r| r == global_rank)
            .unwrap_or_else(|| panic!("global rank {global_rank} is not in {axis}{members:?}"));
        let shared = self
            .state
            .groups
            .lock()
            .expect("group registry")
            .entry((axis.to_string(), members.clone()))
            .or_insert_with(|| {
                Arc::new(Shared {
                    label: format!("{axis}{members:?}"),
                    size: members.len(),
                    world: self.state.clone(),
                    rounds: Mutex::default(),
                    arrived: Condvar::new(),
                })
            })
            .clone();
        let transport = InProcessTransport {
            shared,
            group_rank,
            data_seq: AtomicU64::new(0),
            #[cfg(feature = "cuda")]
            nccl: Default::default(),
        };
        ProcessGroup::new(Arc::new(transport), members)
    }

    /// Marks the world as broken because `global_rank` died: every rank waiting in a collective
    /// returns [`CommError::PeerLost`] at once.
    pub fn abort(&self, global_rank: usize, reason: String) {
        let mut aborted = self.state.aborted.lock().expect("abort flag");
        aborted.get_or_insert((global_rank, reason));
    }

    /// The rank whose death aborted the world, and why.
    pub fn first_failure(&self) -> Option<(usize, String)> {
        self.state.aborted.lock().expect("abort flag").clone()
    }
}

#[derive(Debug)]
struct Shared {
    label: String,
    size: usize,
    world: Arc<WorldState>,
    rounds: Mutex<Rounds>,
    arrived: Condvar,
}

#[derive(Debug, Default)]
struct Rounds {
    /// Open rendezvous, by (kind, call number).
    open: HashMap<(RoundKind, u64), Round>,
    /// Point-to-point messages, by (from, to, call number).
    mail: HashMap<(usize, usize, u64), Payload>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum RoundKind {
    Check,
    Data,
}

#[derive(Debug)]
struct Round {
    values: Vec<Option<Value>>,
    taken: usize,
}

#[derive(Clone, Debug)]
enum Value {
    Bytes(Vec<u8>),
    One(Box<Payload>),
    Many(Vec<Payload>),
}

/// One rank's handle on a group.
#[derive(Debug)]
pub struct InProcessTransport {
    shared: Arc<Shared>,
    group_rank: usize,
    data_seq: AtomicU64,
    /// NCCL, once the group's first collective on CUDA found every rank on a GPU of its own.
    #[cfg(feature = "cuda")]
    nccl: std::sync::OnceLock<Option<crate::comm::nccl::NcclComm>>,
}

impl InProcessTransport {
    /// Leaves `value` at the rendezvous and waits for every other rank's.
    fn meet(&self, collective: Collective, kind: RoundKind, seq: u64, value: Value) -> Result<Vec<Value>, CommError> {
        let shared = &self.shared;
        let key = (kind, seq);
        let mut rounds = shared.lock();
        let round = rounds
            .open
            .entry(key)
            .or_insert_with(|| Round { values: vec![None; shared.size], taken: 0 });
        round.values[self.group_rank] = Some(value);
        shared.arrived.notify_all();
        let deadline = Instant::now() + shared.world.timeout;
        loop {
            let round = rounds.open.get_mut(&key).expect("open round");
            if round.values.iter().all(Option::is_some) {
                let values = round.values.iter().map(|v| v.clone().expect("present")).collect();
                round.taken += 1;
                if round.taken == shared.size {
                    rounds.open.remove(&key);
                }
                return Ok(values);
            }
            let missing: Vec<usize> =
                round.values.iter().enumerate().filter(|(_, v)| v.is_none()).map(|(r, _)| r).collect();
            rounds = self.wait(rounds, collective, seq, deadline, missing)?;
        }
    }

    /// Waits for a change, or fails on an aborted world or a passed deadline.
    fn wait<'a>(
        &self,
        rounds: MutexGuard<'a, Rounds>,
        collective: Collective,
        seq: u64,
        deadline: Instant,
        missing: Vec<usize>,
    ) -> Result<MutexGuard<'a, Rounds>, CommError> {
        let shared = &self.shared;
        if let Some((rank, reason)) = shared.world.aborted.lock().expect("abort flag").clone() {
            return Err(CommError::PeerLost {
                group: shared.label.clone(),
                collective: collective.name(),
                rank,
                reason,
            });
        }
        if Instant::now() >= deadline {
            return Err(CommError::Timeout {
                group: shared.label.clone(),
                collective: collective.name(),
                seq,
                timeout: shared.world.timeout,
                missing,
            });
        }
        Ok(shared.arrived.wait_timeout(rounds, POLL).expect("rendezvous lock").0)
    }

    fn meet_data(&self, collective: Collective, value: Value) -> Result<Vec<Value>, CommError> {
        let seq = self.data_seq.fetch_add(1, Ordering::Relaxed);
        self.meet(collective, RoundKind::Data, seq, value)
    }

    /// Everybody's payloads, moved to this rank's device.
    fn gather_here(&self, collective: Collective, x: Payload) -> Result<Vec<Payload>, CommError> {
        let device = x.device();
        let values = self.meet_data(collective, Value::One(Box::new(x)))?;
        Ok(values.into_iter().map(|v| move_to(one(v), &device)).collect())
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Rounds> {
        self.rounds.lock().expect("rendezvous lock")
    }
}

/// Moves a payload to `device`.
///
/// Between two CUDA devices this is an NCCL send on one and a receive on the other, each
/// queued on its device's communication stream. Two transfers in opposite directions queued in
/// different orders on the two devices would wait for each other forever, so transfers between
/// CUDA devices are queued one at a time, process-wide: every device sees them in one order.
fn move_to(x: Payload, device: &burn::tensor::Device) -> Payload {
    if &x.device() == device {
        return x;
    }
    #[cfg(feature = "cuda")]
    if crate::comm::nccl::cuda_index(device).is_some() && crate::comm::nccl::cuda_index(&x.device()).is_some() {
        static QUEUE: Mutex<()> = Mutex::new(());
        let _queued = QUEUE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        return x.to_device(device);
    }
    x.to_device(device)
}

fn one(value: Value) -> Payload {
    match value {
        Value::One(p) => *p,
        other => panic!("expected one payload, got {other:?}"),
    }
}

fn reduce(parts: Vec<Payload>, op: ReduceOp) -> Payload {
    let n = parts.len();
    let mut parts = parts.into_iter();
    let first = parts.next().expect("a group has members");
    let combined = parts.fold(first, |acc, x| match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.add_pair(x),
        ReduceOp::Max => acc.max_pair(x),
    });
    match op {
        ReduceOp::Avg => combined.div_scalar(n),
        _ => combined,
    }
}

impl Transport for InProcessTransport {
    fn size(&self) -> usize {
        self.shared.size
    }

    fn group_rank(&self) -> usize {
        self.group_rank
    }

    fn label(&self) -> &str {
        &self.shared.label
    }

    fn exchange(&self, collective: Collective, seq: u64, record: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        let values = self.meet(collective, RoundKind::Check, seq, Value::Bytes(record))?;
        Ok(values
            .into_iter()
            .map(|v| match v {
                Value::Bytes(b) => b,
                other => panic!("expected a record, got {other:?}"),
            })
            .collect())
    }

    fn all_reduce(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        let (out, ticket) = self.all_reduce_deferred(x, op)?;
        self.wait_for(ticket)?;
        Ok(out)
    }

    fn all_reduce_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl(Collective::AllReduce, &x)? {
            return nccl.all_reduce(x, op, Wait::Later);
        }
        Ok((reduce(self.gather_here(Collective::AllReduce, x)?, op), Ticket::DONE))
    }

    fn wait_for(&self, ticket: Ticket) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        if let Some(Some(nccl)) = self.nccl.get() {
            return nccl.wait_for(ticket);
        }
        debug_assert_eq!(ticket, Ticket::DONE, "only NCCL defers");
        Ok(())
    }

    fn all_gather(&self, x: Payload) -> Result<Payload, CommError> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl(Collective::AllGather, &x)? {
            return nccl.all_gather(x);
        }
        Ok(Payload::cat(self.gather_here(Collective::AllGather, x)?))
    }

    fn reduce_scatter(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        let (out, ticket) = self.reduce_scatter_deferred(x, op)?;
        self.wait_for(ticket)?;
        Ok(out)
    }

    fn reduce_scatter_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl(Collective::ReduceScatter, &x)? {
            return nccl.reduce_scatter(x, op, Wait::Later);
        }
        let part = x.dims()[1] / self.shared.size;
        let mine = self.group_rank * part..(self.group_rank + 1) * part;
        let device = x.device();
        // Only this rank's slice of each peer's tensor travels.
        let values = self.meet_data(Collective::ReduceScatter, Value::One(Box::new(x)))?;
        let parts = values.into_iter().map(|v| move_to(one(v).narrow(mine.clone()), &device)).collect();
        Ok((reduce(parts, op), Ticket::DONE))
    }

    fn all_to_all(&self, chunks: Vec<Payload>, recv_dims: Vec<[usize; 3]>) -> Result<Vec<Payload>, CommError> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl(Collective::AllToAll, &chunks[0])? {
            return nccl.all_to_all(chunks, recv_dims);
        }
        let _ = recv_dims;
        let device = chunks[0].device();
        let values = self.meet_data(Collective::AllToAll, Value::Many(chunks))?;
        Ok(values
            .into_iter()
            .map(|v| match v {
                Value::Many(mut chunks) => move_to(chunks.swap_remove(self.group_rank), &device),
                other => panic!("expected chunks, got {other:?}"),
            })
            .collect())
    }

    fn broadcast(&self, x: Payload, root: usize) -> Result<Payload, CommError> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl(Collective::Broadcast, &x)? {
            return nccl.broadcast(x, root);
        }
        let mut parts = self.gather_here(Collective::Broadcast, x)?;
        Ok(parts.swap_remove(root))
    }

    /// The payload goes by mail; under NCCL the mail only carries its shape, for the receiver's
    /// check, and the data goes with this rank's next call on the group.
    fn send(&self, x: Payload, peer: usize, seq: u64) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl_if_joined(&x) {
            nccl.send(x.clone(), peer)?;
        }
        let mut rounds = self.shared.lock();
        rounds.mail.insert((self.group_rank, peer, seq), x);
        self.shared.arrived.notify_all();
        Ok(())
    }

    fn flush(&self) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        if let Some(Some(nccl)) = self.nccl.get() {
            return nccl.flush();
        }
        Ok(())
    }

    fn recv(&self, like: Payload, peer: usize, seq: u64) -> Result<Payload, CommError> {
        let collective = Collective::Recv;
        let key = (peer, self.group_rank, seq);
        let deadline = Instant::now() + self.shared.world.timeout;
        let mut rounds = self.shared.lock();
        loop {
            if let Some(x) = rounds.mail.remove(&key) {
                if x.dims() != like.dims() || x.dtype() != like.dtype() || x.is_float() != like.is_float() {
                    let detail = format!(
                        "group rank {peer} sent {:?} {:?} but this rank expects {:?} {:?}",
                        x.dtype(),
                        x.dims(),
                        like.dtype(),
                        like.dims()
                    );
                    return Err(CommError::Mismatch { group: self.shared.label.clone(), collective: collective.name(), seq, detail });
                }
                #[cfg(feature = "cuda")]
                if let Some(nccl) = self.nccl_if_joined(&like) {
                    drop(rounds);
                    return nccl.recv(like, peer);
                }
                return Ok(move_to(x, &like.device()));
            }
            rounds = self.wait(rounds, collective, seq, deadline, vec![peer])?;
        }
    }
}
