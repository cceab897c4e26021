//! One type for every secret kvfabric holds: the shared secret of the handshakes, API keys,
//! tenant keys, control-plane passwords and tokens.
//!
//! A [`Secret`] prints as `<redacted>` in `Debug` and `Display`, so that no log line, panic
//! message or derived `Debug` of a configuration shows it; its bytes are zeroed when the last
//! clone drops (clones share one copy); comparing two takes time independent of where they
//! differ. The bytes are reached only through [`Secret::expose`], which makes each use visible
//! in review.

use std::sync::Arc;

use zeroize::Zeroize;

/// A secret value. See the module's notes.
#[derive(Clone, Default)]
pub struct Secret(Arc<Bytes>);

#[derive(Default)]
struct Bytes(Vec<u8>);

impl Drop for Bytes {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

/// What `Debug` and `Display` print for any secret.
pub const REDACTED: &str = "<redacted>";

impl Secret {
    /// A secret of these bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Secret(Arc::new(Bytes(bytes.into())))
    }

    /// The bytes, for the code that must use them (a MAC key, a header to compare).
    pub fn expose(&self) -> &[u8] {
        &self.0 .0
    }

    /// The bytes as text, if they are UTF-8 (passwords and tokens sent to a server).
    pub fn expose_str(&self) -> Option<&str> {
        std::str::from_utf8(self.expose()).ok()
    }

    /// Whether it has no bytes (no secret given).
    pub fn is_empty(&self) -> bool {
        self.0 .0.is_empty()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0 .0.len()
    }

    /// Compares with `other` in time that depends on their lengths only.
    pub fn matches(&self, other: &[u8]) -> bool {
        let mine = self.expose();
        if mine.len() != other.len() {
            return false;
        }
        mine.iter().zip(other).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    /// Reads a secret from a file (a container secret such as `/run/secrets/kvfabric`): the
    /// file's text without its trailing line break. An unreadable or empty file is an error.
    pub fn from_file(path: &std::path::Path) -> std::io::Result<Secret> {
        let mut bytes = std::fs::read(path)?;
        while matches!(bytes.last(), Some(b'\n' | b'\r')) {
            bytes.pop();
        }
        if bytes.is_empty() {
            bytes.zeroize();
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the file is empty"));
        }
        Ok(Secret::new(bytes))
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.matches(other.expose())
    }
}

impl Eq for Secret {}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl From<Vec<u8>> for Secret {
    fn from(v: Vec<u8>) -> Self {
        Secret::new(v)
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret::new(s.into_bytes())
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret::new(s.as_bytes())
    }
}

impl From<&[u8]> for Secret {
    fn from(s: &[u8]) -> Self {
        Secret::new(s)
    }
}

impl<const N: usize> From<&[u8; N]> for Secret {
    fn from(s: &[u8; N]) -> Self {
        Secret::new(&s[..])
    }
}

impl<'de> serde::Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret::from)
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret::from(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints_and_compares_by_value() {
        let s = Secret::from("hunter2-topsecret");
        assert_eq!(format!("{s:?} {s} {:?}", Some(&s)), "<redacted> <redacted> Some(<redacted>)");
        assert_eq!(s.expose(), b"hunter2-topsecret");
        assert!(s.matches(b"hunter2-topsecret"));
        assert!(!s.matches(b"hunter2-topsecreT"));
        assert!(!s.matches(b"hunter2"));
        assert_eq!(s, s.clone());
        assert_ne!(s, Secret::from("other"));
    }

    #[test]
    fn a_secret_file_loses_its_line_break_and_an_empty_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, "abc\r\n").unwrap();
        assert_eq!(Secret::from_file(&p).unwrap().expose(), b"abc");
        std::fs::write(&p, "\n").unwrap();
        assert!(Secret::from_file(&p).is_err());
        assert!(Secret::from_file(&dir.path().join("missing")).is_err());
    }
}
