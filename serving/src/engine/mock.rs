//! The mock engine: a timing model with synthetic but verifiable KV, for tests and for
//! routing and serving experiments at a scale the real model cannot reach.
//!
//! Time: a step sleeps `prefill_us_per_token` per prompt token computed plus, when it
//! decodes, `decode_step_us` and `decode_us_per_kv_token` per token of KV the decoding
//! sequences hold. Tokens: one per byte ([`TextCodec::bytes`]); the next token is a
//! function of every token before it, so a sequence whose KV was imported generates exactly
//! what it would have generated computing its prompt. KV: each block's bytes start with its
//! tokens and continue with a pseudo-random fill seeded by a hash chained over the blocks
//! before it; an imported block is checked against the chain, so bytes that the store
//! corrupted or mixed up are refused.

use std::collections::HashMap;
use std::time::Duration;

use kvfabric::layout::BlockLayout;

use super::sampling::SplitMix64;
use super::{Engine, EngineError, ModelInfo, StepInput, TextCodec};

/// Mock timing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MockConfig {
    /// Prefill cost per uncached prompt token, microseconds.
    pub prefill_us_per_token: f64,
    /// Fixed cost of a step that decodes, microseconds.
    pub decode_step_us: f64,
    /// Decode cost per token of KV held by the decoding sequences, microseconds.
    pub decode_us_per_kv_token: f64,
    /// Context length.
    pub context_len: usize,
    /// Fault injection: the engine panics in this step (counted from 1), as a real engine may
    /// on a driver or kernel fault; tests of supervision use it. None: never.
    pub panic_at_step: Option<u64>,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            prefill_us_per_token: 40.0,
            decode_step_us: 8_000.0,
            decode_us_per_kv_token: 0.2,
            context_len: 8192,
            panic_at_step: None,
        }
    }
}

impl MockConfig {
    /// No simulated time at all (to measure the serving stack's own overhead).
    pub fn zero_delay() -> Self {
        MockConfig {
            prefill_us_per_token: 0.0,
            decode_step_us: 0.0,
            decode_us_per_kv_token: 0.0,
            ..Self::default()
        }
    }
}

/// The mock engine.
#[derive(Debug)]
pub struct MockEngine {
    info: ModelInfo,
    codec: TextCodec,
    cfg: MockConfig,
    seqs: HashMap<u64, MockSeq>,
    steps: u64,
}

#[derive(Debug, Default)]
struct MockSeq {
    tokens: Vec<u32>,
    /// Chain seed after each full block.
    chain: Vec<u64>,
    /// Running hash of every token (drives the next token).
    state: u64,
}

/// Characters the mock writes.
const ALPHABET: &[u8] = b"etaoin shrdlu cmfwyp vbgkqjxz ";

impl MockEngine {
    /// A mock model with KV blocks of `layout` (which must hold a block's tokens).
    pub fn new(name: &str, layout: BlockLayout, cfg: MockConfig) -> Result<Self, EngineError> {
        if layout.bytes_per_block() < u64::from(layout.block_tokens) * 4 + 8 {
            return Err(EngineError::model("mock blocks are too small for their tokens"));
        }
        Ok(MockEngine {
            info: ModelInfo { id: name.to_string(), context_len: cfg.context_len, layout },
            codec: TextCodec::bytes(),
            cfg,
            seqs: HashMap::new(),
            steps: 0,
        })
    }

    fn block_tokens(&self) -> usize {
        self.info.layout.block_tokens as usize
    }

    /// The bytes of a block: its tokens (u32 LE), then the fill of `seed`.
    fn fill(out: &mut [u8], tokens: &[u32], seed: u64) {
        let (head, rest) = out.split_at_mut(tokens.len() * 4);
        for (c, t) in head.chunks_exact_mut(4).zip(tokens) {
            c.copy_from_slice(&t.to_le_bytes());
        }
        let mut rng = SplitMix64(seed);
        let mut chunks = rest.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        let last = rng.next_u64().to_le_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }

    /// Whether `bytes` is what `fill` writes for these tokens and seed (compared as it is
    /// generated: no second buffer).
    fn matches(bytes: &[u8], tokens: &[u32], seed: u64) -> bool {
        if bytes.len() < tokens.len() * 4 {
            return false;
        }
        let (head, rest) = bytes.split_at(tokens.len() * 4);
        if !head.chunks_exact(4).zip(tokens).all(|(c, t)| c == t.to_le_bytes()) {
            return false;
        }
        let mut rng = SplitMix64(seed);
        let mut chunks = rest.chunks_exact(8);
        if !chunks.all(|c| c == rng.next_u64().to_le_bytes()) {
            return false;
        }
        let tail = chunks.remainder();
        tail == &rng.next_u64().to_le_bytes()[..tail.len()]
    }

    fn chain(prev: u64, tokens: &[u32]) -> u64 {
        let mut h = prev ^ 0x6b76_6661_6272_6963;
        for &t in tokens {
            h = SplitMix64(h ^ u64::from(t)).next_u64();
        }
        h
    }

    fn push_token(seq: &mut MockSeq, t: u32, bt: usize) {
        seq.tokens.push(t);
        seq.state = SplitMix64(seq.state ^ u64::from(t).wrapping_mul(0x100_0000_01b3)).next_u64();
        if seq.tokens.len() % bt == 0 {
            let prev = seq.chain.last().copied().unwrap_or(0);
            let n = seq.tokens.len();
            seq.chain.push(Self::chain(prev, &seq.tokens[n - bt..]));
        }
    }
}

impl Engine for MockEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn codec(&self) -> &TextCodec {
        &self.codec
    }

    fn add_sequence(&mut self, seq: u64) {
        self.seqs.insert(seq, MockSeq::default());
    }

    fn remove_sequence(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }

    fn import_block(&mut self, seq: u64, block: usize, bytes: &[u8]) -> Result<(), EngineError> {
        let bt = self.block_tokens();
        let s = self.seqs.get_mut(&seq).ok_or(EngineError::invalid("unknown sequence"))?;
        if s.tokens.len() != block * bt || bytes.len() as u64 != self.info.layout.bytes_per_block()
        {
            return Err(EngineError::invalid("block imported out of order or of a wrong size"));
        }
        let tokens: Vec<u32> = bytes[..bt * 4]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let prev = s.chain.last().copied().unwrap_or(0);
        if !Self::matches(bytes, &tokens, Self::chain(prev, &tokens)) {
            return Err(EngineError::model(format!(
                "imported block {block} does not match its chain"
            )));
        }
        for t in tokens {
            Self::push_token(s, t, bt);
        }
        Ok(())
    }

    fn export_block(&self, seq: u64, block: usize, out: &mut [u8]) -> Result<(), EngineError> {
        let bt = self.block_tokens();
        let s = self.seqs.get(&seq).ok_or(EngineError::invalid("unknown sequence"))?;
        if s.chain.len() <= block || out.len() as u64 != self.info.layout.bytes_per_block() {
            return Err(EngineError::invalid(format!("block {block} is not computed")));
        }
        Self::fill(out, &s.tokens[block * bt..(block + 1) * bt], s.chain[block]);
        Ok(())
    }

    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.steps += 1;
        if self.cfg.panic_at_step == Some(self.steps) {
            panic!("mock engine: injected fault at step {}", self.steps);
        }
        let bt = self.block_tokens();
        let vocab = self.codec.vocab_size();
        let (mut prefill, mut decode_kv, mut decodes) = (0usize, 0usize, 0usize);
        let mut out = Vec::new();
        for input in batch {
            let s =
                self.seqs.get_mut(&input.seq).ok_or(EngineError::invalid("unknown sequence"))?;
            if s.tokens.len() != input.start {
                return Err(EngineError::invalid(format!(
                    "step at position {} of a sequence holding {} tokens",
                    input.start,
                    s.tokens.len()
                )));
            }
            if input.tokens.len() == 1 && input.start > 0 && input.logits {
                decodes += 1;
                decode_kv += input.start + 1;
            } else {
                prefill += input.tokens.len();
            }
            for &t in input.tokens {
                Self::push_token(s, t, bt);
            }
            if input.logits {
                let mut logits = vec![0f32; vocab];
                let next = ALPHABET[(s.state % ALPHABET.len() as u64) as usize];
                logits[usize::from(next)] = 10.0;
                out.push(logits);
            }
        }
        let mut us = prefill as f64 * self.cfg.prefill_us_per_token;
        if decodes > 0 {
            us += self.cfg.decode_step_us + decode_kv as f64 * self.cfg.decode_us_per_kv_token;
        }
        if us > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(us / 1e6));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfabric::layout::ModelSpec;

    fn engine() -> MockEngine {
        let layout = ModelSpec::preset("smollm2-135m").unwrap().block_layout(4).unwrap();
        MockEngine::new("mock", layout, MockConfig::zero_delay()).unwrap()
    }

    fn run(e: &mut MockEngine, seq: u64, start: usize, tokens: &[u32]) -> u32 {
        let l = e.step(&[StepInput { seq, start, tokens, logits: true }]).unwrap();
        super::super::sampling::argmax(&l[0])
    }

    #[test]
    fn imported_blocks_continue_exactly_like_computed_ones_and_bad_bytes_are_refused() {
        let mut e = engine();
        let prompt: Vec<u32> = (0..10).map(|i| 97 + i).collect();
        e.add_sequence(1);
        let cold = run(&mut e, 1, 0, &prompt);
        let bytes = e.info.layout.bytes_per_block() as usize;
        let mut b0 = vec![0u8; bytes];
        let mut b1 = vec![0u8; bytes];
        e.export_block(1, 0, &mut b0).unwrap();
        e.export_block(1, 1, &mut b1).unwrap();
        assert!(e.export_block(1, 2, &mut b1.clone()).is_err(), "block 2 is partial");

        e.add_sequence(2);
        e.import_block(2, 0, &b0).unwrap();
        e.import_block(2, 1, &b1).unwrap();
        assert_eq!(run(&mut e, 2, 8, &prompt[8..]), cold);

        e.add_sequence(3);
        assert!(e.import_block(3, 0, &b1).is_err(), "block 1's bytes are not block 0");
        let mut bad = b0.clone();
        bad[bytes / 2] ^= 1;
        assert!(e.import_block(3, 0, &bad).is_err(), "a flipped bit passed");
        assert!(e.step(&[StepInput { seq: 3, start: 4, tokens: &[1], logits: true }]).is_err());
    }
}
