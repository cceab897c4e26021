//! `kvfabric attach`: a sidecar beside one engine instance that kvfabric did not start (vLLM,
//! SGLang). It registers the engine in discovery as a worker reached over its
//! OpenAI-compatible API, relays the engine's own KV events (ZeroMQ) onto the event bus as
//! kvfabric KV events, and reports the engine's load from its Prometheus metrics. Prints one
//! JSON line (`{"attached": NAME, "engine": ..., "events": ..., "metrics": ...}`) when it
//! runs. On
//! SIGINT/SIGTERM it withdraws the engine from discovery.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfabric::contract::discovery::{CodecSpec, ModelInfo};
use kvfabric::layout::ModelSpec;
use kvfabric_attach::engine::{EventsEndpoint, Flavor, SubscriberConfig};
use kvfabric_attach::{AttachConfig, Attachment};

use super::stack::shutdown_signal;

#[derive(Debug, Args)]
pub struct AttachArgs {
    /// The engine's name in discovery (unique in the namespace).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "engine-0")]
    name: String,
    /// The engine's OpenAI-compatible server (`http://HOST:PORT`).
    #[arg(long, env = "KVFABRIC_ENGINE_URL")]
    engine_url: String,
    /// Which engine publishes the KV events: vllm or sglang.
    #[arg(long, env = "KVFABRIC_ENGINE", default_value = "vllm")]
    engine: Flavor,
    /// The model id clients ask for (the frontend serves it under this name).
    #[arg(long, env = "KVFABRIC_MODEL")]
    model: String,
    /// The model name the engine serves (default: --model).
    #[arg(long, env = "KVFABRIC_ENGINE_MODEL")]
    engine_model: Option<String>,
    /// The engine schedules by request priority (vLLM `--scheduling-policy priority`): the
    /// frontend forwards each request's service class as its `priority` (lower first).
    #[arg(long, env = "KVFABRIC_ENGINE_PRIORITY")]
    engine_priority: bool,
    /// The model's directory (tokenizer.json, tokenizer_config.json, config.json): the
    /// frontend tokenizes with it, so it must be readable by the frontend at this path.
    #[arg(long, env = "KVFABRIC_ENGINE_MODEL_DIR")]
    model_dir: PathBuf,
    /// The engine's KV block size in tokens (vLLM `--block-size`, SGLang `--page-size`).
    #[arg(long, env = "KVFABRIC_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// The model's context length (default: from config.json, else 4096).
    #[arg(long, env = "KVFABRIC_CONTEXT_LEN")]
    context_len: Option<usize>,
    /// The engine binds its KV events socket here (vLLM: an endpoint with `*`): connect.
    #[arg(long, env = "KVFABRIC_KV_EVENTS_CONNECT", conflicts_with = "kv_events_bind")]
    kv_events_connect: Option<String>,
    /// The engine connects its KV events socket here (vLLM: `tcp://HOST:PORT`): bind.
    #[arg(long, env = "KVFABRIC_KV_EVENTS_BIND")]
    kv_events_bind: Option<String>,
    /// The engine's replay endpoint (`replay_endpoint`), for events missed.
    #[arg(long, env = "KVFABRIC_KV_REPLAY")]
    kv_replay: Option<String>,
    /// The events' topic (`topic` in the engine's events config).
    #[arg(long, env = "KVFABRIC_KV_TOPIC", default_value = "")]
    kv_topic: String,
    #[command(flatten)]
    control: super::control::ControlArgs,
    /// Discovery lease TTL, seconds.
    #[arg(long, env = "KVFABRIC_LEASE_TTL_S", default_value_t = 10)]
    lease_ttl_s: u64,
    /// How often the engine's health and metrics are read, milliseconds.
    #[arg(long, env = "KVFABRIC_POLL_MS", default_value_t = 1000)]
    poll_ms: u64,
    /// Failed health checks in a row after which the engine is withdrawn.
    #[arg(long, env = "KVFABRIC_DOWN_AFTER", default_value_t = 3)]
    down_after: u32,
    /// Serve `/metrics` (Prometheus: events relayed, resets, skipped blocks, registration)
    /// and `/health` (200 while the engine is registered, 503 when it stops answering) here.
    #[arg(long, env = "KVFABRIC_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

fn engine_addr(url: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("--engine-url {url:?}: only http:// is supported"))?;
    let hostport = rest.split('/').next().unwrap_or(rest);
    hostport
        .to_socket_addrs()
        .with_context(|| format!("--engine-url {url:?}"))?
        .next()
        .with_context(|| format!("--engine-url {url:?}: no address"))
}

pub async fn run(args: AttachArgs) -> anyhow::Result<()> {
    let stop_signal = shutdown_signal();
    let engine = engine_addr(&args.engine_url)?;
    let spec = ModelSpec::from_hf_config_path(args.model_dir.join("config.json"))
        .with_context(|| format!("{}: config.json", args.model_dir.display()))?;
    let layout = spec.block_layout(args.block_size)?;
    let context_len = args.context_len.or(spec.context_length.map(|c| c as usize)).unwrap_or(4096);
    let codec = CodecSpec::ModelDir { path: args.model_dir.clone() };
    kvfabric_serving::engine::TextCodec::from_spec(&codec)
        .with_context(|| format!("the tokenizer of {}", args.model_dir.display()))?;
    let events = match (&args.kv_events_connect, &args.kv_events_bind) {
        (Some(c), None) => EventsEndpoint::Connect(c.clone()),
        (None, Some(b)) => EventsEndpoint::Bind(b.clone()),
        _ => {
            anyhow::bail!("give the engine's KV events as --kv-events-connect or --kv-events-bind")
        }
    };
    let mut sub = SubscriberConfig::new(events.clone());
    sub.replay = args.kv_replay.clone();
    sub.topic = args.kv_topic.clone().into_bytes();
    let cfg = AttachConfig {
        name: args.name.clone(),
        engine,
        engine_model: args.engine_model.clone().unwrap_or_else(|| args.model.clone()),
        priority: args.engine_priority,
        model: ModelInfo { id: args.model.clone(), context_len, layout },
        codec,
        flavor: args.engine,
        events: sub,
        lease_ttl: Duration::from_secs(args.lease_ttl_s.max(1)),
        poll: Duration::from_millis(args.poll_ms.max(10)),
        down_after: args.down_after.max(1),
    };
    let (discovery, bus) = args.control.connect().await?;
    let attachment = Attachment::start(cfg, discovery.clone(), bus.clone()).await?;
    let mut metrics_task = None;
    let mut metrics_addr = None;
    if let Some(at) = args.metrics_listen {
        let stats = attachment.stats_source();
        let own = stats;
        let health = kvfabric::health::Health::default();
        let (addr, task) =
            super::stack::metrics_port(at, None, Some(own), &discovery, &bus, health).await?;
        tracing::info!(%addr, "attach metrics and health listening");
        metrics_addr = Some(addr.to_string());
        metrics_task = Some(task);
    }
    let events_at = match (&events, attachment.bound()) {
        (EventsEndpoint::Bind(_), Some(a)) => format!("tcp://{a}"),
        (EventsEndpoint::Connect(c), _) | (EventsEndpoint::Bind(c), None) => c.clone(),
    };
    tracing::info!(worker = %args.name, %engine, events = %events_at, "attached to the engine");
    super::say!(
        "{}",
        serde_json::json!({
            "attached": args.name, "engine": engine.to_string(), "events": events_at,
            "metrics": metrics_addr,
        })
    );
    stop_signal.await;
    attachment.stop().await;
    if let Some(t) = metrics_task {
        t.abort();
    }
    tracing::info!(worker = %args.name, "attach stopped");
    Ok(())
}
