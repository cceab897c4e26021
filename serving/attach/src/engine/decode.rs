//! Engine KV event batches as vLLM and SGLang publish them, decoded from msgpack.
//!
//! Both engines declare their events as msgspec structs ("tagged" by class name) and encode a
//! batch as `[ts, events, rank]`:
//! - vLLM (recent): each event a map whose `"type"` key names it, fields whose value is the
//!   default omitted; the batch's rank is `data_parallel_rank`. Older vLLM: each event a
//!   positional array `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]`
//!   and a batch without the rank.
//! - SGLang: positional arrays `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, metadata?]`, `["BlockRemoved", block_hashes, medium?]`,
//!   signed 64-bit hashes, media `GPU`, `CPU_PINNED`, `DISK`, `EXTERNAL`; batch `[ts, events,
//!   attn_dp_rank]`.
//!
//! Either shape is accepted whatever the engine (the flavor only decides what positions past
//! the sixth mean); unknown keys and trailing fields are skipped. Hashes are integers (signed
//! or unsigned 64-bit) or 32-byte binaries.

use super::msgpack::{Int, Kind, MsgpackError, Reader};
use kvfabric::events::TierKind;

/// Which engine published a batch (what positional fields past `medium` mean).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    /// vLLM: `lora_name, extra_keys, group_idx, kv_cache_spec_kind` follow `medium`.
    #[default]
    Vllm,
    /// SGLang: an optional `metadata` struct follows `medium`.
    Sglang,
}

impl std::str::FromStr for Flavor {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vllm" => Ok(Flavor::Vllm),
            "sglang" => Ok(Flavor::Sglang),
            _ => Err(format!("unknown engine {s:?} (vllm or sglang)")),
        }
    }
}

/// An engine's block hash: an integer (a signed hash kept as its bits) or a 32-byte digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// A 64-bit integer.
    Int(u64),
    /// A 32-byte binary.
    Bytes([u8; 32]),
}

/// Where an engine says a block is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// A tier of kvfabric's hierarchy.
    Tier(TierKind),
    /// A name this build does not know.
    Unknown,
}

impl Medium {
    fn parse(s: &[u8]) -> Medium {
        match s {
            b"GPU" => Medium::Tier(TierKind::Device),
            b"CPU" | b"CPU_PINNED" => Medium::Tier(TierKind::Host),
            b"DISK" | b"STORAGE" => Medium::Tier(TierKind::Disk),
            b"EXTERNAL" => Medium::Tier(TierKind::Remote),
            _ => Medium::Unknown,
        }
    }
}

/// `BlockStored`: a chain of full blocks.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored {
    /// The blocks, parent first.
    pub hashes: Vec<EngineHash>,
    /// The block before the first one.
    pub parent: Option<EngineHash>,
    /// `hashes.len() × block_size` tokens.
    pub tokens: Vec<u32>,
    /// Tokens per block.
    pub block_size: u64,
    /// Blocks of a LoRA adapter (`lora_id` or `lora_name` set).
    pub lora: bool,
    /// Blocks keyed by more than their tokens (multimodal inputs, a cache salt: non-empty
    /// `extra_keys`), or tokens that are not plain ids: the router cannot key them.
    pub unkeyable: bool,
    /// Where they are held (None: the engine's default, its GPU).
    pub medium: Option<Medium>,
    /// The KV cache group (hybrid models).
    pub group: Option<i64>,
    /// The group's attention kind; None when not sent (full attention).
    pub full_attention: Option<bool>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Removed {
    /// The blocks.
    pub hashes: Vec<EngineHash>,
    /// Where they were held.
    pub medium: Option<Medium>,
    /// The KV cache group.
    pub group: Option<i64>,
}

/// One event.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Blocks stored.
    Stored(Stored),
    /// Blocks removed.
    Removed(Removed),
    /// Everything gone.
    Cleared,
    /// An event type this build does not know (skipped).
    Unknown,
}

/// One published batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    /// The engine's timestamp (seconds).
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank, when sent.
    pub rank: Option<i64>,
}

/// Why a payload is not an event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not valid msgpack, or not of the expected shape.
    #[error(transparent)]
    Msgpack(#[from] MsgpackError),
    /// Valid msgpack that breaks the events' rules.
    #[error("{0}")]
    Invalid(&'static str),
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8], flavor: Flavor) -> Result<EngineBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let mut batch = EngineBatch { ts: 0.0, events: Vec::new(), rank: None };
    match r.kind()? {
        Kind::Array => {
            let n = r.array()?;
            if n < 2 {
                return Err(DecodeError::Invalid("a batch has at least [ts, events]"));
            }
            batch.ts = r.float()?;
            events(&mut r, flavor, &mut batch.events)?;
            if n > 2 {
                batch.rank = opt_int(&mut r)?;
            }
            for _ in 3..n {
                r.skip()?;
            }
        }
        Kind::Map => {
            for _ in 0..r.map()? {
                match key(&mut r)? {
                    b"ts" => batch.ts = r.float()?,
                    b"events" => events(&mut r, flavor, &mut batch.events)?,
                    b"data_parallel_rank" | b"attn_dp_rank" => batch.rank = opt_int(&mut r)?,
                    _ => r.skip()?,
                }
            }
        }
        _ => return Err(DecodeError::Invalid("a batch is an array or a map")),
    }
    if r.remaining() != 0 {
        return Err(DecodeError::Invalid("bytes after the batch"));
    }
    Ok(batch)
}

fn key<'a>(r: &mut Reader<'a>) -> Result<&'a [u8], DecodeError> {
    Ok(r.str()?)
}

fn opt_int(r: &mut Reader<'_>) -> Result<Option<i64>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(match r.int()? {
        Int::U(v) => i64::try_from(v).map_err(|_| DecodeError::Invalid("integer out of range"))?,
        Int::I(v) => v,
    }))
}

fn events(
    r: &mut Reader<'_>,
    flavor: Flavor,
    out: &mut Vec<EngineEvent>,
) -> Result<(), DecodeError> {
    let n = r.array()?;
    out.reserve(n);
    for _ in 0..n {
        out.push(event(r, flavor)?);
    }
    Ok(())
}

fn event(r: &mut Reader<'_>, flavor: Flavor) -> Result<EngineEvent, DecodeError> {
    match r.kind()? {
        Kind::Array => positional(r, flavor),
        Kind::Map => tagged(r),
        _ => Err(DecodeError::Invalid("an event is an array or a map")),
    }
}

/// `{"type": "BlockStored", "block_hashes": [...], ...}` in any key order.
fn tagged(r: &mut Reader<'_>) -> Result<EngineEvent, DecodeError> {
    let n = r.map()?;
    let mut tag: Option<&[u8]> = None;
    let mut s = Stored::default();
    for _ in 0..n {
        match key(r)? {
            b"type" => tag = Some(r.str()?),
            b"block_hashes" => s.hashes = hashes(r)?,
            b"parent_block_hash" => s.parent = opt_hash(r)?,
            b"token_ids" => s.unkeyable |= tokens(r, &mut s.tokens)?,
            b"block_size" => s.block_size = r.uint(u64::from(u32::MAX))?,
            b"lora_id" | b"lora_name" => s.lora |= present(r)?,
            b"medium" => s.medium = medium(r)?,
            b"extra_keys" => s.unkeyable |= extra_keys(r)?,
            b"group_idx" => s.group = opt_int(r)?,
            b"kv_cache_spec_kind" => {
                s.full_attention = if r.nil()? { None } else { Some(r.str()? == b"full_attention") }
            }
            _ => r.skip()?,
        }
    }
    Ok(match tag {
        Some(b"BlockStored") => EngineEvent::Stored(s),
        Some(b"BlockRemoved") => {
            EngineEvent::Removed(Removed { hashes: s.hashes, medium: s.medium, group: s.group })
        }
        Some(b"AllBlocksCleared") => EngineEvent::Cleared,
        Some(_) => EngineEvent::Unknown,
        None => return Err(DecodeError::Invalid("an event map without \"type\"")),
    })
}

/// `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]`.
fn positional(r: &mut Reader<'_>, flavor: Flavor) -> Result<EngineEvent, DecodeError> {
    let n = r.array()?;
    if n == 0 {
        return Err(DecodeError::Invalid("an event array without its tag"));
    }
    let tag = r.str()?;
    let mut left = n - 1;
    let mut field = || {
        if left == 0 {
            return false;
        }
        left -= 1;
        true
    };
    let ev = match tag {
        b"BlockStored" => {
            let mut s = Stored::default();
            if !field() {
                return Err(DecodeError::Invalid("BlockStored without block_hashes"));
            }
            s.hashes = hashes(r)?;
            if field() {
                s.parent = opt_hash(r)?;
            }
            if !field() {
                return Err(DecodeError::Invalid("BlockStored without token_ids"));
            }
            s.unkeyable |= tokens(r, &mut s.tokens)?;
            if !field() {
                return Err(DecodeError::Invalid("BlockStored without block_size"));
            }
            s.block_size = r.uint(u64::from(u32::MAX))?;
            if field() {
                s.lora |= present(r)?;
            }
            if field() {
                s.medium = medium(r)?;
            }
            if flavor == Flavor::Vllm {
                if field() {
                    s.lora |= present(r)?; // lora_name
                }
                if field() {
                    s.unkeyable |= extra_keys(r)?;
                }
                if field() {
                    s.group = opt_int(r)?;
                }
                if field() {
                    s.full_attention =
                        if r.nil()? { None } else { Some(r.str()? == b"full_attention") };
                }
            }
            EngineEvent::Stored(s)
        }
        b"BlockRemoved" => {
            let mut rm = Removed::default();
            if !field() {
                return Err(DecodeError::Invalid("BlockRemoved without block_hashes"));
            }
            rm.hashes = hashes(r)?;
            if field() {
                rm.medium = medium(r)?;
            }
            if flavor == Flavor::Vllm && field() {
                rm.group = opt_int(r)?;
            }
            EngineEvent::Removed(rm)
        }
        b"AllBlocksCleared" => EngineEvent::Cleared,
        _ => EngineEvent::Unknown,
    };
    for _ in 0..left {
        r.skip()?;
    }
    Ok(ev)
}

/// Skips a value; true unless it was nil.
fn present(r: &mut Reader<'_>) -> Result<bool, DecodeError> {
    if r.nil()? {
        return Ok(false);
    }
    r.skip()?;
    Ok(true)
}

fn hash(r: &mut Reader<'_>) -> Result<EngineHash, DecodeError> {
    match r.kind()? {
        Kind::Int => Ok(EngineHash::Int(match r.int()? {
            Int::U(v) => v,
            Int::I(v) => v as u64,
        })),
        Kind::Bin => {
            let b = r.bin()?;
            let a: [u8; 32] =
                b.try_into().map_err(|_| DecodeError::Invalid("a binary hash is not 32 bytes"))?;
            Ok(EngineHash::Bytes(a))
        }
        _ => Err(DecodeError::Invalid("a block hash is an integer or a 32-byte binary")),
    }
}

fn opt_hash(r: &mut Reader<'_>) -> Result<Option<EngineHash>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    hash(r).map(Some)
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<EngineHash>, DecodeError> {
    let n = r.array()?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(hash(r)?);
    }
    Ok(v)
}

/// Reads token ids into `out`; true when some are not plain ids (SGLang's bigram pairs).
fn tokens(r: &mut Reader<'_>, out: &mut Vec<u32>) -> Result<bool, DecodeError> {
    let n = r.array()?;
    out.reserve(n);
    let mut odd = false;
    for _ in 0..n {
        if r.kind()? == Kind::Int {
            match r.int()? {
                Int::U(v) if v <= u64::from(u32::MAX) => out.push(v as u32),
                _ => return Err(DecodeError::Invalid("a token id out of range")),
            }
        } else {
            r.skip()?;
            out.push(0);
            odd = true;
        }
    }
    Ok(odd)
}

fn medium(r: &mut Reader<'_>) -> Result<Option<Medium>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(Medium::parse(r.str()?)))
}

/// True when some block has extra keys (`extra_keys` is None, or a list of None per block,
/// when the tokens alone key the blocks).
fn extra_keys(r: &mut Reader<'_>) -> Result<bool, DecodeError> {
    if r.nil()? {
        return Ok(false);
    }
    let mut any = false;
    for _ in 0..r.array()? {
        if !r.nil()? {
            r.skip()?;
            any = true;
        }
    }
    Ok(any)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::msgpack::Writer;

    #[test]
    fn positional_sglang_with_signed_hashes_media_and_metadata() {
        let mut w = Writer::new();
        w.array(3).float(1.5).array(2);
        w.array(8).str("BlockStored").array(1).int(-5).nil().array(2).uint(7).uint(8).uint(2);
        w.nil().str("CPU_PINNED").array(1).uint(3);
        w.array(3).str("BlockRemoved").array(1).int(-5).str("EXTERNAL");
        w.uint(3);
        let b = decode_batch(&w.buf, Flavor::Sglang).unwrap();
        assert_eq!(b.rank, Some(3));
        let EngineEvent::Stored(s) = &b.events[0] else { panic!("{b:?}") };
        assert_eq!(s.hashes, [EngineHash::Int((-5i64) as u64)]);
        assert_eq!((s.tokens.as_slice(), s.block_size), (&[7, 8][..], 2));
        assert_eq!(s.medium, Some(Medium::Tier(TierKind::Host)));
        assert!(!s.lora && !s.unkeyable);
        let EngineEvent::Removed(rm) = &b.events[1] else { panic!() };
        assert_eq!(rm.medium, Some(Medium::Tier(TierKind::Remote)));
    }

    #[test]
    fn tagged_maps_ignore_unknown_keys_and_flag_what_cannot_be_keyed() {
        let mut w = Writer::new();
        w.map(2).str("events").array(3);
        w.map(6).str("type").str("BlockStored").str("block_hashes").array(1).bin(&[9; 32]);
        w.str("token_ids").array(1).uint(4).str("block_size").uint(1);
        w.str("extra_keys").array(1).array(1).str("img");
        w.str("future_field").map(1).str("x").uint(1);
        w.map(1).str("type").str("SomethingNew");
        w.map(1).str("type").str("AllBlocksCleared");
        w.str("ts").float(2.0);
        let b = decode_batch(&w.buf, Flavor::Vllm).unwrap();
        assert_eq!(b.rank, None);
        let EngineEvent::Stored(s) = &b.events[0] else { panic!() };
        assert_eq!(s.hashes, [EngineHash::Bytes([9; 32])]);
        assert!(s.unkeyable, "extra keys make it unkeyable");
        assert_eq!(&b.events[1..], &[EngineEvent::Unknown, EngineEvent::Cleared]);
    }

    #[test]
    fn malformed_batches_are_errors() {
        for bad in [&[][..], &[0x92, 0xcb], &[0x91, 0xc0], &[0x92, 0x00, 0x91, 0x80], &[0x90]] {
            assert!(decode_batch(bad, Flavor::Vllm).is_err(), "{bad:?}");
        }
        // A 16-byte binary hash.
        let mut w = Writer::new();
        w.array(2).float(0.0).array(1).array(2).str("BlockRemoved").array(1).bin(&[1; 16]);
        assert!(decode_batch(&w.buf, Flavor::Vllm).is_err());
    }
}
