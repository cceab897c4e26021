//! A bounded MessagePack reader (and the small writer the tests and benchmarks use).
//!
//! Only what engine KV events need: nil, booleans, integers, floats, strings, binaries,
//! arrays and maps. Every length is checked against the bytes that remain before anything is
//! allocated or sliced, nesting is limited, and no input can panic the reader.

/// Why a payload could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("msgpack at byte {offset}: {what}")]
pub struct MsgpackError {
    /// Where in the payload.
    pub offset: usize,
    /// What was wrong.
    pub what: &'static str,
}

/// Deepest nesting skipped over (events are at most four levels deep).
const MAX_DEPTH: usize = 32;

/// An integer as msgpack encodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    /// A non-negative value.
    U(u64),
    /// A negative value.
    I(i64),
}

/// What the next value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// nil
    Nil,
    /// true or false
    Bool,
    /// any integer
    Int,
    /// float 32 or 64
    Float,
    /// a UTF-8 string (not checked)
    Str,
    /// a binary
    Bin,
    /// an array
    Array,
    /// a map
    Map,
    /// an extension type
    Ext,
}

/// Reads values from a byte slice, front to back.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The offset of the next byte.
    pub fn offset(&self) -> usize {
        self.pos
    }

    fn err<T>(&self, what: &'static str) -> Result<T, MsgpackError> {
        Err(MsgpackError { offset: self.pos, what })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        if n > self.remaining() {
            return self.err("truncated");
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, MsgpackError> {
        Ok(self.take(1)?[0])
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn peek(&self) -> Result<u8, MsgpackError> {
        match self.buf.get(self.pos) {
            Some(b) => Ok(*b),
            None => self.err("truncated"),
        }
    }

    /// The kind of the next value.
    pub fn kind(&self) -> Result<Kind, MsgpackError> {
        Ok(match self.peek()? {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xca | 0xcb => Kind::Float,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            _ => return self.err("reserved marker 0xc1"),
        })
    }

    /// Reads a nil if the next value is one.
    pub fn nil(&mut self) -> Result<bool, MsgpackError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// An element count, bounded by the bytes left (every element takes at least one byte
    /// per `min_bytes`).
    fn count(&mut self, n: u64, min_bytes: u64) -> Result<usize, MsgpackError> {
        if n.saturating_mul(min_bytes) > self.remaining() as u64 {
            return self.err("length beyond the end of the payload");
        }
        Ok(n as usize)
    }

    /// The length of an array.
    pub fn array(&mut self) -> Result<usize, MsgpackError> {
        let n = match self.byte()? {
            m @ 0x90..=0x9f => u64::from(m & 0x0f),
            0xdc => u64::from(u16::from_be_bytes(self.be()?)),
            0xdd => u64::from(u32::from_be_bytes(self.be()?)),
            _ => {
                self.pos -= 1;
                return self.err("expected an array");
            }
        };
        self.count(n, 1)
    }

    /// The number of entries of a map.
    pub fn map(&mut self) -> Result<usize, MsgpackError> {
        let n = match self.byte()? {
            m @ 0x80..=0x8f => u64::from(m & 0x0f),
            0xde => u64::from(u16::from_be_bytes(self.be()?)),
            0xdf => u64::from(u32::from_be_bytes(self.be()?)),
            _ => {
                self.pos -= 1;
                return self.err("expected a map");
            }
        };
        self.count(n, 2)
    }

    /// A string's bytes.
    pub fn str(&mut self) -> Result<&'a [u8], MsgpackError> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => usize::from(self.byte()?),
            0xda => usize::from(u16::from_be_bytes(self.be()?)),
            0xdb => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos -= 1;
                return self.err("expected a string");
            }
        };
        self.take(n)
    }

    /// A binary's bytes.
    pub fn bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        let n = match self.byte()? {
            0xc4 => usize::from(self.byte()?),
            0xc5 => usize::from(u16::from_be_bytes(self.be()?)),
            0xc6 => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos -= 1;
                return self.err("expected a binary");
            }
        };
        self.take(n)
    }

    /// An integer.
    pub fn int(&mut self) -> Result<Int, MsgpackError> {
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => Int::U(u64::from(b)),
            0xe0..=0xff => Int::I(i64::from(b as i8)),
            0xcc => Int::U(u64::from(self.byte()?)),
            0xcd => Int::U(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Int::U(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Int::U(u64::from_be_bytes(self.be()?)),
            0xd0 => signed(i64::from(self.byte()? as i8)),
            0xd1 => signed(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => signed(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos -= 1;
                return self.err("expected an integer");
            }
        })
    }

    /// A non-negative integer that fits `max`.
    pub fn uint(&mut self, max: u64) -> Result<u64, MsgpackError> {
        let at = self.pos;
        match self.int()? {
            Int::U(v) if v <= max => Ok(v),
            _ => Err(MsgpackError { offset: at, what: "integer out of range" }),
        }
    }

    /// A float (an integer is accepted too).
    pub fn float(&mut self) -> Result<f64, MsgpackError> {
        match self.peek()? {
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            _ => match self.int()? {
                Int::U(v) => Ok(v as f64),
                Int::I(v) => Ok(v as f64),
            },
        }
    }

    /// Skips one value, whatever it is.
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: usize) -> Result<(), MsgpackError> {
        if depth > MAX_DEPTH {
            return self.err("nested too deeply");
        }
        match self.kind()? {
            Kind::Nil | Kind::Bool => {
                self.pos += 1;
            }
            Kind::Int => {
                self.int()?;
            }
            Kind::Float => {
                self.float()?;
            }
            Kind::Str => {
                self.str()?;
            }
            Kind::Bin => {
                self.bin()?;
            }
            Kind::Array => {
                for _ in 0..self.array()? {
                    self.skip_at(depth + 1)?;
                }
            }
            Kind::Map => {
                for _ in 0..self.map()? {
                    self.skip_at(depth + 1)?;
                    self.skip_at(depth + 1)?;
                }
            }
            Kind::Ext => {
                let n = match self.byte()? {
                    0xd4 => 1,
                    0xd5 => 2,
                    0xd6 => 4,
                    0xd7 => 8,
                    0xd8 => 16,
                    0xc7 => usize::from(self.byte()?),
                    0xc8 => usize::from(u16::from_be_bytes(self.be()?)),
                    _ => u32::from_be_bytes(self.be()?) as usize,
                };
                self.take(n.saturating_add(1))?;
            }
        }
        Ok(())
    }
}

fn signed(v: i64) -> Int {
    if v >= 0 {
        Int::U(v as u64)
    } else {
        Int::I(v)
    }
}

/// Writes msgpack values (the shortest encodings, as msgspec does).
#[derive(Debug, Default, Clone)]
pub struct Writer {
    /// The bytes written.
    pub buf: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Writer::default()
    }

    /// nil
    pub fn nil(&mut self) -> &mut Self {
        self.buf.push(0xc0);
        self
    }

    /// An array header.
    pub fn array(&mut self, n: usize) -> &mut Self {
        self.header(n, 0x90, 0xdc, 0xdd)
    }

    /// A map header.
    pub fn map(&mut self, n: usize) -> &mut Self {
        self.header(n, 0x80, 0xde, 0xdf)
    }

    fn header(&mut self, n: usize, fix: u8, m16: u8, m32: u8) -> &mut Self {
        if n < 16 {
            self.buf.push(fix | n as u8);
        } else if n <= usize::from(u16::MAX) {
            self.buf.push(m16);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(m32);
            self.buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self
    }

    /// A string.
    pub fn str(&mut self, s: &str) -> &mut Self {
        let n = s.len();
        if n < 32 {
            self.buf.push(0xa0 | n as u8);
        } else if n < 256 {
            self.buf.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            self.buf.push(0xda);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xdb);
            self.buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.buf.extend_from_slice(s.as_bytes());
        self
    }

    /// A binary.
    pub fn bin(&mut self, b: &[u8]) -> &mut Self {
        let n = b.len();
        if n < 256 {
            self.buf.extend_from_slice(&[0xc4, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            self.buf.push(0xc5);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xc6);
            self.buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.buf.extend_from_slice(b);
        self
    }

    /// A non-negative integer.
    pub fn uint(&mut self, v: u64) -> &mut Self {
        if v < 128 {
            self.buf.push(v as u8);
        } else if v < 256 {
            self.buf.extend_from_slice(&[0xcc, v as u8]);
        } else if v < 65_536 {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
        self
    }

    /// A signed integer.
    pub fn int(&mut self, v: i64) -> &mut Self {
        if v >= 0 {
            return self.uint(v as u64);
        }
        if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else if v >= i64::from(i8::MIN) {
            self.buf.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.buf.push(0xd1);
            self.buf.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.buf.push(0xd2);
            self.buf.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
        self
    }

    /// A float64.
    pub fn float(&mut self, v: f64) -> &mut Self {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn integers_round_trip_in_every_width() {
        let values = [0i64, 1, 127, 128, 255, 256, 65_535, 65_536, -1, -32, -33, -128, -129];
        for v in values.into_iter().chain([i64::MIN, i64::MAX, i64::from(u32::MAX) + 1]) {
            let mut w = Writer::new();
            w.int(v);
            let got = Reader::new(&w.buf).int().unwrap();
            let want = if v < 0 { Int::I(v) } else { Int::U(v as u64) };
            assert_eq!(got, want, "{v}");
        }
        let mut w = Writer::new();
        w.uint(u64::MAX);
        assert_eq!(Reader::new(&w.buf).int().unwrap(), Int::U(u64::MAX));
        // A signed encoding of a non-negative value reads as unsigned.
        assert_eq!(Reader::new(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 5]).int().unwrap(), Int::U(5));
    }

    #[test]
    fn lengths_beyond_the_payload_are_refused_before_anything_is_allocated() {
        // An array claiming 4 billion elements in 5 bytes.
        let e = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).array().unwrap_err();
        assert_eq!(e.what, "length beyond the end of the payload");
        assert!(Reader::new(&[0xdb, 0, 0, 0, 9, b'a']).str().is_err());
        assert!(Reader::new(&[0xc1]).skip().is_err());
        // Deep nesting stops at the limit.
        let deep = vec![0x91u8; 100];
        assert_eq!(Reader::new(&deep).skip().unwrap_err().what, "nested too deeply");
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut r = Reader::new(&bytes);
            while r.remaining() > 0 && r.skip().is_ok() {}
        }
    }
}
