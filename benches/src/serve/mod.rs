//! `kvfabric bench serve`: a load generator for any OpenAI-compatible endpoint. Streams
//! completions at fixed concurrency levels (or a Poisson request rate), with synthetic prompts
//! of a given length, optionally sharing prefixes; reports TTFT, inter-token latency and
//! end-to-end latency percentiles, request and token throughput, cached prompt tokens and
//! errors. Token counts come from the server's `usage`, so no tokenizer is needed.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::Context;
use clap::Args;
use kvfabric_planner::stats::Percentiles;
use kvfabric_serving::engine::sampling::SplitMix64;
use serde_json::{json, Value};

use kvfabric_serving::sse::SseParser;

pub mod mix;
pub mod replay;
use tokio::net::TcpStream;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Base URL of the server (`http://HOST:PORT` or `https://`, with or without `/v1`);
    /// several, comma-separated (frontends of one deployment), take the requests in turn.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The CA of an `https://` server's certificate (PEM). Each request opens its own
    /// connection, so each pays a TLS handshake.
    #[arg(long)]
    ca: Option<std::path::PathBuf>,
    /// Model id (default: the first one `/v1/models` lists).
    #[arg(long)]
    model: Option<String>,
    /// Concurrency levels to run, one after the other.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    concurrency: Vec<usize>,
    /// Requests per level.
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Poisson arrivals at this many requests/s (concurrency then caps the requests in
    /// flight); without it, each of the `concurrency` clients sends its next request as soon
    /// as the previous one ends.
    #[arg(long)]
    rate: Option<f64>,
    /// Words in each prompt's unique part (about one token each).
    #[arg(long, default_value_t = 128)]
    input_words: usize,
    /// Tokens to generate per request (sent with `ignore_eos`).
    #[arg(long, default_value_t = 64)]
    output_tokens: usize,
    /// Words of a shared prefix before each prompt (0: none).
    #[arg(long, default_value_t = 0)]
    prefix_words: usize,
    /// Distinct shared prefixes (requests pick one at random).
    #[arg(long, default_value_t = 4)]
    prefixes: usize,
    /// Turns per conversation: each turn's prompt is the previous prompt, its answer and
    /// `input_words` new words (the multi-turn workload); turns of one conversation run one
    /// after the other.
    #[arg(long, default_value_t = 1)]
    turns: usize,
    /// A load ramp instead of fixed levels: Poisson arrivals at RATE requests/s for SECONDS,
    /// step after step (`8:60,16:60,32:60,16:60,8:60`); --concurrency then caps the requests
    /// in flight (its first value).
    #[arg(long, value_delimiter = ',', value_parser = parse_step)]
    rate_steps: Vec<(f64, f64)>,
    /// Write one JSON line per request (its start, TTFT and end in seconds from the level's
    /// start, its error) to this file.
    #[arg(long)]
    request_log: Option<std::path::PathBuf>,
    /// Replay a trace (Mooncake FAST'25 JSONL) instead of the generated workload: token-id
    /// prompts expanded from its ids, `max_tokens` its output lengths, sent at its timestamps.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// --trace: how its ids become prompts.
    #[command(flatten)]
    shape: crate::trace::ShapeArgs,
    /// --trace: send this many times faster than the timestamps.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// --trace: send the first N requests only.
    #[arg(long)]
    max_requests: Option<u64>,
    /// --trace: requests in flight at most.
    #[arg(long, default_value_t = 1024)]
    in_flight_max: usize,
    /// --trace: token ids are drawn below this (the server's vocabulary must hold them).
    #[arg(long, default_value_t = 32_000)]
    vocab: u32,
    /// Plot the run over time to this SVG file: request rate, TTFT p50/p99 per window, and
    /// with --planner-log the planner's workers.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Width of the plot's (and the ramp summary's) windows, seconds.
    #[arg(long, default_value_t = 5.0)]
    window_s: f64,
    /// The decision log of a planner serving the endpoint (`--planner-log` of the frontend),
    /// drawn on the plot.
    #[arg(long)]
    planner_log: Option<std::path::PathBuf>,
    /// A TTFT target, ms: drawn on the plot; with --rate-steps, the summary says how many
    /// windows after each step up the TTFT p99 took to come back under it.
    #[arg(long)]
    ttft_target_ms: Option<f64>,
    /// Seed of the prompts and arrivals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A class of a mix (repeat for each): `NAME:share=0.1,prefix=300,prompt=40,output=32,
    /// ttft=300ms,itl=50ms` (`prompt=2000-8000`: drawn uniformly). The mix is offered at
    /// --rate for --requests requests, each naming its class in `x-kvfabric-class`; the report
    /// is per class, with the goodput (requests that met the class's targets per second).
    #[arg(long = "mix", value_parser = mix::parse_mix)]
    mix: Vec<mix::MixClass>,
    /// --mix: do not name the class (the same load, to a server without classes).
    #[arg(long)]
    no_class_header: bool,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// Print JSON rows.
    #[arg(long)]
    json: bool,
    /// --mix: send this many requests of the mix first (the same arrivals) without counting
    /// them, so that the counted ones meet the deployment in its steady state (each worker
    /// has computed the shared prefixes once).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// --mix: also write the JSON rows to this file (the table still prints), for scripts
    /// that compare runs.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
}

fn parse_step(s: &str) -> Result<(f64, f64), String> {
    let (r, d) = s.split_once(':').ok_or_else(|| format!("{s:?}: a step is RATE:SECONDS"))?;
    match (r.trim().parse::<f64>(), d.trim().parse::<f64>()) {
        (Ok(r), Ok(d)) if r > 0.0 && r.is_finite() && d > 0.0 && d.is_finite() => Ok((r, d)),
        _ => Err(format!("{s:?}: RATE and SECONDS must be numbers > 0")),
    }
}

/// Arrival times (seconds from the start) of a Poisson process whose rate steps.
fn arrivals(steps: &[(f64, f64)], rng: &mut SplitMix64) -> Vec<f64> {
    let (mut out, mut t, mut end) = (Vec::new(), 0.0f64, 0.0f64);
    for &(rate, secs) in steps {
        let start = end;
        end += secs;
        t = t.max(start);
        loop {
            // Memoryless: restarting the draw at a step's start is exact.
            let u = rng.next_f64().max(1e-12);
            let next = t - u.ln() / rate;
            if next >= end {
                t = end;
                break;
            }
            out.push(next);
            t = next;
        }
    }
    out
}

#[derive(Debug, serde::Serialize)]
struct Row {
    concurrency: usize,
    rate: Option<f64>,
    requests: usize,
    errors: usize,
    duration_s: f64,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    prompt_tokens_per_s: f64,
    cached_prompt_share: f64,
    ttft_ms: [f64; 3],
    itl_ms: [f64; 3],
    e2e_ms: [f64; 3],
}

/// One request's outcome, as the client saw it.
#[derive(Debug, Default)]
pub struct Outcome {
    /// When it was sent, from the level's start.
    pub sent: Duration,
    /// Time to its first token, if one came.
    pub ttft: Option<Duration>,
    /// The gaps between its tokens (inter-token latency).
    pub gaps: Vec<Duration>,
    /// From sending to the end of the answer.
    pub e2e: Duration,
    /// Prompt tokens, as the server's usage says.
    pub prompt_tokens: u64,
    /// Completion tokens, as the server's usage says.
    pub completion_tokens: u64,
    /// Prompt tokens the server found cached.
    pub cached_tokens: u64,
    /// ... per tier (device, host, disk, remote), where the server is kvfabric.
    pub cached_per_tier: [u64; 4],
    /// ... of them, pulled from another worker's store (counted in remote too).
    pub cached_peer: u64,
    /// The answer's text.
    pub text: String,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

const WORDS: &[&str] = &[
    "time", "people", "river", "market", "garden", "window", "music", "history", "science",
    "mountain", "city", "winter", "summer", "story", "letter", "friend", "table", "question",
    "answer", "light", "water", "forest", "road", "train", "paper", "school", "family", "morning",
    "evening", "journey", "idea", "number", "color", "language", "animal", "ocean",
];

fn words(rng: &mut SplitMix64, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    s
}

/// An OpenAI-compatible endpoint ([`target`]).
#[derive(Debug)]
pub struct Target {
    /// Each server's address and its `Host` header.
    servers: Vec<(SocketAddr, String)>,
    prefix: String,
    /// TLS to `https://` servers (trusting the CA given).
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    /// The next server (round robin).
    next: std::sync::atomic::AtomicUsize,
}

impl Target {
    /// The server of the next exchange.
    fn pick(&self) -> &(SocketAddr, String) {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &self.servers[n % self.servers.len()]
    }
}

/// The endpoints of `urls` (comma-separated `http://host:port`, optionally with one path
/// prefix; `/v1` when none): exchanges go to each in turn.
pub async fn target(urls: &str) -> crate::Result<Target> {
    target_with_ca(urls, None).await
}

/// [`target`] for `https://` URLs too: their certificates must chain to `ca`.
pub async fn target_with_ca(urls: &str, ca: Option<&std::path::Path>) -> crate::Result<Target> {
    let mut servers = Vec::new();
    let mut prefix = None;
    let mut schemes = std::collections::HashSet::new();
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let https = url.starts_with("https://");
        schemes.insert(https);
        let (addr, host, p) = endpoint(
            url.strip_prefix("https://")
                .map_or(url.to_string(), |r| format!("http://{r}"))
                .as_str(),
        )
        .await?;
        crate::ensure!(
            prefix.as_ref().is_none_or(|q| *q == p),
            "--url: every server needs the same path prefix"
        );
        prefix = Some(p);
        servers.push((addr, host));
    }
    let prefix = prefix.ok_or_else(|| crate::failed!("--url names no server"))?;
    crate::ensure!(schemes.len() == 1, "--url: give every server with the same scheme");
    let tls = if schemes.contains(&true) {
        let ca = ca.ok_or_else(|| {
            crate::failed!("https URLs need --ca (the CA of the server's certificate)")
        })?;
        let mut config = (*kvfabric::tls::client_config(ca, None)
            .map_err(|e| crate::failed!("--ca: {e}"))?)
        .clone();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Some(std::sync::Arc::new(config))
    } else {
        None
    };
    Ok(Target { servers, prefix, tls, next: Default::default() })
}

/// The address, `Host` and path prefix of one URL.
async fn endpoint(url: &str) -> crate::Result<(SocketAddr, String, String)> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| crate::failed!("--url must start with http:// or https:// (got {url:?})"))?;
    let (hostport, path) = rest.split_once('/').map_or((rest, ""), |(h, p)| (h, p));
    let path = path.trim_end_matches('/');
    let prefix =
        if path.is_empty() || path == "v1" { "/v1".to_string() } else { format!("/{path}") };
    let addr = tokio::net::lookup_host(hostport)
        .await
        .with_context(|| format!("resolving {hostport}"))?
        .next()
        .ok_or_else(|| crate::failed!("{hostport} does not resolve"))?;
    Ok((addr, hostport.to_string(), prefix))
}

/// Aborts a task when dropped (the connection of an exchange that ended early).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One HTTP/1.1 exchange (hyper); `on_data` sees each piece of the decoded body as it
/// arrives.
pub async fn exchange(
    t: &Target,
    method: &str,
    path: &str,
    body: &str,
    on_data: impl FnMut(&[u8]),
) -> crate::Result<u16> {
    exchange_with(t, method, path, body, &[], on_data).await
}

/// [`exchange`] with more request headers.
pub async fn exchange_with(
    t: &Target,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&'static str, String)],
    mut on_data: impl FnMut(&[u8]),
) -> crate::Result<u16> {
    use http_body_util::BodyExt;
    let (addr, host) = t.pick();
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let stream = match &t.tls {
        None => kvfabric::tls::Stream::Plain(tcp),
        Some(config) => {
            let name = host.rsplit_once(':').map_or(host.as_str(), |(h, _)| h);
            let name = rustls::pki_types::ServerName::try_from(name.to_string())
                .map_err(|e| crate::failed!("{host}: {e}"))?;
            let s = tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp).await?;
            kvfabric::tls::Stream::Client(Box::new(s))
        }
    };
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let _conn = AbortOnDrop(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("{}{path}", t.prefix))
        .header(hyper::header::HOST, host)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::ACCEPT, "text/event-stream, application/json");
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let req = req.body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            on_data(&data);
        }
    }
    Ok(status)
}

/// Sends one completion request (`body`, streamed or not) and reads its answer to the end
/// within `timeout`: its timings, usage and text, or why it failed.
pub async fn one_request(t: &Target, body: String, timeout: Duration) -> Outcome {
    one_request_with(t, body, &[], timeout).await
}

/// [`one_request`] with more request headers.
pub async fn one_request_with(
    t: &Target,
    body: String,
    headers: &[(&'static str, String)],
    timeout: Duration,
) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome::default();
    let mut sse = SseParser::default();
    let mut last: Option<Instant> = None;
    let mut body_text = Vec::new();
    let r = tokio::time::timeout(
        timeout,
        exchange_with(t, "POST", "/completions", &body, headers, |data| {
            body_text.extend_from_slice(data);
            let events = match sse.push_data(data) {
                Ok(events) => events,
                Err(e) => {
                    out.error = Some(e.to_string());
                    Vec::new()
                }
            };
            for d in events {
                if d == "[DONE]" {
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(&d) else {
                    out.error = Some(format!("unparsable event {d:?}"));
                    continue;
                };
                if let Some(e) = v.get("error") {
                    out.error = Some(e["message"].as_str().unwrap_or("error event").to_string());
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                    out.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                    out.cached_tokens =
                        u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                    let c = &v["kvfabric"]["cached_tokens"];
                    out.cached_per_tier =
                        ["device_tokens", "host_tokens", "disk_tokens", "remote_tokens"]
                            .map(|k| c[k].as_u64().unwrap_or(0));
                    out.cached_peer = c["peer_tokens"].as_u64().unwrap_or(0);
                    out.cached_per_tier[3] += out.cached_peer;
                }
                let text = v["choices"].get(0).and_then(|c| c["text"].as_str()).unwrap_or("");
                out.text.push_str(text);
                if !text.is_empty() {
                    let now = Instant::now();
                    match last {
                        None => out.ttft = Some(now - start),
                        Some(l) => out.gaps.push(now - l),
                    }
                    last = Some(now);
                }
            }
        }),
    )
    .await;
    out.e2e = start.elapsed();
    match r {
        Err(_) => out.error = Some(format!("timed out after {timeout:?}")),
        Ok(Err(e)) => out.error = Some(e.to_string()),
        Ok(Ok(status)) if status != 200 => {
            out.error = Some(format!("HTTP {status}: {}", String::from_utf8_lossy(&body_text)))
        }
        // Tokens whose text is empty send no event; the usage still counts them.
        Ok(Ok(_)) if out.ttft.is_none() && out.completion_tokens == 0 && out.error.is_none() => {
            out.error = Some("no tokens".into())
        }
        Ok(Ok(_)) => {}
    }
    out
}

/// What the requests that succeeded add up to.
pub(crate) struct Summary {
    /// TTFT ms p50, p90, p99.
    pub ttft_ms: [f64; 3],
    /// Every gap between tokens, ms p50, p90, p99.
    pub itl_ms: [f64; 3],
    /// End to end ms p50, p90, p99.
    pub e2e_ms: [f64; 3],
    /// Prompt tokens, as the server counted them.
    pub prompt: u64,
    /// Of them, found cached.
    pub cached: u64,
    /// Completion tokens.
    pub completion: u64,
}

/// Sums up outcomes (those that succeeded).
pub(crate) fn summarize(ok: &[&Outcome]) -> Summary {
    let p3 = |d: &[Duration]| {
        let p = Percentiles::of(d);
        [p.p50_us / 1e3, p.p90_us / 1e3, p.p99_us / 1e3]
    };
    let ttfts: Vec<Duration> = ok.iter().filter_map(|o| o.ttft).collect();
    let gaps: Vec<Duration> = ok.iter().flat_map(|o| o.gaps.iter().copied()).collect();
    let e2es: Vec<Duration> = ok.iter().map(|o| o.e2e).collect();
    Summary {
        ttft_ms: p3(&ttfts),
        itl_ms: p3(&gaps),
        e2e_ms: p3(&e2es),
        prompt: ok.iter().map(|o| o.prompt_tokens).sum(),
        cached: ok.iter().map(|o| o.cached_tokens).sum(),
        completion: ok.iter().map(|o| o.completion_tokens).sum(),
    }
}

/// The first model the server lists.
pub async fn first_model(t: &Target) -> crate::Result<String> {
    let mut body = Vec::new();
    let status = exchange(t, "GET", "/models", "", |d| body.extend_from_slice(d)).await?;
    crate::ensure!(status == 200, "GET /models answered {status}");
    let v: Value = serde_json::from_slice(&body).context("/models is not JSON")?;
    Ok(v["data"][0]["id"].as_str().ok_or_else(|| crate::failed!("no model listed"))?.to_string())
}

pub async fn run(args: ServeArgs) -> crate::Result<()> {
    let t = target_with_ca(&args.url, args.ca.as_deref()).await?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&t).await.with_context(|| format!("GET {}/models", args.url))?,
    };
    if !args.mix.is_empty() {
        let cfg = mix::MixConfig {
            classes: args.mix.clone(),
            rate: args.rate.unwrap_or(1.0),
            requests: args.requests.max(1),
            class_header: !args.no_class_header,
            vocab: args.vocab,
            seed: args.seed,
            timeout: Duration::from_secs(args.timeout_s.max(1)),
            in_flight_max: args.in_flight_max,
            warmup: args.warmup,
        };
        let rows = mix::run_mix(t, &model, &cfg).await?;
        if let Some(path) = &args.json_out {
            let mut out = String::new();
            for r in &rows {
                out.push_str(&serde_json::to_string(r)?);
                out.push('\n');
            }
            std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))?;
        }
        if args.json {
            for r in &rows {
                println!("{}", serde_json::to_string(r)?);
            }
        } else {
            mix::print(&args.url, &cfg, &rows);
        }
        return Ok(());
    }
    if let Some(file) = &args.trace {
        use replay::{print, replay, OnlineConfig};
        let cfg = OnlineConfig {
            file: file.clone(),
            reshape: args.shape.reshape()?,
            prompt_tokens_max: args.shape.max_prompt_tokens,
            speedup: args.speedup,
            requests_max: args.max_requests.unwrap_or(u64::MAX),
            in_flight_max: args.in_flight_max,
            vocab: args.vocab,
            seed: args.seed,
            timeout: Duration::from_secs(args.timeout_s.max(1)),
        };
        let r = replay(t, &model, &cfg).await?;
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            print(&model, &args.url, &cfg, &r);
        }
        return Ok(());
    }
    let mut rng = SplitMix64(args.seed);
    let prefixes: Vec<String> =
        (0..args.prefixes.max(1)).map(|_| words(&mut rng, args.prefix_words)).collect();
    let mut rows = Vec::new();
    let ramp = (!args.rate_steps.is_empty()).then(|| arrivals(&args.rate_steps, &mut rng));
    let run_start_unix_ms = unix_ms();
    let levels: Vec<usize> = if ramp.is_some() {
        args.concurrency.first().copied().into_iter().collect()
    } else {
        args.concurrency.clone()
    };
    let mut all: Vec<Outcome> = Vec::new();
    for &conc in &levels {
        let conc = conc.max(1);
        let turns = if ramp.is_some() { 1 } else { args.turns.max(1) };
        let count = ramp.as_ref().map_or(args.requests.max(1).div_ceil(turns), Vec::len);
        let sessions: Vec<(String, Vec<String>)> = (0..count)
            .map(|_| {
                let p = prefixes[(rng.next_u64() % prefixes.len() as u64) as usize].clone();
                (p, (0..turns).map(|_| words(&mut rng, args.input_words)).collect())
            })
            .collect();
        let total = sessions.len() * turns;
        let bar = if args.json {
            indicatif::ProgressBar::hidden()
        } else {
            indicatif::ProgressBar::new(total as u64)
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "concurrency {msg} [{bar:30}] {pos}/{len} {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(conc.to_string());
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(conc));
        let t = std::sync::Arc::new(Target {
            servers: t.servers.clone(),
            prefix: t.prefix.clone(),
            tls: t.tls.clone(),
            next: Default::default(),
        });
        let timeout = Duration::from_secs(args.timeout_s.max(1));
        let (model, max_tokens) = (model.clone(), args.output_tokens);
        let start = Instant::now();
        let mut tasks = Vec::new();
        let mut next_at = Instant::now();
        for (k, (prefix, users)) in sessions.into_iter().enumerate() {
            let scheduled =
                ramp.as_ref().and_then(|a| a.get(k)).map(|at| Duration::from_secs_f64(*at));
            if let Some(at) = scheduled {
                tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
            } else if let Some(rate) = args.rate.filter(|r| *r > 0.0) {
                // Exponential gaps between conversations: a Poisson process.
                let u = rng.next_f64().max(1e-12);
                next_at += Duration::from_secs_f64(-u.ln() / rate);
                tokio::time::sleep_until(tokio::time::Instant::from_std(next_at)).await;
            }
            let permit = sem.clone().acquire_owned().await?;
            let (t, bar, model) = (t.clone(), bar.clone(), model.clone());
            tasks.push(tokio::spawn(async move {
                let mut outs = Vec::with_capacity(users.len());
                let mut history = prefix;
                for user in users {
                    let prompt =
                        if history.is_empty() { user } else { format!("{history} {user}") };
                    let body = json!({
                        "model": model, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": true, "stream": true,
                        "stream_options": {"include_usage": true},
                    })
                    .to_string();
                    let sent = start.elapsed();
                    let mut o = one_request(&t, body, timeout).await;
                    o.sent = sent;
                    if let Some(due) = scheduled.filter(|d| *d < sent) {
                        // Held back by the concurrency cap: the wait is the request's too
                        // (no coordinated omission), and it counts when it was due.
                        let late = sent - due;
                        o.ttft = o.ttft.map(|t| t + late);
                        o.e2e += late;
                        o.sent = due;
                    }
                    history = format!("{prompt}{}", o.text);
                    bar.inc(1);
                    let failed = o.error.is_some();
                    outs.push(o);
                    if failed {
                        break;
                    }
                }
                drop(permit);
                outs
            }));
        }
        let mut outs = Vec::new();
        for task in tasks {
            outs.extend(task.await?);
        }
        let duration = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        let ok: Vec<&Outcome> = outs.iter().filter(|o| o.error.is_none()).collect();
        let errors: Vec<&String> = outs.iter().filter_map(|o| o.error.as_ref()).collect();
        if let Some(e) = errors.first() {
            eprintln!("{} of {} requests failed; first error: {e}", errors.len(), outs.len());
        }
        let Summary { ttft_ms, itl_ms, e2e_ms, prompt, cached, completion } = summarize(&ok);
        rows.push(Row {
            concurrency: conc,
            rate: args.rate.or(ramp.as_ref().map(|a| a.len() as f64 / duration)),
            requests: outs.len(),
            errors: errors.len(),
            duration_s: duration,
            requests_per_s: ok.len() as f64 / duration,
            output_tokens_per_s: completion as f64 / duration,
            prompt_tokens_per_s: prompt as f64 / duration,
            cached_prompt_share: if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 },
            ttft_ms,
            itl_ms,
            e2e_ms,
        });
        all.extend(outs);
    }
    if let Some(path) = &args.request_log {
        let mut text = String::new();
        for o in &all {
            let line = json!({
                "sent_s": o.sent.as_secs_f64(),
                "ttft_s": o.ttft.map(|d| d.as_secs_f64()),
                "e2e_s": o.e2e.as_secs_f64(),
                "error": o.error,
            });
            text.push_str(&format!("{line}\n"));
        }
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let decisions = match &args.planner_log {
        Some(path) => read_decisions(path, run_start_unix_ms)?,
        None => Vec::new(),
    };
    if let Some(path) = &args.plot {
        let svg = timeline(&all, &decisions, args.window_s, args.ttft_target_ms);
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    let ramp_rows = match (&ramp, args.ttft_target_ms) {
        (Some(_), Some(target)) => ramp_summary(&all, &args.rate_steps, args.window_s, target),
        _ => Vec::new(),
    };
    if args.json {
        for r in &ramp_rows {
            println!("{}", serde_json::to_string(r)?);
        }
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "{} at {} — {} requests per level, ~{}+{} prompt words, {} turn(s), {} output tokens",
        model,
        args.url,
        args.requests,
        args.prefix_words,
        args.input_words,
        args.turns,
        args.output_tokens
    );
    println!(
        "{:>5} {:>6} {:>7} {:>9} {:>9} {:>7} {:>24} {:>24} {:>24}",
        "conc",
        "errors",
        "req/s",
        "out tok/s",
        "in tok/s",
        "cached",
        "TTFT ms p50/p90/p99",
        "ITL ms p50/p90/p99",
        "e2e ms p50/p90/p99"
    );
    let f = |x: [f64; 3]| format!("{:.1}/{:.1}/{:.1}", x[0], x[1], x[2]);
    for r in &rows {
        println!(
            "{:>5} {:>6} {:>7.2} {:>9.1} {:>9.1} {:>6.0}% {:>24} {:>24} {:>24}",
            r.concurrency,
            r.errors,
            r.requests_per_s,
            r.output_tokens_per_s,
            r.prompt_tokens_per_s,
            r.cached_prompt_share * 100.0,
            f(r.ttft_ms),
            f(r.itl_ms),
            f(r.e2e_ms)
        );
    }
    if !ramp_rows.is_empty() {
        println!(
            "\nramp (windows of {} s; TTFT target {} ms)",
            args.window_s,
            args.ttft_target_ms.unwrap_or_default()
        );
        println!(
            "{:>6} {:>8} {:>8} {:>8} {:>14} {:>32}",
            "step", "req/s", "sent", "errors", "TTFT p99 ms", "step up: under the target after"
        );
        for r in &ramp_rows {
            let after = match (r.up, r.under_target_after_s) {
                (false, _) => "-".to_string(),
                (true, Some(s)) => format!("{s:.0} s"),
                (true, None) => "never".to_string(),
            };
            println!(
                "{:>6} {:>8.1} {:>8} {:>8} {:>14.1} {:>32}",
                r.step, r.rate, r.requests, r.errors, r.ttft_p99_ms, after
            );
        }
    }
    if let Some(path) = &args.plot {
        println!("timeline written to {}", path.display());
    }
    Ok(())
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A planner decision as its log has it: when (seconds from the run's start), workers after
/// it, workers asked for.
#[derive(Debug, Clone, Copy)]
struct Decided {
    at_s: f64,
    before: f64,
    after: f64,
    desired: f64,
}

fn read_decisions(path: &std::path::Path, start_unix_ms: u64) -> crate::Result<Vec<Decided>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", path.display(), i + 1))?;
        let (Some(at), Some(before), Some(after), Some(desired)) = (
            v["at_unix_ms"].as_u64(),
            v["before"].as_f64(),
            v["after"].as_f64(),
            v["desired"].as_f64(),
        ) else {
            crate::bail!("{} line {}: not a planner decision", path.display(), i + 1);
        };
        if at >= start_unix_ms {
            out.push(Decided { at_s: (at - start_unix_ms) as f64 / 1e3, before, after, desired });
        }
    }
    Ok(out)
}

/// One step of a ramp, measured.
#[derive(Debug, serde::Serialize)]
struct RampRow {
    step: usize,
    rate: f64,
    requests: usize,
    errors: usize,
    ttft_p99_ms: f64,
    /// For a step up: seconds from the step's start to the start of the first window whose
    /// TTFT p99 is within the target and stays so for the rest of the step; None if none.
    under_target_after_s: Option<f64>,
    /// Whether this step raised the rate.
    up: bool,
}

fn p99_ms(outs: &[&Outcome]) -> f64 {
    let t: Vec<Duration> = outs.iter().filter_map(|o| o.ttft).collect();
    Percentiles::of(&t).p99_us / 1e3
}

fn ramp_summary(
    all: &[Outcome],
    steps: &[(f64, f64)],
    window_s: f64,
    target_ms: f64,
) -> Vec<RampRow> {
    let window_s = window_s.max(0.1);
    let mut rows = Vec::new();
    let mut start = 0.0;
    for (i, &(rate, secs)) in steps.iter().enumerate() {
        let end = start + secs;
        let within = |a: f64, b: f64| -> Vec<&Outcome> {
            all.iter().filter(|o| (a..b).contains(&o.sent.as_secs_f64())).collect()
        };
        let outs = within(start, end);
        let up = i > 0 && rate > steps[i - 1].0;
        let under_target_after_s = if up {
            let n = (secs / window_s).ceil() as usize;
            let under: Vec<bool> = (0..n)
                .map(|w| {
                    let a = start + w as f64 * window_s;
                    let ws = within(a, (a + window_s).min(end));
                    ws.iter().all(|o| o.ttft.is_none()) || p99_ms(&ws) <= target_ms
                })
                .collect();
            // The first window from which every window of the step is under the target.
            let from = under.iter().rposition(|u| !u).map_or(0, |i| i + 1);
            (from < n).then_some(from as f64 * window_s)
        } else {
            None
        };
        rows.push(RampRow {
            step: i + 1,
            rate,
            requests: outs.len(),
            errors: outs.iter().filter(|o| o.error.is_some()).count(),
            ttft_p99_ms: p99_ms(&outs),
            under_target_after_s,
            up,
        });
        start = end;
    }
    rows
}

/// The run over time: request rate, TTFT p50/p99 per window (and the target), the planner's
/// workers.
fn timeline(
    all: &[Outcome],
    decisions: &[Decided],
    window_s: f64,
    target_ms: Option<f64>,
) -> String {
    use crate::plot::{render, Chart, Series};
    let window_s = window_s.max(0.1);
    let end = all.iter().map(|o| o.sent.as_secs_f64()).fold(0.0, f64::max);
    let n = (end / window_s).ceil() as usize + 1;
    let (mut rate, mut p50, mut p99, mut errors) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for w in 0..n {
        let a = w as f64 * window_s;
        let ws: Vec<&Outcome> =
            all.iter().filter(|o| (a..a + window_s).contains(&o.sent.as_secs_f64())).collect();
        let mid = a + window_s / 2.0;
        rate.push((mid, ws.len() as f64 / window_s));
        errors.push((mid, ws.iter().filter(|o| o.error.is_some()).count() as f64 / window_s));
        let t: Vec<Duration> = ws.iter().filter_map(|o| o.ttft).collect();
        if !t.is_empty() {
            let p = Percentiles::of(&t);
            p50.push((mid, p.p50_us / 1e3));
            p99.push((mid, p.p99_us / 1e3));
        }
    }
    let mut ttft = vec![Series::line("TTFT p50", p50), Series::line("TTFT p99", p99.clone())];
    if let Some(t) = target_ms {
        let xs = (0.0, n as f64 * window_s);
        ttft.push(Series { dashed: true, ..Series::line("target", vec![(xs.0, t), (xs.1, t)]) });
    }
    let mut charts = vec![
        Chart {
            x_log2: false,
            x_bytes: false,
            title: "Load".into(),
            x_label: "seconds".into(),
            y_label: "requests/s".into(),
            series: vec![Series::line("sent", rate), Series::line("failed", errors)],
        },
        Chart {
            x_log2: false,
            x_bytes: false,
            title: format!("Time to first token (windows of {window_s} s)"),
            x_label: "seconds".into(),
            y_label: "ms".into(),
            series: ttft,
        },
    ];
    if !decisions.is_empty() {
        // From the run's start (the workers before the first decision) to its end.
        let step = |f: fn(&Decided) -> f64| -> Vec<(f64, f64)> {
            let first = decisions.first().map(|d| (0.0, d.before));
            let last = decisions.last().map(|d| (end.max(d.at_s), f(d)));
            first.into_iter().chain(decisions.iter().map(|d| (d.at_s, f(d)))).chain(last).collect()
        };
        charts.push(Chart {
            x_log2: false,
            x_bytes: false,
            title: "Planner".into(),
            x_label: "seconds".into(),
            y_label: "workers".into(),
            series: vec![
                Series { steps: true, ..Series::line("serving", step(|d| d.after)) },
                Series {
                    steps: true,
                    dashed: true,
                    ..Series::line("asked for", step(|d| d.desired))
                },
            ],
        });
    }
    render(&charts, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ramps_arrive_at_each_steps_rate() {
        let steps = [(50.0, 20.0), (200.0, 10.0), (10.0, 30.0)];
        let a = arrivals(&steps, &mut SplitMix64(3));
        let count = |lo: f64, hi: f64| a.iter().filter(|&&t| t >= lo && t < hi).count() as f64;
        // Poisson counts: mean λt, sd √(λt); within 4 sd.
        for (lo, hi, want) in [(0.0, 20.0, 1000.0), (20.0, 30.0, 2000.0), (30.0, 60.0, 300.0)] {
            let got = count(lo, hi);
            assert!((got - want).abs() < 4.0 * want.sqrt(), "{lo}..{hi}: {got} against {want}");
        }
        assert!(a.windows(2).all(|w| w[0] <= w[1]) && a.last().unwrap() < &60.0);
        assert_eq!(parse_step("8:60"), Ok((8.0, 60.0)));
        assert!(
            parse_step("8").is_err() && parse_step("0:5").is_err() && parse_step("x:1").is_err()
        );
    }
}
