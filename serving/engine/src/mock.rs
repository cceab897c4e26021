//! The mock engine: a timing model with synthetic but verifiable KV, for tests and for
//! routing and serving experiments at a scale the real model cannot reach.
//!
//! Time: a step sleeps `prefill_us_per_token` per prompt token computed plus, when it
//! decodes, `decode_step_us` and `decode_us_per_kv_token` per token of KV the decoding
//! sequences hold. Model: by default one token per byte ([`TextCodec::bytes`]) over
//! SmolLM2-135M's KV layout; or, as Dynamo's mocker, a model directory's tokenizer, chat
//! template and KV layout ([`MockEngine::from_model_dir`]), so that token counts and KV
//! bytes are that model's. The next token is a function of every token before it (picked
//! among a few dozen vocabulary tokens), so a sequence whose KV was imported generates exactly
//! what it would have generated computing its prompt.
//!
//! KV: each block starts with a header, its tokens (u32 LE) and a seed (u64 LE) chained over
//! the blocks before it; a cached block is checked against the chain, so bytes that the store
//! or a transfer corrupted or mixed up are refused. With [`MockKv::Full`] the rest of the
//! block is a pseudo-random fill of the seed, written and checked too (every byte
//! verifiable: the tests of the store and the transfers); with [`MockKv::Header`] only the
//! header is materialised: tiers and transfers still move every byte of the block (and check
//! them with their own checksums), but the engine spends no time filling KV nobody reads.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use kvfabric::layout::{BlockLayout, ModelSpec};

use super::sampling::SplitMix64;
use super::{Engine, EngineError, KvBlock, KvTable, ModelInfo, Next, StepInput, TextCodec};

/// How much of each KV block the mock writes and checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MockKv {
    /// Tokens and chained seed only.
    Header,
    /// Every byte: the header, then a fill of the seed.
    #[default]
    Full,
}

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
    /// How much KV is materialised.
    pub kv: MockKv,
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
            kv: MockKv::Full,
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
    /// The tokens it writes.
    alphabet: Vec<u32>,
}

#[derive(Debug, Default)]
struct MockSeq {
    tokens: Vec<u32>,
    /// Chain seed after each full block.
    chain: Vec<u64>,
    /// Running hash of every token (drives the next token).
    state: u64,
    kv: KvTable,
}

/// Characters the byte-level mock writes.
const ALPHABET: &[u8] = b"etaoin shrdlu cmfwyp vbgkqjxz ";

/// Words the mock of a real tokenizer writes (those that are one token).
const WORDS: &[&str] = &[
    " the", " of", " and", " to", " in", " is", " was", " for", " on", " with", " as", " by",
    " at", " from", " that", " this", " it", " are", " be", " or", " an", " time", " people",
    " river", " market", " city", " story", " water", " light", " road", " paper", " school", ".",
    ",",
];

impl MockEngine {
    /// A byte-level mock model with KV blocks of `layout` (which must hold a block's header).
    pub fn new(name: &str, layout: BlockLayout, cfg: MockConfig) -> Result<Self, EngineError> {
        let alphabet = ALPHABET.iter().map(|&b| u32::from(b)).collect();
        Self::with_codec(name, layout, TextCodec::bytes(), alphabet, cfg)
    }

    /// A mock of the model in `dir`, as Dynamo's mocker: its `tokenizer.json`, its chat
    /// template (`tokenizer_config.json`), and its KV layout from `config.json` (layers, KV
    /// heads, head size, dtype), in blocks of `block_tokens`.
    pub fn from_model_dir(
        name: &str,
        dir: &Path,
        block_tokens: u32,
        cfg: MockConfig,
    ) -> Result<Self, EngineError> {
        let codec = TextCodec::from_model_dir(dir)?;
        let spec = ModelSpec::from_hf_config_path(dir.join("config.json"))
            .map_err(|e| EngineError::model(format!("{}: {e}", dir.display())))?;
        let layout =
            spec.block_layout(block_tokens).map_err(|e| EngineError::model(e.to_string()))?;
        let mut alphabet = Vec::new();
        for w in WORDS {
            if let Ok(t) = codec.encode(w) {
                if let [one] = t[..] {
                    if !codec.stop_tokens().contains(&one) && !alphabet.contains(&one) {
                        alphabet.push(one);
                    }
                }
            }
        }
        if alphabet.is_empty() {
            return Err(EngineError::model("the tokenizer has no single-token English words"));
        }
        Self::with_codec(name, layout, codec, alphabet, cfg)
    }

    fn with_codec(
        name: &str,
        layout: BlockLayout,
        codec: TextCodec,
        alphabet: Vec<u32>,
        cfg: MockConfig,
    ) -> Result<Self, EngineError> {
        if layout.bytes_per_block() < Self::header_len(layout.block_tokens.as_usize()) as u64 {
            return Err(EngineError::model("mock blocks are too small for their tokens"));
        }
        Ok(MockEngine {
            info: ModelInfo { id: name.to_string(), context_len: cfg.context_len, layout },
            codec,
            cfg,
            seqs: HashMap::new(),
            steps: 0,
            alphabet,
        })
    }

    fn block_tokens(&self) -> usize {
        self.info.layout.block_tokens.as_usize()
    }

    fn header_len(bt: usize) -> usize {
        bt * 4 + 8
    }

    /// The fill after the header: a stream of `seed`.
    fn fill(out: &mut [u8], seed: u64) {
        let mut rng = SplitMix64(seed);
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        let last = rng.next_u64().to_le_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }

    /// Whether `bytes` is what `fill` writes for `seed` (compared as it is generated).
    fn matches(bytes: &[u8], seed: u64) -> bool {
        let mut rng = SplitMix64(seed);
        let mut chunks = bytes.chunks_exact(8);
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

    /// Appends a token: its KV (the header's token) goes into the sequence's block; a block
    /// that fills gets its seed (and fill).
    fn push_token(seq: &mut MockSeq, t: u32, bt: usize, kv: MockKv) -> Result<(), EngineError> {
        let p = seq.tokens.len();
        seq.tokens.push(t);
        seq.state = SplitMix64(seq.state ^ u64::from(t).wrapping_mul(0x100_0000_01b3)).next_u64();
        let bytes = seq
            .kv
            .blocks
            .get_mut(p / bt)
            .and_then(|b| b.bytes_mut())
            .ok_or(EngineError::model("a step would write a missing or cached block"))?;
        bytes[(p % bt) * 4..][..4].copy_from_slice(&t.to_le_bytes());
        if seq.tokens.len() % bt == 0 {
            let prev = seq.chain.last().copied().unwrap_or(0);
            let seed = Self::chain(prev, &seq.tokens[p + 1 - bt..]);
            seq.chain.push(seed);
            bytes[bt * 4..][..8].copy_from_slice(&seed.to_le_bytes());
            if kv == MockKv::Full {
                Self::fill(&mut bytes[Self::header_len(bt)..], seed);
            }
        }
        Ok(())
    }

    /// Runs one step; the next token of each input that asks for one.
    fn run(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<u32>, EngineError> {
        self.steps += 1;
        if self.cfg.panic_at_step == Some(self.steps) {
            panic!("mock engine: injected fault at step {}", self.steps);
        }
        let bt = self.block_tokens();
        let bytes = self.info.layout.bytes_per_block() as usize;
        let (mut prefill, mut decode_kv, mut decodes) = (0usize, 0usize, 0usize);
        let mut out = Vec::new();
        for (i, input) in batch.iter().enumerate() {
            if batch[..i].iter().any(|b| b.seq == input.seq) {
                return Err(EngineError::invalid("a sequence twice in one step"));
            }
            let s =
                self.seqs.get_mut(&input.seq).ok_or(EngineError::invalid("unknown sequence"))?;
            if s.tokens.len() != input.start
                || input.start + input.tokens.len() > self.cfg.context_len
            {
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
            s.kv.reserve_owned(bt, input.start + input.tokens.len(), bytes);
            for &t in input.tokens {
                Self::push_token(s, t, bt, self.cfg.kv)?;
            }
            s.kv.len = s.tokens.len();
            if input.logits {
                out.push(self.alphabet[(s.state % self.alphabet.len() as u64) as usize]);
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

    fn push_cached(&mut self, seq: u64, block: KvBlock) -> Result<(), EngineError> {
        let bt = self.block_tokens();
        let full = self.cfg.kv == MockKv::Full;
        let s = self.seqs.get_mut(&seq).ok_or(EngineError::invalid("unknown sequence"))?;
        let index = s.kv.blocks.len();
        let bytes = block.bytes();
        if s.tokens.len() != index * bt || bytes.len() as u64 != self.info.layout.bytes_per_block()
        {
            return Err(EngineError::invalid("block imported out of order or of a wrong size"));
        }
        let tokens: Vec<u32> = bytes[..bt * 4]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let prev = s.chain.last().copied().unwrap_or(0);
        let seed = Self::chain(prev, &tokens);
        let ok = bytes[bt * 4..][..8] == seed.to_le_bytes()
            && (!full || Self::matches(&bytes[Self::header_len(bt)..], seed));
        if !ok {
            return Err(EngineError::model(format!(
                "imported block {index} does not match its chain"
            )));
        }
        s.kv.push_cached(bt, block)?;
        for t in tokens {
            s.tokens.push(t);
            s.state = SplitMix64(s.state ^ u64::from(t).wrapping_mul(0x100_0000_01b3)).next_u64();
        }
        s.chain.push(seed);
        Ok(())
    }

    fn table(&self, seq: u64) -> Option<&KvTable> {
        self.seqs.get(&seq).map(|s| &s.kv)
    }

    fn table_mut(&mut self, seq: u64) -> Option<&mut KvTable> {
        self.seqs.get_mut(&seq).map(|s| &mut s.kv)
    }

    fn mixed_steps_amortize(&self) -> bool {
        // The time model adds a step's decode time to its prefill time: a prompt chunk that
        // rides with the decodes waits for them. Where decodes cost nothing (a zero-delay
        // mock) there is nothing to wait for, and one step is cheaper than two.
        self.cfg.decode_step_us <= 0.0 && self.cfg.decode_us_per_kv_token <= 0.0
    }

    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let vocab = self.codec.vocab_size();
        Ok(self
            .run(batch)?
            .into_iter()
            .map(|t| {
                let mut logits = vec![0f32; vocab];
                logits[t as usize] = 10.0;
                logits
            })
            .collect())
    }

    fn step_next(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Next>, EngineError> {
        Ok(self.run(batch)?.into_iter().map(Next::Token).collect())
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
