//! A parser of server-sent events as the HTML standard specifies them: lines end in CRLF, LF
//! or CR (split anywhere across reads); a blank line dispatches the event; `data` lines are
//! joined with newlines; one space after the colon is dropped, none is needed; lines that
//! start with a colon are comments; a field without a colon has an empty value. Only the
//! `data` of events matters to the benchmark; `event`, `id` and `retry` are skipped.

/// Incremental SSE parser: feed bytes, get the data of each complete event.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the line being read.
    line: Vec<u8>,
    /// The last byte fed was a CR: a LF right after it belongs to the same line end.
    after_cr: bool,
    /// The data of the event being read.
    data: String,
    /// Whether a `data` field was seen in it.
    has_data: bool,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
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
                    self.end_line(&mut events);
                }
                b'\n' => self.end_line(&mut events),
                _ => self.line.push(b),
            }
        }
        events
    }

    fn end_line(&mut self, events: &mut Vec<String>) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            if self.has_data {
                events.push(std::mem::take(&mut self.data));
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        if line[0] == b':' {
            return; // a comment
        }
        let (field, value) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (&line[..], &[][..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(&String::from_utf8_lossy(value));
            self.has_data = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(input: &[u8], chunk: usize) -> Vec<String> {
        let mut p = SseParser::default();
        input.chunks(chunk.max(1)).flat_map(|c| p.push(c)).collect()
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
}
