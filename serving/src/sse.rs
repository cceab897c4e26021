//! The one reader of server-sent events: kvfabric's client of engines' OpenAI APIs
//! ([`crate::openai`]) and the benchmarks' (`kvfabric bench serve`) both read streams with it.
//!
//! As the HTML standard specifies them: lines end in CRLF, LF or CR, split anywhere across
//! reads; a blank line dispatches the event; `data` lines are joined with newlines; one space
//! after the colon is dropped, none is needed; lines that start with a colon are comments; a
//! field without a colon has an empty value; `event`, `id` and `retry` are read and kept (the
//! last of each). Bounded: a line, or an event's data, longer than [`SseParser::max_event`]
//! is a typed error, not an allocation a hostile server chooses.

/// Why a stream could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A line, or the data of one event, over the bound.
    #[error("a server-sent event over {max} bytes")]
    TooLarge {
        /// The bound.
        max: usize,
    },
}

/// One event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// Its type (`event:`); None: `message`.
    pub event: Option<String>,
    /// Its data lines, joined with newlines.
    pub data: String,
    /// The last `id:` seen in the stream so far.
    pub id: Option<String>,
}

/// An incremental parser: feed bytes, get every event they complete.
#[derive(Debug)]
pub struct SseParser {
    max: usize,
    /// Bytes of the line being read.
    line: Vec<u8>,
    /// The last byte fed was a CR: a LF right after it belongs to the same line end.
    after_cr: bool,
    /// The event being read.
    data: String,
    has_data: bool,
    event: Option<String>,
    id: Option<String>,
}

/// The bound of [`SseParser::default`]: 1 MiB per line and per event.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

impl Default for SseParser {
    fn default() -> Self {
        SseParser::new(MAX_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser whose lines and events are at most `max_event` bytes.
    pub fn new(max_event: usize) -> Self {
        SseParser {
            max: max_event.max(1),
            line: Vec::new(),
            after_cr: false,
            data: String::new(),
            has_data: false,
            event: None,
            id: None,
        }
    }

    /// The bound on a line and on an event's data, bytes.
    pub fn max_event(&self) -> usize {
        self.max
    }

    /// Feeds bytes; the events they complete, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut events = Vec::new();
        for &b in bytes {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\r' => {
                    self.after_cr = true;
                    self.end_line(&mut events)?;
                }
                b'\n' => self.end_line(&mut events)?,
                _ => {
                    if self.line.len() >= self.max {
                        return Err(SseError::TooLarge { max: self.max });
                    }
                    self.line.push(b);
                }
            }
        }
        Ok(events)
    }

    /// [`Self::push`] for readers that want only each event's data.
    pub fn push_data(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        Ok(self.push(bytes)?.into_iter().map(|e| e.data).collect())
    }

    fn end_line(&mut self, events: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if self.has_data {
                events.push(SseEvent {
                    event: self.event.take(),
                    data: std::mem::take(&mut self.data),
                    id: self.id.clone(),
                });
            }
            self.data.clear();
            self.has_data = false;
            self.event = None;
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(()); // a comment
        }
        let (field, value) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (&line[..], &[][..]),
        };
        let text = || String::from_utf8_lossy(value).into_owned();
        match field {
            b"data" => {
                if self.data.len() + value.len() + 1 > self.max {
                    return Err(SseError::TooLarge { max: self.max });
                }
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&String::from_utf8_lossy(value));
                self.has_data = true;
            }
            b"event" => self.event = Some(text()),
            // An id with a NUL is ignored, as the standard says.
            b"id" if !value.contains(&0) => self.id = Some(text()),
            _ => {} // `retry` and unknown fields: nothing a reader here acts on
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(input: &[u8], chunk: usize) -> Vec<String> {
        let mut p = SseParser::default();
        input.chunks(chunk.max(1)).flat_map(|c| p.push_data(c).unwrap()).collect()
    }

    #[test]
    fn line_ends_spaces_comments_and_multiline_data_whatever_the_chunking() {
        let input = b": keep-alive\r\ndata: {\"a\":1}\r\n\r\ndata:{\"b\":2}\n\nevent: x\rdata: one\rdata:  two\r\r\
data\n\ndata: [DONE]\n\n";
        for chunk in 1..input.len() {
            assert_eq!(
                all(input, chunk),
                ["{\"a\":1}", "{\"b\":2}", "one\n two", "", "[DONE]"],
                "chunks of {chunk}"
            );
        }
    }

    #[test]
    fn an_event_without_its_blank_line_is_not_dispatched() {
        assert!(all(b"data: partial\n", 3).is_empty());
        assert!(all(b"id: 7\nretry: 10\n\n", 1).is_empty(), "no data: no event");
    }

    #[test]
    fn event_types_and_ids_are_kept() {
        let mut p = SseParser::default();
        let got = p.push(b"id: 1\nevent: delta\ndata: a\n\ndata: b\n\n").unwrap();
        assert_eq!(
            got[0],
            SseEvent { event: Some("delta".into()), data: "a".into(), id: Some("1".into()) }
        );
        assert_eq!(got[1], SseEvent { event: None, data: "b".into(), id: Some("1".into()) });
    }

    #[test]
    fn a_line_or_an_event_over_the_bound_is_an_error() {
        let mut p = SseParser::new(16);
        assert_eq!(p.push(&[b'x'; 17]), Err(SseError::TooLarge { max: 16 }));
        let mut p = SseParser::new(16);
        assert!(p.push(b"data: 0123456789\n").is_ok());
        assert_eq!(p.push(b"data: 0123456789\n"), Err(SseError::TooLarge { max: 16 }));
    }

    proptest::proptest! {
        /// Any bytes, cut anywhere: the same events, or the same error, never a panic.
        #[test]
        fn chunking_never_changes_what_is_read(
            bytes in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just(b'\r'), proptest::strategy::Just(b'\n'),
                proptest::strategy::Just(b':'), proptest::strategy::Just(b' '),
                proptest::strategy::Just(b'd'), proptest::strategy::Just(b'a'),
                proptest::strategy::Just(b't'), proptest::num::u8::ANY,
            ], 0..300),
            cut in 1usize..40,
        ) {
            let whole = SseParser::new(64).push(&bytes);
            let mut p = SseParser::new(64);
            let mut pieces = Vec::new();
            let mut err = None;
            for c in bytes.chunks(cut) {
                match p.push(c) {
                    Ok(e) => pieces.extend(e),
                    Err(e) => { err = Some(e); break; }
                }
            }
            match whole {
                Ok(events) => { proptest::prop_assert_eq!(err, None); proptest::prop_assert_eq!(events, pieces); }
                Err(e) => proptest::prop_assert_eq!(err, Some(e)),
            }
        }
    }
}
