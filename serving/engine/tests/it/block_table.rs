//! The store is the engine's KV memory: a cache hit hands the engine pinned store slots that
//! it reads in place (no copy: the engine sees the store's own memory), computed blocks are
//! written into store slots that become the stored blocks, and what a sequence computed and
//! what a later sequence reads are the same bytes. Over a real store and the mock engine,
//! through a recording wrapper that sees every block the scheduler gives the engine.

use crate::common;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric_engine::mock::{MockConfig, MockEngine};
use kvfabric_engine::{
    Engine, EngineError, GenEvent, GenerateRequest, KvBlock, KvTable, ModelInfo, Next, Scheduler,
    SchedulerConfig, StepInput, TextCodec,
};
use kvfabric_tiers::{StoreConfig, TieredStore};
use parking_lot::Mutex;

#[derive(Debug, Default)]
struct Seen {
    /// Per cached block handed over: (a stored block?, its bytes lie in the host region?).
    cached: Vec<(bool, bool)>,
    /// Kinds of the blocks each step wrote into ("writing", "scratch", "owned").
    written: Vec<&'static str>,
}

struct Recording {
    inner: MockEngine,
    seen: Arc<Mutex<Seen>>,
    /// The host region's address range.
    host: std::ops::Range<usize>,
}

impl Recording {
    fn in_host(&self, b: &KvBlock) -> bool {
        let p = b.bytes().as_ptr() as usize;
        self.host.contains(&p) && self.host.contains(&(p + b.bytes().len() - 1))
    }
}

impl Engine for Recording {
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
        let entry = (block.is_cached(), self.in_host(&block));
        self.seen.lock().cached.push(entry);
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
        let bt = self.info().layout.block_tokens.as_usize();
        for input in batch {
            let t = self.inner.table(input.seq).expect("a known sequence");
            let first = input.start / bt;
            let last = (input.start + input.tokens.len()).div_ceil(bt);
            let mut seen = self.seen.lock();
            for b in t.blocks.get(first..last).unwrap_or(&[]) {
                seen.written.push(match b {
                    KvBlock::Writing(_) => "writing",
                    KvBlock::Scratch(_) => "scratch",
                    KvBlock::Owned { .. } => "owned",
                    KvBlock::Cached(_) => "cached",
                });
            }
        }
        self.inner.step_next(batch)
    }
}

async fn generate(sched: &Scheduler, prompt: &[u32], n: usize) -> (Vec<u32>, usize) {
    let mut rx = sched
        .submit(GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::new(prompt.to_vec(), n, Duration::from_secs(30))
        })
        .unwrap();
    let (mut tokens, mut cached) = (Vec::new(), 0);
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Started { cached: c, .. } => cached = c.total(),
            GenEvent::Token { id, .. } => tokens.push(id),
            GenEvent::Done { .. } => break,
            GenEvent::Error(e) => panic!("{e}"),
            GenEvent::Accepted { .. } => panic!("the scheduler numbers requests on the side"),
            GenEvent::Cached(c) => cached = c.total(),
        }
    }
    (tokens, cached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_hits_read_store_slots_in_place_and_computed_blocks_become_stored_blocks() {
    let layout = common::f32_layout();
    let agent = Agent::start(AgentConfig::new("table", b"s".to_vec())).await.unwrap();
    let store = TieredStore::open(
        StoreConfig::new(layout.bytes_per_block(), 64),
        &agent,
        Arc::new(NullSink),
    )
    .await
    .unwrap();
    let region = store.host_region().clone();
    let base = region.ptr_at(0, region.len() as u64).unwrap() as usize;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let engine = Recording {
        inner: MockEngine::new("mock", layout, MockConfig::zero_delay()).unwrap(),
        seen: seen.clone(),
        host: base..base + region.len(),
    };
    let sched = Scheduler::start(
        engine,
        store.clone(),
        SchedulerConfig { step_tokens: 64, ..SchedulerConfig::default() },
        tokio::runtime::Handle::current(),
    )
    .unwrap();

    // 100 prompt tokens: 6 full blocks (the 7th is partial), computed in chunks of 64.
    let prompt: Vec<u32> = (0..100).map(|i| 97 + (i * 7) % 26).collect();
    let (cold, cached) = generate(&sched, &prompt, 40).await;
    assert_eq!(cached, 0);
    {
        let s = seen.lock();
        assert!(s.cached.is_empty());
        // Every block the steps wrote was a store slot: prompt blocks reserved for their
        // hashes, the partial and generated ones scratch slots named when full.
        assert!(s.written.contains(&"writing") && s.written.contains(&"scratch"), "{s:?}");
        assert!(!s.written.contains(&"owned"), "engine memory with room in the store: {s:?}");
        assert!(!s.written.contains(&"cached"), "a step wrote into a stored block: {s:?}");
    }
    // 140 tokens of KV: 8 full blocks stored, each committed in place.
    assert_eq!(sched.stats().stored_blocks.load(std::sync::atomic::Ordering::Relaxed), 8);
    assert_eq!(sched.stats().engine_memory_blocks.load(std::sync::atomic::Ordering::Relaxed), 0);
    let visible = store.snapshot();
    assert_eq!(visible.len(), 8, "{visible:?}");

    seen.lock().written.clear();
    let (warm, cached) = generate(&sched, &prompt, 40).await;
    assert_eq!(warm, cold, "the warm run generates what the cold one did");
    assert_eq!(cached, 96, "every full prompt block but the last token's");
    let s = seen.lock();
    assert_eq!(s.cached.len(), 6);
    for (i, &(stored, in_host)) in s.cached.iter().enumerate() {
        assert!(stored, "cached block {i} was handed over as a copy");
        assert!(in_host, "cached block {i} is not the store's own memory");
    }
    // The mock checked each block's header against its chain: the bytes the first sequence
    // wrote in place are the bytes the second read in place.
    assert!(!s.written.contains(&"cached"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_longer_than_the_host_tier_spills_to_engine_memory_and_stores_everything() {
    let layout = common::f32_layout();
    let agent = Agent::start(AgentConfig::new("spill", b"s".to_vec())).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(layout.bytes_per_block(), 3);
    cfg.disk_admit_min_hits = 0;
    cfg.disk = Some(kvfabric_tiers::disk::DiskConfig::new(dir.path().join("kv.slots"), 64));
    let store = TieredStore::open(cfg, &agent, Arc::new(NullSink)).await.unwrap();
    let sched = common::mock_scheduler(layout, &store);
    // 10 full prompt blocks against 3 host slots.
    let prompt: Vec<u32> = (0..161).map(|i| 97 + (i * 5) % 26).collect();
    let (cold, _) = generate(&sched, &prompt, 8).await;
    let (warm, cached) = generate(&sched, &prompt, 8).await;
    assert_eq!(warm, cold);
    assert_eq!(cached, 160, "all 10 blocks came back, through the disk tier");
    assert!(store.metrics().disk_hits > 0);
    // Counted (and logged): the host tier is too small for the sequence.
    assert!(sched.stats().engine_memory_blocks.load(std::sync::atomic::Ordering::Relaxed) > 0);
}
