//! The seal of a shareable region's memfd: proof that it was made by a process of this
//! deployment, for the peer and the region that a peer's metadata names.
//!
//! A peer on this host announces its shareable regions as paths (`/proc/{pid}/fd/{fd}`).
//! Paths alone prove nothing: an authenticated peer could name another process's memfd
//! (another deployment's host tier) and have us write into it. So the owner appends a trailer
//! to every memfd it creates, past the region's bytes: a magic and an HMAC, keyed by a key
//! derived from the deployment's shared secret, over the memfd's name, the owner's agent
//! name, the region id and the region length. Before mapping a peer's memfd we read the
//! trailer with `pread` (nothing is mapped yet) and check it with our own secret: a memfd of a
//! deployment whose secret we do not share, or of another agent than the one the metadata
//! names, is refused.
//!
//! What the seal cannot prove: within one deployment every holder of the secret is trusted
//! with every name (the handshake authenticates the secret, not the name), so a secret holder
//! that claims another member's name reaches that member's memory just as it reaches it over
//! TCP. The seal keeps deployments apart, and keeps honest members from being pointed at each
//! other's memory.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::RegionId;

/// Bytes of the trailer after a shareable region's bytes in its file.
pub const SEAL_BYTES: usize = 64;

const MAGIC: &[u8; 8] = b"KVFSEAL1";
const MAC_BYTES: usize = 32;

/// The key that seals (and checks) this deployment's shareable region files.
#[derive(Clone)]
pub struct ShmSeal {
    key: [u8; 32],
}

impl Drop for ShmSeal {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.key);
    }
}

impl std::fmt::Debug for ShmSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmSeal").finish_non_exhaustive()
    }
}

fn hmac(key: &[u8]) -> Hmac<Sha256> {
    match <Hmac<Sha256> as Mac>::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    }
}

impl ShmSeal {
    /// The seal of the deployment whose shared secret is `secret`.
    pub fn new(secret: &[u8]) -> Self {
        let mut mac = hmac(secret);
        mac.update(b"kvfabric/1 shm seal key");
        ShmSeal { key: mac.finalize().into_bytes().into() }
    }

    fn mac(&self, file_name: &str, owner: &str, region: RegionId, len: u64) -> [u8; MAC_BYTES] {
        let mut mac = hmac(&self.key);
        // Lengths first: no two inputs share an encoding.
        for part in [file_name.as_bytes(), owner.as_bytes()] {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac.update(&region.0.to_le_bytes());
        mac.update(&len.to_le_bytes());
        mac.finalize().into_bytes().into()
    }

    /// The trailer that the owner `owner` writes after region `region`'s `len` bytes in the
    /// file named `file_name`.
    pub fn trailer(
        &self,
        file_name: &str,
        owner: &str,
        region: RegionId,
        len: u64,
    ) -> [u8; SEAL_BYTES] {
        let mut out = [0u8; SEAL_BYTES];
        out[..MAGIC.len()].copy_from_slice(MAGIC);
        out[MAGIC.len()..MAGIC.len() + MAC_BYTES]
            .copy_from_slice(&self.mac(file_name, owner, region, len));
        out
    }

    /// Whether `trailer` seals that file for that owner, region and length (constant time).
    pub fn check(
        &self,
        trailer: &[u8; SEAL_BYTES],
        file_name: &str,
        owner: &str,
        region: RegionId,
        len: u64,
    ) -> bool {
        let expected = self.trailer(file_name, owner, region, len);
        expected.iter().zip(trailer.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_holds_only_for_its_secret_file_owner_region_and_length() {
        let seal = ShmSeal::new(b"deployment a");
        let id = RegionId::new(3, 1);
        let t = seal.trailer("kvfabric.w1.1.2.3.1", "w1", id, 4096);
        assert!(seal.check(&t, "kvfabric.w1.1.2.3.1", "w1", id, 4096));
        assert!(!ShmSeal::new(b"deployment b").check(&t, "kvfabric.w1.1.2.3.1", "w1", id, 4096));
        assert!(!seal.check(&t, "kvfabric.w2.1.2.3.1", "w1", id, 4096), "another file");
        assert!(!seal.check(&t, "kvfabric.w1.1.2.3.1", "w2", id, 4096), "another owner");
        assert!(!seal.check(&t, "kvfabric.w1.1.2.3.1", "w1", RegionId::new(3, 2), 4096));
        assert!(!seal.check(&t, "kvfabric.w1.1.2.3.1", "w1", id, 4095), "another length");
        assert!(!seal.check(&[0u8; SEAL_BYTES], "kvfabric.w1.1.2.3.1", "w1", id, 4096));
    }
}
