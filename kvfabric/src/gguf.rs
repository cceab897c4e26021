//! A bounds-checked reader of GGUF headers: the metadata key/value section and the tensor
//! infos, never the tensor data.
//!
//! GGUF (v2 and v3) starts with `b"GGUF"`, a `u32` version, a `u64` tensor count and a `u64`
//! metadata count, then the metadata (`string key`, `u32 type`, value) and the tensor infos
//! (`string name`, `u32 n_dims`, `u64 dims[n_dims]`, `u32 ggml type`, `u64 offset`), all
//! little-endian. Every length read from the file is checked against a limit before anything
//! is allocated, so a hostile or truncated file yields a [`GgufError`], never a panic or a huge
//! allocation. Arrays (the tokenizer's vocabulary, for instance) are kept only when they hold
//! scalars or strings and are under [`GgufLimits::array_items_max`] items.

use std::collections::BTreeMap;
use std::io::{self, BufReader, Read};
use std::path::Path;

/// The four magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// Why a GGUF header could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or read.
    #[error("reading GGUF: {0}")]
    Io(#[from] io::Error),
    /// The file does not start with `GGUF`.
    #[error("not a GGUF file (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// A GGUF version this reader does not know.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// The file ended inside the header.
    #[error("GGUF header truncated while reading {0}")]
    Truncated(&'static str),
    /// A count or length in the header is over this reader's limits.
    #[error("GGUF {what} is {value}, over the limit of {limit}")]
    LimitExceeded {
        /// What was too large.
        what: &'static str,
        /// The value found in the file.
        value: u64,
        /// The limit in force.
        limit: u64,
    },
    /// A metadata value type this reader does not know.
    #[error("unknown GGUF value type {0}")]
    UnknownType(u32),
    /// A string that is not UTF-8.
    #[error("GGUF string is not valid UTF-8")]
    BadUtf8,
}

/// Limits that bound what a header may make this reader allocate.
#[derive(Debug, Clone, Copy)]
pub struct GgufLimits {
    /// Longest string accepted, in bytes.
    pub string_bytes_max: u64,
    /// Most metadata entries accepted.
    pub metadata_entries_max: u64,
    /// Most tensors accepted.
    pub tensors_max: u64,
    /// Arrays longer than this are skipped (their length is kept), not stored.
    pub array_items_max: u64,
}

impl Default for GgufLimits {
    fn default() -> Self {
        GgufLimits {
            string_bytes_max: 1 << 20,
            metadata_entries_max: 1 << 16,
            tensors_max: 1 << 20,
            array_items_max: 1 << 10,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type, widened.
    Uint(u64),
    /// Any signed integer type, widened.
    Int(i64),
    /// `f32` or `f64`, widened.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array short enough to keep.
    Array(Vec<GgufValue>),
    /// An array that was skipped because of its size; its element count.
    SkippedArray(u64),
}

impl GgufValue {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::Uint(v) => Some(v),
            GgufValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's name, shape and ggml type (its data is not read).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// Tensor name, such as `blk.0.attn_k.weight`.
    pub name: String,
    /// Dimensions, innermost first as GGUF stores them.
    pub dims: Vec<u64>,
    /// The ggml type id.
    pub ggml_type: u32,
    /// Offset of the data in the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements (saturating on absurd shapes).
    pub fn elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor infos, in file order.
    pub tensors: Vec<GgufTensorInfo>,
}

impl GgufHeader {
    /// Reads the header of the GGUF file at `path`.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path)?;
        Self::read(&mut BufReader::with_capacity(1 << 16, file), GgufLimits::default())
    }

    /// Reads a header from `r`, within `limits`.
    pub fn read(r: &mut impl Read, limits: GgufLimits) -> Result<Self, GgufError> {
        let mut rd = Reader { r, limits };
        let magic: [u8; 4] = rd.array("magic")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = rd.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let tensor_count = rd.u64("tensor count")?;
        check("tensor count", tensor_count, limits.tensors_max)?;
        let kv_count = rd.u64("metadata count")?;
        check("metadata count", kv_count, limits.metadata_entries_max)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = rd.string("metadata key")?;
            let ty = rd.u32("metadata type")?;
            let value = rd.value(ty)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(tensor_count.min(4096) as usize);
        for _ in 0..tensor_count {
            let name = rd.string("tensor name")?;
            let n_dims = rd.u32("tensor dims")?;
            check("tensor rank", u64::from(n_dims), 8)?;
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(rd.u64("tensor dim")?);
            }
            let ggml_type = rd.u32("tensor type")?;
            let offset = rd.u64("tensor offset")?;
            tensors.push(GgufTensorInfo { name, dims, ggml_type, offset });
        }
        Ok(GgufHeader { version, metadata, tensors })
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// `general.architecture`, such as `llama`.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(GgufValue::as_str)
    }

    /// Total number of parameters: the sum of all tensors' element counts.
    pub fn parameter_count(&self) -> u64 {
        self.tensors.iter().fold(0u64, |acc, t| acc.saturating_add(t.elements()))
    }
}

fn check(what: &'static str, value: u64, limit: u64) -> Result<(), GgufError> {
    if value > limit {
        return Err(GgufError::LimitExceeded { what, value, limit });
    }
    Ok(())
}

struct Reader<'a, R: Read> {
    r: &'a mut R,
    limits: GgufLimits,
}

impl<R: Read> Reader<'_, R> {
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.r.read_exact(&mut buf).map_err(|e| eof(e, what))?;
        Ok(buf)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        check("string length", len, self.limits.string_bytes_max)?;
        let mut buf = Vec::new();
        let got = self.r.by_ref().take(len).read_to_end(&mut buf)?;
        if got as u64 != len {
            return Err(GgufError::Truncated(what));
        }
        String::from_utf8(buf).map_err(|_| GgufError::BadUtf8)
    }

    fn skip(&mut self, bytes: u64, what: &'static str) -> Result<(), GgufError> {
        let n = io::copy(&mut self.r.by_ref().take(bytes), &mut io::sink())?;
        if n != bytes {
            return Err(GgufError::Truncated(what));
        }
        Ok(())
    }

    fn value(&mut self, ty: u32) -> Result<GgufValue, GgufError> {
        const W: &str = "metadata value";
        Ok(match ty {
            0 => GgufValue::Uint(u64::from(u8::from_le_bytes(self.array(W)?))),
            1 => GgufValue::Int(i64::from(i8::from_le_bytes(self.array(W)?))),
            2 => GgufValue::Uint(u64::from(u16::from_le_bytes(self.array(W)?))),
            3 => GgufValue::Int(i64::from(i16::from_le_bytes(self.array(W)?))),
            4 => GgufValue::Uint(u64::from(self.u32(W)?)),
            5 => GgufValue::Int(i64::from(i32::from_le_bytes(self.array(W)?))),
            6 => GgufValue::Float(f64::from(f32::from_le_bytes(self.array(W)?))),
            7 => GgufValue::Bool(self.array::<1>(W)?[0] != 0),
            8 => GgufValue::String(self.string(W)?),
            9 => {
                let item_ty = self.u32("array type")?;
                let count = self.u64("array length")?;
                if count <= self.limits.array_items_max && item_ty != 9 {
                    let mut items = Vec::with_capacity(count as usize);
                    for _ in 0..count {
                        items.push(self.value(item_ty)?);
                    }
                    GgufValue::Array(items)
                } else {
                    self.skip_array(item_ty, count)?;
                    GgufValue::SkippedArray(count)
                }
            }
            10 => GgufValue::Uint(self.u64(W)?),
            11 => GgufValue::Int(i64::from_le_bytes(self.array(W)?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.array(W)?)),
            other => return Err(GgufError::UnknownType(other)),
        })
    }

    fn skip_array(&mut self, item_ty: u32, count: u64) -> Result<(), GgufError> {
        const W: &str = "array";
        let fixed = match item_ty {
            0 | 1 | 7 => Some(1u64),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        match (fixed, item_ty) {
            (Some(size), _) => self.skip(count.saturating_mul(size), W),
            (None, 8) => {
                for _ in 0..count {
                    let len = self.u64(W)?;
                    check("string length", len, self.limits.string_bytes_max)?;
                    self.skip(len, W)?;
                }
                Ok(())
            }
            // Nested arrays are legal GGUF but unused by any model we read; refuse them
            // rather than recurse without a depth limit.
            (None, 9) => {
                Err(GgufError::LimitExceeded { what: "array nesting", value: 2, limit: 1 })
            }
            (None, other) => Err(GgufError::UnknownType(other)),
        }
    }
}

fn eof(e: io::Error, what: &'static str) -> GgufError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        GgufError::Truncated(what)
    } else {
        GgufError::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a small GGUF header by hand.
    pub(crate) fn tiny_header() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&3u64.to_le_bytes()); // metadata
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        s(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "llama.block_count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&30u32.to_le_bytes());
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "b");
        s(&mut b, "blk.0.attn_k.weight");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&64u64.to_le_bytes());
        b.extend_from_slice(&3u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b
    }

    #[test]
    fn reads_a_hand_built_header() {
        let bytes = tiny_header();
        let h = GgufHeader::read(&mut bytes.as_slice(), GgufLimits::default()).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.architecture(), Some("llama"));
        assert_eq!(h.get("llama.block_count").and_then(GgufValue::as_u64), Some(30));
        assert_eq!(
            h.get("tokenizer.ggml.tokens"),
            Some(&GgufValue::Array(vec![
                GgufValue::String("a".into()),
                GgufValue::String("b".into())
            ]))
        );
        assert_eq!(h.tensors.len(), 1);
        assert_eq!(h.parameter_count(), 192);
    }

    #[test]
    fn long_arrays_are_skipped_not_stored() {
        let bytes = tiny_header();
        let limits = GgufLimits { array_items_max: 1, ..GgufLimits::default() };
        let h = GgufHeader::read(&mut bytes.as_slice(), limits).unwrap();
        assert_eq!(h.get("tokenizer.ggml.tokens"), Some(&GgufValue::SkippedArray(2)));
        assert_eq!(h.tensors[0].name, "blk.0.attn_k.weight");
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        let bytes = tiny_header();
        for cut in 0..bytes.len() {
            let err = GgufHeader::read(&mut &bytes[..cut], GgufLimits::default()).unwrap_err();
            assert!(
                matches!(err, GgufError::Truncated(_) | GgufError::BadMagic(_)),
                "cut at {cut}: {err}"
            );
        }
    }

    #[test]
    fn hostile_lengths_are_refused_before_allocating() {
        let mut bytes = tiny_header();
        // The first key's length sits right after the 24-byte preamble.
        bytes[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = GgufHeader::read(&mut bytes.as_slice(), GgufLimits::default()).unwrap_err();
        assert!(matches!(err, GgufError::LimitExceeded { what: "string length", .. }), "{err}");
        let mut bytes = tiny_header();
        bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = GgufHeader::read(&mut bytes.as_slice(), GgufLimits::default()).unwrap_err();
        assert!(matches!(err, GgufError::LimitExceeded { what: "metadata count", .. }), "{err}");
    }

    #[test]
    fn bad_magic_and_version() {
        let mut bytes = tiny_header();
        bytes[0] = b'X';
        assert!(matches!(
            GgufHeader::read(&mut bytes.as_slice(), GgufLimits::default()),
            Err(GgufError::BadMagic(_))
        ));
        let mut bytes = tiny_header();
        bytes[4..8].copy_from_slice(&9u32.to_le_bytes());
        assert!(matches!(
            GgufHeader::read(&mut bytes.as_slice(), GgufLimits::default()),
            Err(GgufError::UnsupportedVersion(9))
        ));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut with_magic = b"GGUF\x03\0\0\0".to_vec();
            with_magic.extend_from_slice(&data);
            let _ = GgufHeader::read(&mut data.as_slice(), GgufLimits::default());
            let _ = GgufHeader::read(&mut with_magic.as_slice(), GgufLimits::default());
        }

        #[test]
        fn corrupting_one_byte_never_panics(pos in 0usize..200, byte in proptest::num::u8::ANY) {
            let mut bytes = tiny_header();
            let pos = pos % bytes.len();
            bytes[pos] = byte;
            let _ = GgufHeader::read(&mut bytes.as_slice(), GgufLimits::default());
        }
    }
}
