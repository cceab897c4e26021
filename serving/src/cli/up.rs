//! `kvfabric up`: everything in one process. The OpenAI-compatible frontend, one engine
//! (the real model by default, or the mock), its tiered block store (host memory over a disk
//! tier under the data directory), and the embedded control plane (discovery and the event
//! bus, where the worker registers and publishes its KV events).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus, Instance};
use kvfabric::events::ChannelSink;
use kvfabric::layout::KvDtype;
use kvfabric_serving::backend::LocalBackend;
use kvfabric_serving::engine::llama::{LlamaEngine, LlamaOptions, Weights};
use kvfabric_serving::engine::mock::{MockConfig, MockEngine};
use kvfabric_serving::engine::{Scheduler, SchedulerConfig};
use kvfabric_serving::http::{self, ServerConfig};
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::{StoreConfig, TieredStore};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// A llama-architecture GGUF model on CPU (candle).
    Llama,
    /// A timing model with synthetic KV (no model file).
    Mock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WeightsArg {
    /// Dequantize to f32 at load (exact, reproducible greedy output).
    F32,
    /// Keep the GGUF's quantized weights (faster, approximate).
    Quantized,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// The engine.
    #[arg(long, env = "KVFABRIC_ENGINE", value_enum, default_value = "llama")]
    engine: EngineKind,
    /// A GGUF model file (default: the model scripts/fetch-model.sh caches).
    #[arg(long, env = "KVFABRIC_MODEL")]
    model: Option<PathBuf>,
    /// A tokenizer.json to use instead of the GGUF's vocabulary.
    #[arg(long, env = "KVFABRIC_TOKENIZER")]
    tokenizer: Option<PathBuf>,
    /// The id the model is served under (default: the file name; `mock` for the mock).
    #[arg(long, env = "KVFABRIC_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Weights of the llama engine.
    #[arg(long, env = "KVFABRIC_WEIGHTS", value_enum, default_value = "f32")]
    weights: WeightsArg,
    /// Address to listen on.
    #[arg(long, env = "KVFABRIC_HOST", default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, env = "KVFABRIC_PORT", default_value_t = 8000)]
    port: u16,
    /// Directory of the disk tier.
    #[arg(long, env = "KVFABRIC_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Host tier capacity, blocks.
    #[arg(long, env = "KVFABRIC_HOST_BLOCKS", default_value_t = 512)]
    host_blocks: u32,
    /// Disk tier capacity, blocks (0: no disk tier). The file grows as blocks arrive.
    #[arg(long, env = "KVFABRIC_DISK_BLOCKS", default_value_t = 4096)]
    disk_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value_t = 16)]
    block_tokens: u32,
    /// Context length cap, tokens.
    #[arg(long, env = "KVFABRIC_CONTEXT", default_value_t = 8192)]
    context: usize,
    /// Sequences batched together at most.
    #[arg(long, env = "KVFABRIC_MAX_BATCH", default_value_t = 8)]
    max_batch: usize,
    /// Requests waiting at most; more get 429.
    #[arg(long, env = "KVFABRIC_MAX_WAITING", default_value_t = 128)]
    max_waiting: usize,
    /// Prompt tokens computed per step at most.
    #[arg(long, env = "KVFABRIC_STEP_TOKENS", default_value_t = 256)]
    step_tokens: usize,
    /// Request deadline, seconds.
    #[arg(long, env = "KVFABRIC_REQUEST_TIMEOUT_S", default_value_t = 300)]
    request_timeout_s: u64,
    /// Mock: prefill cost per uncached prompt token, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_PREFILL_US", default_value_t = 40.0)]
    mock_prefill_us: f64,
    /// Mock: fixed cost of a decode step, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_DECODE_US", default_value_t = 8000.0)]
    mock_decode_us: f64,
    /// Mock: decode cost per token of active KV, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_DECODE_KV_US", default_value_t = 0.2)]
    mock_decode_kv_us: f64,
    /// Worker name in discovery.
    #[arg(long, env = "KVFABRIC_NAME", default_value = "worker-0")]
    name: String,
}

/// Where scripts/fetch-model.sh caches the default model.
pub fn default_model_path() -> PathBuf {
    let dir = std::env::var_os("KVFABRIC_MODEL_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| ".".into());
        home.join(".cache/kvfabric/models")
    });
    dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let (engine, describe): (
        Box<dyn FnOnce(TieredStore) -> anyhow::Result<Scheduler> + Send>,
        String,
    );
    let sched_cfg = SchedulerConfig {
        max_batch: args.max_batch.max(1),
        max_waiting: args.max_waiting,
        step_tokens: args.step_tokens.max(1),
        ..SchedulerConfig::default()
    };
    let rt = tokio::runtime::Handle::current();
    let block_bytes;
    match args.engine {
        EngineKind::Llama => {
            let path = args.model.clone().unwrap_or_else(default_model_path);
            anyhow::ensure!(
                path.is_file(),
                "model file {} not found (scripts/fetch-model.sh fetches the default model; --model takes any llama GGUF)",
                path.display()
            );
            let opts = LlamaOptions {
                weights: match args.weights {
                    WeightsArg::F32 => Weights::F32,
                    WeightsArg::Quantized => Weights::Quantized,
                },
                block_tokens: args.block_tokens,
                max_context: args.context,
                tokenizer_json: args.tokenizer.clone(),
                name: args.served_model_name.clone(),
            };
            let bar = indicatif::ProgressBar::new(1);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "loading {msg} [{bar:40}] {pos}/{len} tensors {elapsed}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_message(
                path.file_name().and_then(|s| s.to_str()).unwrap_or("model").to_string(),
            );
            let b = bar.clone();
            let p = path.clone();
            let llama = tokio::task::spawn_blocking(move || {
                LlamaEngine::load(&p, &opts, |done, total| {
                    b.set_length(total as u64);
                    b.set_position(done as u64);
                })
            })
            .await??;
            bar.finish_and_clear();
            block_bytes = kvfabric_serving::engine::Engine::info(&llama).layout.bytes_per_block();
            describe = format!(
                "{} (llama, {} weights, {} layers of KV in {} B blocks)",
                kvfabric_serving::engine::Engine::info(&llama).id,
                if args.weights == WeightsArg::F32 { "f32" } else { "quantized" },
                kvfabric_serving::engine::Engine::info(&llama).layout.kv.num_layers,
                block_bytes,
            );
            let cfg = sched_cfg.clone();
            engine = Box::new(move |store| Ok(Scheduler::start(llama, store, cfg, rt)?));
        }
        EngineKind::Mock => {
            let spec =
                kvfabric_serving::plan::resolve_model("smollm2-135m")?.with_dtype(KvDtype::F32);
            let layout = spec.block_layout(args.block_tokens)?;
            block_bytes = layout.bytes_per_block();
            let mock_cfg = MockConfig {
                prefill_us_per_token: args.mock_prefill_us,
                decode_step_us: args.mock_decode_us,
                decode_us_per_kv_token: args.mock_decode_kv_us,
                context_len: args.context,
            };
            let name = args.served_model_name.clone().unwrap_or_else(|| "mock".into());
            let mock = MockEngine::new(&name, layout, mock_cfg)?;
            describe = format!("{name} (mock engine, {block_bytes} B blocks)");
            let cfg = sched_cfg.clone();
            engine = Box::new(move |store| Ok(Scheduler::start(mock, store, cfg, rt)?));
        }
    }

    // The data plane: an agent owning the store's host region.
    let secret: Vec<u8> = {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("random secret: {e}"))?;
        b.to_vec()
    };
    let agent = Agent::start(AgentConfig::new(args.name.clone(), secret)).await?;
    let discovery = Arc::new(MemoryDiscovery::new());
    let bus = Arc::new(MemoryBus::new());
    let (sink, mut events) = ChannelSink::new(65_536);
    let publisher = {
        let (bus, name) = (bus.clone(), args.name.clone());
        tokio::spawn(async move {
            while let Some(e) = events.recv().await {
                let msg = serde_json::json!({ "source": name, "event": e });
                let _ = bus.publish("kv-events", msg.to_string().into_bytes()).await;
            }
        })
    };
    let mut store_cfg = StoreConfig::new(block_bytes, args.host_blocks.max(1));
    store_cfg.disk_admit_min_hits = 0;
    if args.disk_blocks > 0 {
        let dir = args.data_dir.clone().unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| ".".into());
            home.join(".cache/kvfabric/data")
        });
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // One file per block size: a restart with another model does not read foreign blocks.
        store_cfg.disk = Some(DiskConfig::new(
            dir.join(format!("{}-{block_bytes}.slots", args.name)),
            args.disk_blocks,
        ));
    }
    let store =
        TieredStore::open(store_cfg, &agent, sink).await.context("opening the block store")?;
    let sched = engine(store.clone())?;

    let server_cfg = ServerConfig {
        request_timeout: Duration::from_secs(args.request_timeout_s.max(1)),
        ..ServerConfig::default()
    };
    let app = http::router(Arc::new(LocalBackend::new(sched.clone(), store.clone())), server_cfg);
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let registration = discovery
        .register(
            Instance {
                kind: "worker".into(),
                id: args.name.clone(),
                metadata: serde_json::json!({
                    "model": sched.info().id, "url": format!("http://{addr}"),
                    "agent": agent.name(), "block_tokens": args.block_tokens,
                }),
            },
            Duration::from_secs(10),
        )
        .await?;
    let id = sched.info().id.clone();
    println!("kvfabric is serving {describe} at http://{addr}/v1");
    println!(
        "try:\n  curl http://{addr}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 64}}'"
    );
    let shutdown = async {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    // Keep the cache across restarts: write host blocks to disk (bounded in time).
    if store.disk().is_some() {
        let hosted: Vec<_> = store
            .snapshot()
            .into_iter()
            .filter(|(t, _, _)| *t == kvfabric::events::TierKind::Host)
            .map(|(_, h, _)| h)
            .collect();
        let _ = tokio::time::timeout(Duration::from_secs(10), store.offload(&hosted)).await;
    }
    registration.revoke().await;
    publisher.abort();
    agent.shutdown();
    eprintln!("kvfabric stopped");
    Ok(())
}
