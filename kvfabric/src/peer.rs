//! A loaded peer: its metadata, its session (connections), and the shared-memory mappings of
//! its regions when it runs on this host.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::endpoint::AgentMetadata;
use crate::memory::{PeerMapping, RegionId};
use crate::session::client::Session;

/// A loaded peer.
#[derive(Debug)]
pub struct Peer {
    metadata: AgentMetadata,
    pub(crate) session: Session,
    shm_maps: Mutex<HashMap<RegionId, Arc<PeerMapping>>>,
    same_host: bool,
}

impl Peer {
    pub(crate) fn new(metadata: AgentMetadata, session: Session, same_host: bool) -> Self {
        Peer { metadata, session, shm_maps: Mutex::new(HashMap::new()), same_host }
    }

    /// The peer's metadata.
    pub fn metadata(&self) -> &AgentMetadata {
        &self.metadata
    }

    /// Whether it runs on this host and offers shared memory.
    pub(crate) fn same_host(&self) -> bool {
        self.same_host
    }

    /// The peer's shareable region mapped here, mapping it on first use.
    pub(crate) fn shm_map(&self, id: RegionId) -> Option<Arc<PeerMapping>> {
        let mut maps = self.shm_maps.lock();
        if let Some(m) = maps.get(&id) {
            return Some(m.clone());
        }
        let r = self.metadata.regions.iter().find(|r| r.id == id)?;
        let path = r.shm_path.as_ref()?;
        let m = Arc::new(PeerMapping::open(std::path::Path::new(path), r.len as usize).ok()?);
        maps.insert(id, m.clone());
        Some(m)
    }
}
