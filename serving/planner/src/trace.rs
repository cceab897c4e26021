//! Public production traces in the Mooncake FAST'25 format, read as a stream, expanded into
//! token ids, and measured: the reuse an infinite cache would give (the trace's *limit*) and
//! the reuse of one LRU cache of any capacity (the reuse-vs-capacity curve).
//!
//! One request per line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [..]}`, one id per `block_tokens` (512) prompt tokens, the last block possibly
//! partial; equal ids are the same prefix block. [`TraceReader`] reads it line by line with
//! every line and number bounded: a malformed line is a [`TraceError`] naming it, never a
//! panic, and a trace of millions of lines is never held whole.
//!
//! [`Expander`] turns a request into token ids so that kvfabric's own chained block hashes
//! (16 tokens a block) share exactly what the trace's ids share: every id maps to the same
//! tokens wherever it appears (seeded), the last block cut at `input_length`.

use std::collections::HashMap;
use std::io::{BufRead, Read};
use std::path::Path;

use kvfabric::rng::SplitMix64;

/// Tokens per hash id in the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// A line longer than this is refused (a 200k-token prompt's ids take ~3 KiB).
pub const LINE_BYTES_MAX: usize = 1 << 20;
/// A prompt or answer longer than this many tokens is refused.
pub const LENGTH_MAX: u64 = 16 << 20;
/// The longest prompt a trace line may ask for unless raised (tokens, up to [`LENGTH_MAX`]):
/// eight times the longest of the conversation trace (126k), and a bound on what one
/// simulated request holds while it is in flight. A longer line is refused with its number.
pub const PROMPT_TOKENS_MAX: u64 = 1 << 20;
/// A timestamp past this (ms; a year) is refused.
pub const TIMESTAMP_MS_MAX: u64 = 365 * 24 * 3600 * 1000;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from the trace's start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Answer tokens.
    pub output_length: u64,
    /// One id per block of the prompt; equal ids are the same prefix block.
    pub hash_ids: Vec<u64>,
}

/// A trace replayed at another scale: each id's block as `to` tokens instead of `from` (the
/// same sharing on prompts `to / from` as long, for small engines and quick runs; a partial
/// last block keeps its share, rounded up), and answers cut at `output_max` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Reshape {
    /// Tokens per id in the trace.
    pub from: u32,
    /// Tokens per id replayed.
    pub to: u32,
    /// Answer tokens at most.
    pub output_max: u64,
}

impl Reshape {
    /// The trace as it is: ids of `block_tokens`, answers as long as they are.
    pub fn none(block_tokens: u32) -> Self {
        Reshape { from: block_tokens, to: block_tokens, output_max: u64::MAX }
    }

    /// `r` at the replayed scale (its ids unchanged).
    pub fn apply(&self, mut r: TraceRequest) -> TraceRequest {
        let (from, to) = (u64::from(self.from.max(1)), u64::from(self.to.max(1)));
        if from != to {
            let full = r.input_length / from;
            let partial = r.input_length % from;
            r.input_length = full * to + (partial * to).div_ceil(from);
        }
        r.output_length = r.output_length.min(self.output_max);
        r
    }
}

/// Why a trace cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("reading {what}: {source}")]
    Io {
        /// The file, or the line being read.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A line is not a request.
    #[error("trace line {line}: {reason}")]
    Line {
        /// 1-based.
        line: u64,
        /// What is wrong with it.
        reason: String,
    },
}

/// Reads a trace's requests in order, one line at a time.
#[derive(Debug)]
pub struct TraceReader<R> {
    input: R,
    block_tokens: u32,
    line: u64,
    last_timestamp: u64,
    buf: Vec<u8>,
    ended: bool,
    prompt_max: u64,
}

impl TraceReader<std::io::BufReader<std::fs::File>> {
    /// Opens a trace file whose ids cover `block_tokens` tokens each.
    pub fn open(path: &Path, block_tokens: u32) -> Result<Self, TraceError> {
        let f = std::fs::File::open(path)
            .map_err(|source| TraceError::Io { what: path.display().to_string(), source })?;
        Ok(TraceReader::new(std::io::BufReader::with_capacity(1 << 16, f), block_tokens))
    }
}

impl<R: BufRead> TraceReader<R> {
    /// Reads a trace from `input`, each id covering `block_tokens` tokens (at least 1).
    pub fn new(input: R, block_tokens: u32) -> Self {
        TraceReader {
            input,
            block_tokens: block_tokens.max(1),
            line: 0,
            last_timestamp: 0,
            buf: Vec::new(),
            ended: false,
            prompt_max: PROMPT_TOKENS_MAX,
        }
    }

    /// Refuses lines whose prompt is longer than `tokens` (1..=[`LENGTH_MAX`]; by default
    /// [`PROMPT_TOKENS_MAX`]).
    pub fn max_prompt_tokens(mut self, tokens: u64) -> Self {
        self.prompt_max = tokens.clamp(1, LENGTH_MAX);
        self
    }

    /// Lines read so far.
    pub fn lines(&self) -> u64 {
        self.line
    }

    fn parse(&mut self) -> Result<TraceRequest, TraceError> {
        let line = self.line;
        let bad = |reason: String| TraceError::Line { line, reason };
        let text = std::str::from_utf8(&self.buf).map_err(|_| bad("not UTF-8".into()))?;
        let r: TraceRequest = serde_json::from_str(text.trim()).map_err(|e| bad(e.to_string()))?;
        if r.timestamp > TIMESTAMP_MS_MAX {
            return Err(bad(format!("timestamp {} ms is past a year", r.timestamp)));
        }
        if r.input_length == 0 || r.input_length > LENGTH_MAX {
            return Err(bad(format!(
                "input_length {} is not within 1..={LENGTH_MAX}",
                r.input_length
            )));
        }
        if r.input_length > self.prompt_max {
            return Err(bad(format!(
                "input_length {} is over the longest prompt accepted, {} tokens \
                 (--max-prompt-tokens raises it, up to {LENGTH_MAX})",
                r.input_length, self.prompt_max
            )));
        }
        if r.output_length > LENGTH_MAX {
            return Err(bad(format!("output_length {} is over {LENGTH_MAX}", r.output_length)));
        }
        let bt = u64::from(self.block_tokens);
        let blocks = r.input_length.div_ceil(bt);
        if r.hash_ids.len() as u64 != blocks {
            return Err(bad(format!(
                "{} hash_ids for input_length {} (one id per {bt} tokens needs {blocks}; \
                 another block size? --trace-block-tokens)",
                r.hash_ids.len(),
                r.input_length
            )));
        }
        if r.timestamp < self.last_timestamp {
            return Err(bad(format!(
                "timestamp {} ms goes back from {} ms on the line before (requests must be in \
                 arrival order)",
                r.timestamp, self.last_timestamp
            )));
        }
        self.last_timestamp = r.timestamp;
        Ok(r)
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ended {
            return None;
        }
        loop {
            self.buf.clear();
            self.line += 1;
            let line = self.line;
            let read =
                (&mut self.input).take(LINE_BYTES_MAX as u64 + 1).read_until(b'\n', &mut self.buf);
            match read {
                Ok(0) => return None,
                Ok(_) if self.buf.len() > LINE_BYTES_MAX => {
                    // The rest of the line is unread: the stream ends here.
                    self.ended = true;
                    let reason = format!("longer than {LINE_BYTES_MAX} bytes");
                    return Some(Err(TraceError::Line { line, reason }));
                }
                Ok(_) if self.buf.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(_) => return Some(self.parse()),
                Err(source) => {
                    return Some(Err(TraceError::Io { what: format!("trace line {line}"), source }))
                }
            }
        }
    }
}

/// Expands a trace request into token ids, deterministically.
#[derive(Debug, Clone, Copy)]
pub struct Expander {
    /// Same seed, same tokens for every id.
    pub seed: u64,
    /// Tokens per id (the trace's block size).
    pub block_tokens: u32,
    /// Token ids are drawn below this.
    pub vocab: u32,
}

impl Expander {
    /// The expander of a Mooncake trace (512 tokens an id) with a Llama-sized vocabulary.
    pub fn new(seed: u64) -> Self {
        Expander { seed, block_tokens: TRACE_BLOCK_TOKENS, vocab: 32_000 }
    }

    /// The prompt of `r`: each id's tokens in order, the last block cut at `input_length`.
    pub fn tokens(&self, r: &TraceRequest) -> Vec<u32> {
        let bt = self.block_tokens as usize;
        let n = r.input_length as usize;
        let mut out = Vec::with_capacity(n);
        for &id in &r.hash_ids {
            let take = bt.min(n - out.len());
            self.block(id, take, &mut out);
            if out.len() == n {
                break;
            }
        }
        out
    }

    /// Appends the first `take` tokens of id `id`'s block.
    pub fn block(&self, id: u64, take: usize, out: &mut Vec<u32>) {
        let mut rng = SplitMix64(self.seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let vocab = u64::from(self.vocab.max(1));
        out.extend((0..take).map(|_| (rng.next_u64() % vocab) as u32));
    }
}

/// What an infinite cache would reuse of a trace: every block whose id came before.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Limit {
    /// Requests counted.
    pub requests: u64,
    /// Prompt blocks (ids).
    pub blocks: u64,
    /// Blocks whose id appeared earlier in the trace.
    pub reused_blocks: u64,
    /// Prompt tokens.
    pub tokens: u64,
    /// Tokens of those blocks (a partial last block counts what it holds).
    pub reused_tokens: u64,
}

impl Limit {
    /// Reused blocks over blocks: the figure the trace's publishers quote.
    pub fn block_ratio(&self) -> f64 {
        self.reused_blocks as f64 / self.blocks.max(1) as f64
    }

    /// Reused tokens over prompt tokens.
    pub fn token_ratio(&self) -> f64 {
        self.reused_tokens as f64 / self.tokens.max(1) as f64
    }
}

/// Counts a trace's [`Limit`] alone: the ids seen (8 bytes each and the set's overhead), where
/// a [`ReuseCurve`] also keeps each id's last touch and a tree over them, for the curve.
#[derive(Debug, Default)]
pub struct LimitCounter {
    limit: Limit,
    block_tokens: u64,
    seen: std::collections::HashSet<u64>,
}

impl LimitCounter {
    /// A counter for a trace whose ids cover `block_tokens` tokens each.
    pub fn new(block_tokens: u32) -> Self {
        LimitCounter { block_tokens: u64::from(block_tokens.max(1)), ..Default::default() }
    }

    /// Counts one request: its blocks whose id came before are reused.
    pub fn push(&mut self, r: &TraceRequest) {
        self.limit.requests += 1;
        self.limit.tokens += r.input_length;
        // Looked up before any is counted as seen, as [`ReuseCurve::push`] does.
        for (k, id) in r.hash_ids.iter().enumerate() {
            self.limit.blocks += 1;
            if self.seen.contains(id) {
                let tokens = self.block_tokens.min(r.input_length - k as u64 * self.block_tokens);
                self.limit.reused_blocks += 1;
                self.limit.reused_tokens += tokens;
            }
        }
        self.seen.extend(r.hash_ids.iter().copied());
    }

    /// What an infinite cache reuses.
    pub fn limit(&self) -> Limit {
        self.limit
    }
}

/// Counts a trace's [`Limit`] and, in the same pass, the LRU stack distance of every block
/// (Mattson's algorithm over a Fenwick tree): one pass gives the reuse of an LRU cache of any
/// capacity. A request's blocks are looked up before any of them is touched, a block counts
/// only within the request's leading run of hits (prefix caching), and a request's blocks are
/// touched last-first so that a prefix is always more recent than what extends it.
#[derive(Debug, Default)]
pub struct ReuseCurve {
    limit: Limit,
    block_tokens: u64,
    /// id -> time of its last touch.
    last: HashMap<u64, u64>,
    /// 1 at the time of each id's last touch.
    fenwick: Vec<u32>,
    now: u64,
    /// Tokens reused per stack distance (in blocks), for blocks that were reused at some
    /// capacity: `hits[d]` tokens need a cache of more than `d` blocks.
    hits: Vec<u64>,
}

impl ReuseCurve {
    /// A curve for a trace whose ids cover `block_tokens` tokens each.
    pub fn new(block_tokens: u32) -> Self {
        ReuseCurve { block_tokens: u64::from(block_tokens.max(1)), ..Default::default() }
    }

    fn add(&mut self, mut i: usize, v: i32) {
        i += 1;
        while i <= self.fenwick.len() {
            self.fenwick[i - 1] = (self.fenwick[i - 1] as i64 + v as i64) as u32;
            i += i & i.wrapping_neg();
        }
    }

    fn prefix(&self, mut i: usize) -> u64 {
        // Sum of positions 0..i.
        let mut s = 0u64;
        while i > 0 {
            s += u64::from(self.fenwick[i - 1]);
            i -= i & i.wrapping_neg();
        }
        s
    }

    /// Counts one request.
    pub fn push(&mut self, r: &TraceRequest) {
        let n = r.hash_ids.len();
        let needed = (self.now as usize) + n + 1;
        if needed > self.fenwick.len() {
            // Renumber the live touches 0.. in their order (only their order counts), so that
            // the tree is as long as the distinct ids, not as the touches of the whole trace;
            // at least half of it free after (amortised constant time a touch).
            let mut live: Vec<(u64, u64)> = self.last.iter().map(|(&id, &t)| (t, id)).collect();
            live.sort_unstable();
            for (t, &(_, id)) in live.iter().enumerate() {
                self.last.insert(id, t as u64);
            }
            self.now = live.len() as u64;
            let cap = (2 * (live.len() + n + 1)).next_power_of_two();
            self.fenwick = Vec::new();
            self.fenwick.resize(cap, 0);
            for t in 0..live.len() {
                self.add(t, 1);
            }
        }
        self.limit.requests += 1;
        self.limit.tokens += r.input_length;
        let live = self.last.len() as u64;
        let mut run_distance = 0u64;
        let mut in_run = true;
        for (k, id) in r.hash_ids.iter().enumerate() {
            let tokens = self.block_tokens.min(r.input_length - k as u64 * self.block_tokens);
            self.limit.blocks += 1;
            let Some(&t) = self.last.get(id) else {
                in_run = false;
                continue;
            };
            self.limit.reused_blocks += 1;
            self.limit.reused_tokens += tokens;
            if !in_run {
                continue;
            }
            // Distinct ids touched since its last touch.
            let d = live - self.prefix(t as usize + 1);
            run_distance = run_distance.max(d);
            let d = run_distance as usize;
            if self.hits.len() <= d {
                self.hits.resize(d + 1, 0);
            }
            self.hits[d] += tokens;
        }
        for id in r.hash_ids.iter().rev() {
            if let Some(t) = self.last.insert(*id, self.now) {
                self.add(t as usize, -1);
            }
            self.add(self.now as usize, 1);
            self.now += 1;
        }
    }

    /// What an infinite cache reuses.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// Tokens reused by one LRU cache of `capacity_blocks` blocks.
    pub fn reused_tokens(&self, capacity_blocks: u64) -> u64 {
        let c = (capacity_blocks as usize).min(self.hits.len());
        self.hits[..c].iter().sum()
    }

    /// The share of prompt tokens reused at each capacity (blocks), in order.
    pub fn at(&self, capacities_blocks: &[u64]) -> Vec<f64> {
        let tokens = self.limit.tokens.max(1) as f64;
        capacities_blocks.iter().map(|&c| self.reused_tokens(c) as f64 / tokens).collect()
    }

    /// The smallest capacity (blocks) that reuses at least `share` of the limit's tokens, if
    /// any does.
    pub fn capacity_for(&self, share: f64) -> Option<u64> {
        let goal = (share * self.limit.reused_tokens as f64).ceil() as u64;
        let mut sum = 0u64;
        for (d, &t) in self.hits.iter().enumerate() {
            sum += t;
            if sum >= goal {
                return Some(d as u64 + 1);
            }
        }
        (goal == 0).then_some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The curve's tree is as long as the distinct ids (renumbered as it fills), not as the
    /// touches of the whole trace: ten thousand requests over the same four ids keep it short,
    /// and every request after the first reuses its whole prompt at a capacity of 4 blocks,
    /// its first three at 3.
    #[test]
    fn the_reuse_curve_holds_the_distinct_ids_not_the_trace() {
        let mut c = ReuseCurve::new(512);
        let r = TraceRequest {
            timestamp: 0,
            input_length: 2048,
            output_length: 1,
            hash_ids: vec![1, 2, 3, 4],
        };
        for _ in 0..10_000 {
            c.push(&r);
        }
        assert!(c.fenwick.len() <= 32, "{}", c.fenwick.len());
        assert_eq!(c.limit().reused_tokens, 9_999 * 2048);
        assert_eq!(c.reused_tokens(4), 9_999 * 2048);
        assert_eq!(c.reused_tokens(3), 9_999 * 1536, "3 blocks hold the first three");
    }

    /// The limit alone counts what the curve's limit counts, a request's repeated id within
    /// itself included (looked up before any of its ids is seen).
    #[test]
    fn the_limit_counter_agrees_with_the_curve() {
        let (mut c, mut l) = (ReuseCurve::new(512), LimitCounter::new(512));
        let reqs = [(1000, vec![1, 2]), (1500, vec![1, 2, 3]), (700, vec![3, 3]), (1, vec![9])];
        for (input, ids) in reqs {
            let r =
                TraceRequest { timestamp: 0, input_length: input, output_length: 1, hash_ids: ids };
            c.push(&r);
            l.push(&r);
        }
        assert_eq!(c.limit(), l.limit());
        assert!(l.limit().reused_blocks == 4 && l.limit().reused_tokens == 512 * 3 + 188);
    }
}
