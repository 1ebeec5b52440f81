//! This process's place in a one-process-a-rank run: the launcher's variables, the rendezvous
//! store, and an NCCL communicator for each of its groups.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use burn::tensor::Device;

use super::super::ProcessGroup;
use super::super::store::{StoreClient, StoreServer};
use super::NcclTransport;
use crate::error::{CommError, LaunchError};
use crate::groups::ProcessGroups;
use crate::mesh::ParallelDims;

/// How long a rank waits to reach the store, and for its peers to start.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(120);

/// This process's place in a one-process-a-rank run. There is one per process: the store
/// connection outlives the groups of each [`launch`](crate::launch()).
pub struct ProcessRank {
    global_rank: usize,
    world_size: usize,
    local_rank: usize,
    store: Arc<StoreClient>,
    /// Kept alive on global rank 0.
    _server: Option<StoreServer>,
    /// Launches so far; every process counts the same, so it namespaces the store's keys.
    launches: AtomicU64,
}

static PROCESS: OnceLock<ProcessRank> = OnceLock::new();

/// The store's port: `BURN_MEGATRON_STORE_PORT` if set; else `MASTER_PORT` (29500 if unset),
/// plus one under torchrun, whose own store already listens on `MASTER_PORT`.
fn store_port() -> Result<usize, LaunchError> {
    if let Some(port) = env_usize("BURN_MEGATRON_STORE_PORT")? {
        return Ok(port);
    }
    let master = env_usize("MASTER_PORT")?.unwrap_or(29500);
    let torchrun = std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    Ok(if torchrun { master + 1 } else { master })
}

fn env_usize(name: &'static str) -> Result<Option<usize>, LaunchError> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| LaunchError::Env {
            name,
            detail: format!("{v:?} is not a number"),
        }),
        Err(_) => Ok(None),
    }
}

impl ProcessRank {
    /// This process's rank, met at the store on first use.
    pub fn get() -> Result<&'static ProcessRank, LaunchError> {
        if let Some(process) = PROCESS.get() {
            return Ok(process);
        }
        let process = Self::from_env()?;
        Ok(PROCESS.get_or_init(|| process))
    }

    /// Reads the launcher's variables and meets the other ranks at the store.
    fn from_env() -> Result<Self, LaunchError> {
        let missing = |name| LaunchError::Env {
            name,
            detail: "is not set".into(),
        };
        let global_rank = env_usize("RANK")?.ok_or_else(|| missing("RANK"))?;
        let world_size = env_usize("WORLD_SIZE")?.ok_or_else(|| missing("WORLD_SIZE"))?;
        let local_rank = env_usize("LOCAL_RANK")?.unwrap_or(global_rank);
        if global_rank >= world_size {
            return Err(LaunchError::Env {
                name: "RANK",
                detail: format!("{global_rank} ≥ WORLD_SIZE {world_size}"),
            });
        }
        let host = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        let port = store_port()?;
        let address = format!("{host}:{port}");
        let rendezvous = |detail: String| LaunchError::Rendezvous {
            address: address.clone(),
            detail,
        };
        let server = match global_rank {
            0 => Some(StoreServer::start(&format!("0.0.0.0:{port}")).map_err(|e| rendezvous(e.to_string()))?),
            _ => None,
        };
        let store = StoreClient::connect(&address, CONNECT_TIMEOUT).map_err(|e| rendezvous(e.to_string()))?;
        let (store, launches) = (Arc::new(store), AtomicU64::new(0));
        Ok(Self {
            global_rank,
            world_size,
            local_rank,
            store,
            _server: server,
            launches,
        })
    }

    pub fn global_rank(&self) -> usize {
        self.global_rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Creates an NCCL communicator for every group of this rank, on `device`
    /// (`Device::cuda(local_rank)`).
    pub fn groups(&self, dims: ParallelDims, device: &Device, timeout: Duration) -> Result<ProcessGroups, LaunchError> {
        let launch = self.launches.fetch_add(1, Ordering::Relaxed);
        ProcessGroups::try_build(dims, self.global_rank, |axis, members| {
            let label = format!("{axis}{members:?}");
            let namespace = format!("{launch}/{label}");
            let transport = NcclTransport::join(
                label,
                namespace,
                &members,
                self.global_rank,
                &self.store,
                device,
                timeout,
            )?;
            Ok::<_, CommError>(ProcessGroup::new(Arc::new(transport), members))
        })
        .map_err(LaunchError::from)
    }
}
