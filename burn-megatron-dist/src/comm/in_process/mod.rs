//! The in-process transport: ranks are threads of one process, each driving its own Burn device.
//!
//! Ranks meet at a rendezvous (one per call), leave their tensor there and each computes its
//! own result from everybody's tensors, moved to its device. It works on any Burn device; CI
//! runs it on the CPU. Results are reduced in group-rank order, so every rank gets the same
//! bits.
//!
//! Ranks that drive GPUs use the NCCL-threads transport instead (`comm::nccl::threads`, in
//! `cuda` builds), which is built on this one: it keeps the rendezvous for the agreement checks,
//! the meeting that makes its communicator, the shapes of point-to-point messages, and the data
//! of a group whose ranks share a GPU. [`InProcessWorld::transport`] and the `pub` methods of
//! [`InProcessTransport`] are what it uses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::Device;

use super::payload::split_points;
use super::{Collective, Payload, ProcessGroup, ReduceOp, Transport};
use crate::error::CommError;

/// How long a rank waits for its peers before it gives up, unless told otherwise. Comfortably
/// inside the minute within which a stalled peer must be reported.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(45);

/// How often a waiting rank looks for an aborted world.
const POLL: Duration = Duration::from_millis(20);

/// Brings a peer's payload to this rank's device; called only when the two devices differ.
/// The plain transport copies ([`Payload::to_device`]); the NCCL-threads transport queues
/// copies between GPUs one at a time.
pub type DeviceCopy = fn(Payload, &Device) -> Payload;

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
        let state = WorldState {
            size,
            timeout,
            groups: Mutex::default(),
            aborted: Mutex::default(),
        };
        Self { state: Arc::new(state) }
    }

    pub fn size(&self) -> usize {
        self.state.size
    }

    /// This rank's handle on the group `members` (global ranks in group-rank order). Every
    /// member calls this with the same `axis` and `members` to join the same group.
    pub fn group(&self, axis: &str, members: Vec<usize>, global_rank: usize) -> ProcessGroup {
        let transport = self.transport(axis, &members, global_rank, Payload::to_device);
        ProcessGroup::new(Arc::new(transport), members)
    }

    /// [`group`](Self::group)'s transport alone, its payloads brought to this rank's device by
    /// `copy`: for a transport built on the rendezvous.
    pub fn transport(&self, axis: &str, members: &[usize], global_rank: usize, copy: DeviceCopy) -> InProcessTransport {
        let group_rank = members
            .iter()
            .position(|&r| r == global_rank)
            .unwrap_or_else(|| panic!("global rank {global_rank} is not in {axis}{members:?}"));
        let shared = self
            .state
            .groups
            .lock()
            .expect("group registry")
            .entry((axis.to_string(), members.to_vec()))
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
        InProcessTransport {
            shared,
            group_rank,
            data_seq: AtomicU64::new(0),
            copy,
        }
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
    /// Brings peers' payloads to this rank's device.
    copy: DeviceCopy,
}

impl InProcessTransport {
    /// How long this rank waits for its peers.
    pub fn timeout(&self) -> Duration {
        self.shared.world.timeout
    }

    /// Exchanges a small host-side record with every rank of the group, in the order of the
    /// data calls: it takes the turn of one, so every rank makes it at the same point of its
    /// calls. Returns every rank's record, in group-rank order.
    pub fn share(&self, collective: Collective, record: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        Ok(self
            .meet_data(collective, Value::Bytes(record))?
            .into_iter()
            .map(bytes)
            .collect())
    }

    /// Waits for the message `seq` from group rank `peer` and checks that it is shaped like
    /// `like`: another shape or dtype is [`CommError::Mismatch`]. The payload stays on the
    /// sender's device.
    pub fn take_mail(&self, like: &Payload, peer: usize, seq: u64) -> Result<Payload, CommError> {
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
                    return Err(CommError::Mismatch {
                        group: self.shared.label.clone(),
                        collective: collective.name(),
                        seq,
                        detail,
                    });
                }
                return Ok(x);
            }
            rounds = self.wait(rounds, collective, seq, deadline, vec![peer])?;
        }
    }

    /// Brings a payload to this rank's `device`: this rank's own as it is, a peer's through the
    /// transport's copy (which may hand a payload already on `device` over as it is).
    pub fn move_to(&self, x: Payload, device: &Device, theirs: bool) -> Payload {
        match theirs || &x.device() != device {
            true => (self.copy)(x, device),
            false => x,
        }
    }

    /// Leaves `value` at the rendezvous and waits for every other rank's.
    fn meet(&self, collective: Collective, kind: RoundKind, seq: u64, value: Value) -> Result<Vec<Value>, CommError> {
        let shared = &self.shared;
        let key = (kind, seq);
        let mut rounds = shared.lock();
        let round = rounds.open.entry(key).or_insert_with(|| Round {
            values: vec![None; shared.size],
            taken: 0,
        });
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
            let missing: Vec<usize> = round
                .values
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_none())
                .map(|(r, _)| r)
                .collect();
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
        let me = self.group_rank;
        Ok(values
            .into_iter()
            .enumerate()
            .map(|(j, v)| self.move_to(one(v), &device, j != me))
            .collect())
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Rounds> {
        self.rounds.lock().expect("rendezvous lock")
    }
}

fn one(value: Value) -> Payload {
    match value {
        Value::One(p) => *p,
        other => panic!("expected one payload, got {other:?}"),
    }
}

fn bytes(value: Value) -> Vec<u8> {
    match value {
        Value::Bytes(b) => b,
        other => panic!("expected a record, got {other:?}"),
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
        Ok(values.into_iter().map(bytes).collect())
    }

    fn all_reduce(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        Ok(reduce(self.gather_here(Collective::AllReduce, x)?, op))
    }

    fn all_gather(&self, x: Payload) -> Result<Payload, CommError> {
        Ok(Payload::cat(self.gather_here(Collective::AllGather, x)?))
    }

    fn reduce_scatter(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        let part = x.dims()[1] / self.shared.size;
        let mine = self.group_rank * part..(self.group_rank + 1) * part;
        let device = x.device();
        // Only this rank's slice of each peer's tensor travels.
        let values = self.meet_data(Collective::ReduceScatter, Value::One(Box::new(x)))?;
        let parts = values
            .into_iter()
            .enumerate()
            .map(|(j, v)| self.move_to(one(v).narrow(mine.clone()), &device, j != self.group_rank))
            .collect();
        Ok(reduce(parts, op))
    }

    fn all_to_all(&self, x: Payload, send: &[usize], _recv: &[usize]) -> Result<Payload, CommError> {
        let device = x.device();
        let chunks = split_points(send).map(|range| x.clone().narrow(range)).collect();
        let values = self.meet_data(Collective::AllToAll, Value::Many(chunks))?;
        let me = self.group_rank;
        let parts = values
            .into_iter()
            .enumerate()
            .map(|(j, v)| match v {
                Value::Many(mut chunks) => self.move_to(chunks.swap_remove(me), &device, j != me),
                other => panic!("expected chunks, got {other:?}"),
            })
            .collect();
        Ok(Payload::cat(parts))
    }

    fn broadcast(&self, x: Payload, root: usize) -> Result<Payload, CommError> {
        let mut parts = self.gather_here(Collective::Broadcast, x)?;
        Ok(parts.swap_remove(root))
    }

    /// The payload goes by mail.
    fn send(&self, x: Payload, peer: usize, seq: u64) -> Result<(), CommError> {
        let mut rounds = self.shared.lock();
        rounds.mail.insert((self.group_rank, peer, seq), x);
        self.shared.arrived.notify_all();
        Ok(())
    }

    fn recv(&self, like: Payload, peer: usize, seq: u64) -> Result<Payload, CommError> {
        let x = self.take_mail(&like, peer, seq)?;
        Ok(self.move_to(x, &like.device(), true))
    }
}
