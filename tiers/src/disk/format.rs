//! The on-disk slot format.
//!
//! A disk tier file is an array of slots, each `HEADER_BYTES + round_up(block_bytes, 4096)`
//! bytes, written with one vectored O_DIRECT write (header, then data). The 4 KiB header:
//!
//! ```text
//! 0   u64  magic "KVFBLK01"
//! 8   u64  sequence hash
//! 16  u64  parent sequence hash (valid if flags bit 0)
//! 24  u64  block bytes
//! 32  u64  XXH3-64 of the block bytes
//! 40  u64  flags (bit 0: has parent)
//! 48  u64  write sequence number (the newest copy of a hash wins on rebuild)
//! 56  u64  XXH3-64 of bytes 0..56
//! ```
//!
//! The header checksum makes a torn or foreign header unreadable; the data checksum, checked
//! on every read, makes a torn or corrupt block a miss — dropped, never served.

use kvfabric::hash::SequenceHash;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes of a slot header (one page: O_DIRECT alignment).
pub const HEADER_BYTES: u64 = 4096;
/// O_DIRECT alignment of offsets, lengths and buffers.
pub const ALIGN: u64 = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"KVFBLK01");

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotHeader {
    /// The block.
    pub hash: SequenceHash,
    /// Its parent.
    pub parent: Option<SequenceHash>,
    /// Its size.
    pub block_bytes: u64,
    /// XXH3-64 of its bytes.
    pub data_checksum: u64,
    /// Write sequence number.
    pub write_seq: u64,
}

/// Rounds up to the O_DIRECT alignment.
pub const fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

impl SlotHeader {
    /// Encodes into the first 64 bytes of `out` (the rest of the page stays zero).
    pub fn encode(&self, out: &mut [u8]) {
        let words = [
            MAGIC,
            self.hash.0,
            self.parent.map_or(0, |p| p.0),
            self.block_bytes,
            self.data_checksum,
            u64::from(self.parent.is_some()),
            self.write_seq,
        ];
        for (i, w) in words.iter().enumerate() {
            out[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        let sum = xxh3_64(&out[..56]);
        out[56..64].copy_from_slice(&sum.to_le_bytes());
    }

    /// Decodes a header page; None if it is empty, foreign or torn.
    pub fn decode(page: &[u8]) -> Option<SlotHeader> {
        let w = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(page.get(i * 8..i * 8 + 8)?.try_into().ok()?))
        };
        if w(0)? != MAGIC || xxh3_64(page.get(..56)?) != w(7)? {
            return None;
        }
        let flags = w(5)?;
        // Only what `encode` writes is a header: no unknown flag, no parent word without the
        // flag that says there is a parent (found by fuzzing: such a page decoded, and did
        // not encode back to itself).
        if flags > 1 || (flags == 0 && w(2)? != 0) {
            return None;
        }
        Some(SlotHeader {
            hash: SequenceHash(w(1)?),
            parent: (flags & 1 == 1).then_some(SequenceHash(w(2)?)),
            block_bytes: w(3)?,
            data_checksum: w(4)?,
            write_seq: w(6)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_any_flipped_bit_is_rejected() {
        let h = SlotHeader {
            hash: SequenceHash(42),
            parent: Some(SequenceHash(7)),
            block_bytes: 368_640,
            data_checksum: 99,
            write_seq: 3,
        };
        let mut page = vec![0u8; HEADER_BYTES as usize];
        h.encode(&mut page);
        assert_eq!(SlotHeader::decode(&page), Some(h));
        for bit in 0..64 * 8 {
            let mut p = page.clone();
            p[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(SlotHeader::decode(&p), None, "bit {bit}");
        }
        assert_eq!(SlotHeader::decode(&[0u8; 4096]), None);
        assert_eq!(SlotHeader::decode(&[1u8; 10]), None);
        assert_eq!(align_up(1), 4096);
        assert_eq!(align_up(8192), 8192);
    }

    /// A parent word without the flag that says there is a parent, correctly checksummed, is
    /// not a header `encode` writes: refused (found by the `slot_header` fuzz target).
    #[test]
    fn a_parent_word_without_its_flag_is_refused() {
        let h = SlotHeader {
            hash: SequenceHash(42),
            parent: None,
            block_bytes: 4096,
            data_checksum: 1,
            write_seq: 3,
        };
        let mut page = vec![0u8; 4096];
        h.encode(&mut page);
        assert_eq!(SlotHeader::decode(&page), Some(h));
        page[16] = 1; // the parent word
        let sum = xxh3_64(&page[..56]);
        page[56..64].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(SlotHeader::decode(&page), None);
    }
}
