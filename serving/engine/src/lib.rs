//! kvfabric-engine — engines and the batching loop that serves them. The one crate of
//! kvfabric with a model runtime (candle) and a tokenizer and chat templates (tokenizers,
//! minijinja): everything else builds without them.
//!
//! An [`Engine`] runs a model one step at a time over a ragged batch of sequences and keeps
//! their KV rows; [`Scheduler`] owns one engine on its own thread and does everything around
//! it: admission with prefix reuse from the tiered block store, continuous batching (decodes
//! and prefill chunks in the same step), sampling, stop conditions, detokenization, storing
//! each newly full block back into the store (which offloads and events it), cancellation
//! and deadlines. Two engines implement the trait: [`llama`] (a real model on CPU with
//! candle) and [`mock`] (a timing model with synthetic, verifiable KV).
//!
//! This module holds the engine's side of the contract (the trait, requests, events,
//! errors); [`scheduler`] the loop.

pub mod kv;
pub mod llama;
pub mod mock;
pub mod quota;
pub mod sampling;
pub mod scheduler;
pub mod stream;
pub mod text;

pub use kv::{KvBlock, KvTable};
pub use sampling::Sampler;

/// The generation's side of the contract (requests, events, errors): the same types a
/// worker's request port carries.
pub use kvfabric::contract::generate::{
    CacheHits, EngineError, FinishReason, GenEvent, GenerateRequest, RemotePrefill, SamplingParams,
    REQUEST_TIMEOUT_MAX,
};
pub use scheduler::{QueuePolicy, Scheduler, SchedulerConfig, SchedulerStats};
pub use stream::{EventRx, EventTx};
pub use text::{ChatMessage, TextCodec, TextStream};

/// What a model is, as a worker registers it (the control plane's contract).
pub use kvfabric::contract::discovery::ModelInfo;

/// One sequence's share of a step: `tokens` at positions `start..start + tokens.len()`.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// The sequence.
    pub seq: u64,
    /// Position of the first token (KV for `0..start` is present).
    pub start: usize,
    /// New tokens.
    pub tokens: &'a [u32],
    /// Return the logits of the last token.
    pub logits: bool,
}

/// What decides a sequence's next token after a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Logits over the vocabulary, to sample from.
    Logits(Vec<f32>),
    /// The token, whatever the sampling parameters (all the mass on it).
    Token(u32),
}

/// A model that runs steps over a ragged batch. Each sequence's KV is a block table
/// ([`KvTable`]) in the store's layout: cached blocks are read in place, computed KV is written
/// into the table's blocks, which the engine extends with its own memory when a step runs past
/// them. Used from one thread.
pub trait Engine: Send + 'static {
    /// The model.
    fn info(&self) -> &ModelInfo;
    /// Its tokenizer and chat template.
    fn codec(&self) -> &TextCodec;
    /// Starts a sequence with no KV.
    fn add_sequence(&mut self, seq: u64);
    /// Forgets a sequence and releases its blocks.
    fn remove_sequence(&mut self, seq: u64);
    /// Appends a cached block (KV of tokens `len..len + bt`, `len` the tokens present) to the
    /// sequence's table, to be read in place; blocks are appended in order from 0, before any
    /// step. The engine checks what it can of the block.
    fn push_cached(&mut self, seq: u64, block: KvBlock) -> Result<(), EngineError>;
    /// The sequence's table.
    fn table(&self, seq: u64) -> Option<&KvTable>;
    /// The sequence's table, to give it memory for the blocks steps compute or to seal full
    /// blocks into stored ones (their bytes unchanged).
    fn table_mut(&mut self, seq: u64) -> Option<&mut KvTable>;
    /// Runs one step; returns the logits of each input that asked for them, in order.
    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, EngineError>;

    /// Whether a step that runs decodes and prompt chunks together costs less than the two
    /// run apart (true for real models: the step reads the weights once for every token it
    /// carries). An engine whose step time is the sum of its parts says false, and the
    /// scheduler then runs waiting prompt chunks in a step of their own before the decodes:
    /// new requests get their first token a decode step sooner, and the decodes get theirs
    /// no later than in the mixed step.
    fn mixed_steps_amortize(&self) -> bool {
        true
    }

    /// Runs one step for the scheduler: what decides the next token of each input that asked
    /// for it, in order. An engine whose next token is certain (the mock) names it instead of
    /// materialising a vocabulary's worth of logits.
    fn step_next(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Next>, EngineError> {
        Ok(self.step(batch)?.into_iter().map(Next::Logits).collect())
    }

    /// Sets the KV of block `block` (tokens `block*bt..(block+1)*bt`) from a copy of `bytes`
    /// in the store's layout; blocks are imported in order from 0, before any step.
    fn import_block(&mut self, seq: u64, block: usize, bytes: &[u8]) -> Result<(), EngineError> {
        let layout = self.info().layout;
        let held = self.table(seq).ok_or(EngineError::invalid("unknown sequence"))?.len;
        if held != block * layout.block_tokens.as_usize()
            || bytes.len() as u64 != layout.bytes_per_block()
        {
            return Err(EngineError::invalid("block imported out of order or of a wrong size"));
        }
        self.push_cached(seq, KvBlock::copy_of(bytes))
    }

    /// Copies the KV of a full, computed block out in the store's layout.
    fn export_block(&self, seq: u64, block: usize, out: &mut [u8]) -> Result<(), EngineError> {
        let bt = self.info().layout.block_tokens.as_usize();
        self.table(seq).ok_or(EngineError::invalid("unknown sequence"))?.export(bt, block, out)
    }
}

/// The message a panic carried (`panic!("...")` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Whether `prompt` can be asked of the model `info` tokenized by `codec`: not empty, every
/// token in the vocabulary, shorter than the context. The engine checks it at admission;
/// the HTTP layer checks it first, so that routing endpoints refuse what the engine would.
pub fn check_prompt(
    info: &ModelInfo,
    codec: &TextCodec,
    prompt: &[u32],
) -> Result<(), EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::invalid("the prompt is empty"));
    }
    let vocab = codec.vocab_size() as u32;
    if let Some(bad) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(EngineError::invalid(format!(
            "token id {bad} is outside the vocabulary (size {vocab})"
        )));
    }
    if prompt.len() >= info.context_len {
        return Err(EngineError::ContextLength {
            limit: info.context_len,
            needed: prompt.len() + 1,
            prompt: prompt.len(),
        });
    }
    Ok(())
}
