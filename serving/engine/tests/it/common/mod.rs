//! What the engine's tests share: a mock engine whose every step's inputs are recorded.

use std::sync::Arc;

use kvfabric_engine::mock::MockEngine;
use kvfabric_engine::{
    Engine, EngineError, KvBlock, KvTable, ModelInfo, Next, StepInput, TextCodec,
};
use parking_lot::Mutex;

/// A scheduler over the zero-delay mock engine of `layout` and `store`, with the default
/// settings, on the current runtime.
pub fn mock_scheduler(
    layout: kvfabric::layout::BlockLayout,
    store: &kvfabric_tiers::TieredStore,
) -> kvfabric_engine::Scheduler {
    let engine =
        MockEngine::new("mock", layout, kvfabric_engine::mock::MockConfig::zero_delay()).unwrap();
    kvfabric_engine::Scheduler::start(
        engine,
        store.clone(),
        kvfabric_engine::SchedulerConfig::default(),
        tokio::runtime::Handle::current(),
    )
    .unwrap()
}

/// SmolLM2-135M's KV shape in f32, 16 tokens per block: the mock engine's layout in these
/// tests.
pub fn f32_layout() -> kvfabric::layout::BlockLayout {
    kvfabric::layout::ModelSpec::preset("smollm2-135m")
        .unwrap()
        .with_dtype(kvfabric::layout::KvDtype::F32)
        .block_layout(16)
        .unwrap()
}

/// The mock engine `inner`, recording each step as `record` sees its inputs; its mixed steps
/// amortize when `amortize` says so (real models), else steps alternate (the mock's time
/// model).
pub struct StepLog<R> {
    pub inner: MockEngine,
    pub amortize: bool,
    pub steps: Arc<Mutex<Vec<Vec<R>>>>,
    pub record: fn(&StepInput<'_>) -> R,
}

impl<R: Send + 'static> Engine for StepLog<R> {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn codec(&self) -> &TextCodec {
        self.inner.codec()
    }
    fn add_sequence(&mut self, seq: u64) {
        self.inner.add_sequence(seq)
    }
    fn remove_sequence(&mut self, seq: u64) {
        self.inner.remove_sequence(seq)
    }
    fn push_cached(&mut self, seq: u64, block: KvBlock) -> Result<(), EngineError> {
        self.inner.push_cached(seq, block)
    }
    fn table(&self, seq: u64) -> Option<&KvTable> {
        self.inner.table(seq)
    }
    fn table_mut(&mut self, seq: u64) -> Option<&mut KvTable> {
        self.inner.table_mut(seq)
    }
    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.inner.step(batch)
    }
    fn step_next(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Next>, EngineError> {
        self.steps.lock().push(batch.iter().map(self.record).collect());
        self.inner.step_next(batch)
    }
    fn mixed_steps_amortize(&self) -> bool {
        self.amortize
    }
}
