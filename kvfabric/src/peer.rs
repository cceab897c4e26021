//! A loaded peer: its metadata, its session (connections), and the shared-memory mappings of
//! its regions when it runs on this host.

use std::collections::HashMap;
use std::sync::Arc;

use crate::endpoint::AgentMetadata;
use crate::memory::{MemoryError, PeerMapping, RegionId, ShmSeal};
use crate::session::client::Session;

/// A loaded peer.
#[derive(Debug)]
pub struct Peer {
    metadata: AgentMetadata,
    pub(crate) session: Session,
    /// Its shareable regions, mapped when it was loaded, each only after its memfd's seal
    /// proved it ours ([`ShmSeal`]).
    shm_maps: HashMap<RegionId, Arc<PeerMapping>>,
    same_host: bool,
}

impl Peer {
    /// A peer; on this host, its shareable regions are mapped now. A memfd whose seal does not
    /// hold (another deployment's, another agent's, a forgery) refuses the whole peer: its
    /// metadata lies. A region that cannot be opened (its owner exited) only leaves that region
    /// to the other transports.
    pub(crate) fn new(
        metadata: AgentMetadata,
        session: Session,
        same_host: bool,
        seal: &ShmSeal,
    ) -> Result<Self, MemoryError> {
        let mut shm_maps = HashMap::new();
        if same_host {
            for r in &metadata.regions {
                let Some(path) = &r.shm_path else { continue };
                let Ok(len) = usize::try_from(r.len) else { continue };
                match PeerMapping::open(std::path::Path::new(path), len, seal, &metadata.name, r.id)
                {
                    Ok(m) => {
                        shm_maps.insert(r.id, Arc::new(m));
                    }
                    Err(e @ MemoryError::NotSealed { .. }) => return Err(e),
                    Err(e) => {
                        tracing::debug!(peer = %metadata.name, region = %r.id, error = %e,
                            "a peer's region is not reachable by shm");
                    }
                }
            }
        }
        if !shm_maps.is_empty() {
            // Page tables for the mappings, off the path of the first transfers.
            let maps: Vec<Arc<PeerMapping>> = shm_maps.values().cloned().collect();
            let started = std::thread::Builder::new()
                .name("kvfabric-prefault".into())
                .spawn(move || maps.iter().for_each(|m| m.prefault()));
            if let Err(e) = started {
                tracing::debug!(error = %e, "no thread to prefault a peer's mappings");
            }
        }
        Ok(Peer { metadata, session, shm_maps, same_host })
    }

    /// The peer's metadata.
    pub fn metadata(&self) -> &AgentMetadata {
        &self.metadata
    }

    /// Whether it runs on this host and offers shared memory.
    pub(crate) fn same_host(&self) -> bool {
        self.same_host
    }

    /// The peer's shareable region, mapped here.
    pub(crate) fn shm_map(&self, id: RegionId) -> Option<Arc<PeerMapping>> {
        self.shm_maps.get(&id).cloned()
    }
}
