//! `kvfabric bench serve --mix ...`: a mix of service classes offered at a Poisson rate.
//! Each class has its share of the requests, its prompt shape (a prefix shared by all of its
//! requests, then a unique part of a fixed or uniformly drawn length, as token ids), its
//! output length and its targets; each request names its class with `x-kvfabric-class`
//! (unless `--no-class-header`: the same load to a server without classes). The report, per
//! class: requests answered, shed (429) and expired (504), TTFT and ITL percentiles, and the
//! goodput, the requests per second that met the class's targets (TTFT within its target,
//! mean time per output token within its ITL target) — the measure that compares scheduling
//! policies on the same load.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_planner::stats::Percentiles;
use kvfabric_serving::engine::sampling::SplitMix64;
use serde_json::json;

use super::{one_request_with, Outcome, Target};

/// One class of the mix.
#[derive(Debug, Clone, PartialEq)]
pub struct MixClass {
    /// Its name (sent as `x-kvfabric-class`).
    pub name: String,
    /// Its share of the requests.
    pub share: f64,
    /// Tokens of the prefix all its requests share.
    pub prefix: usize,
    /// Tokens of each request's own part: drawn uniformly in this range.
    pub prompt: (usize, usize),
    /// Tokens generated.
    pub output: usize,
    /// Its TTFT target.
    pub ttft: Option<Duration>,
    /// Its ITL target (mean time per output token).
    pub itl: Option<Duration>,
}

/// `NAME:share=0.1,prefix=300,prompt=40,output=32,ttft=300ms,itl=50ms`; `prompt=2000-8000`
/// draws each prompt's length uniformly.
pub fn parse_mix(s: &str) -> Result<MixClass, String> {
    let (name, rest) =
        s.split_once(':').ok_or_else(|| format!("{s:?}: NAME:share=...,prompt=..."))?;
    let mut c = MixClass {
        name: name.trim().to_string(),
        share: 0.0,
        prefix: 0,
        prompt: (128, 128),
        output: 32,
        ttft: None,
        itl: None,
    };
    let num = |k: &str, v: &str| v.trim().parse::<usize>().map_err(|_| format!("{s:?}: {k}={v:?}"));
    for part in rest.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) =
            part.split_once('=').ok_or_else(|| format!("{s:?}: {part:?} is not KEY=VALUE"))?;
        match k.trim() {
            "share" => {
                c.share = v.trim().parse().map_err(|_| format!("{s:?}: share={v:?}"))?;
            }
            "prefix" => c.prefix = num(k, v)?,
            "prompt" => {
                c.prompt = match v.split_once('-') {
                    Some((a, b)) => (num(k, a)?, num(k, b)?),
                    None => (num(k, v)?, num(k, v)?),
                };
            }
            "output" => c.output = num(k, v)?.max(1),
            "ttft" => c.ttft = Some(kvfabric_serving::classes::parse_duration(v)?),
            "itl" => c.itl = Some(kvfabric_serving::classes::parse_duration(v)?),
            other => return Err(format!("{s:?}: unknown key {other:?}")),
        }
    }
    if !(c.share > 0.0 && c.share.is_finite()) || c.prompt.0 == 0 || c.prompt.0 > c.prompt.1 {
        return Err(format!("{s:?}: share must be > 0 and prompt a length or LO-HI with LO <= HI"));
    }
    Ok(c)
}

/// How the mix is run.
#[derive(Debug, Clone)]
pub struct MixConfig {
    /// The classes.
    pub classes: Vec<MixClass>,
    /// Requests per second offered (Poisson).
    pub rate: f64,
    /// Requests sent.
    pub requests: usize,
    /// Name each request's class in `x-kvfabric-class`.
    pub class_header: bool,
    /// Token ids are drawn below this.
    pub vocab: u32,
    /// Seed of prompts and arrivals.
    pub seed: u64,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Requests in flight at most.
    pub in_flight_max: usize,
    /// The first requests of the arrival process that are sent but not counted (the
    /// deployment's caches and queues reach their steady state first: each worker computes
    /// a shared prefix once, whichever request brings it first).
    pub warmup: usize,
}

/// One class's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MixRow {
    /// The class.
    pub class: String,
    /// Requests sent.
    pub sent: usize,
    /// Answered.
    pub ok: usize,
    /// Refused with 429 (shed).
    pub shed: usize,
    /// Failed with 504 (expired or past the deadline).
    pub expired: usize,
    /// Other failures.
    pub errors: usize,
    /// TTFT of those answered, ms p50, p90, p99.
    pub ttft_ms: [f64; 3],
    /// Every gap between tokens, ms p50, p90, p99.
    pub itl_ms: [f64; 3],
    /// Mean time per output token, ms p50 and p99 over requests.
    pub tpot_ms: [f64; 2],
    /// Answered per second.
    pub throughput_rps: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Requests per second that met the class's targets.
    pub goodput_rps: f64,
    /// Share of the sent requests that met them.
    pub attainment: f64,
    /// The first of the other failures, as the client saw it.
    pub first_error: Option<String>,
}

fn p3(d: &[Duration]) -> [f64; 3] {
    let p = Percentiles::of(d);
    [p.p50_us / 1e3, p.p90_us / 1e3, p.p99_us / 1e3]
}

/// Runs the mix against `t` serving `model`.
pub async fn run_mix(t: Target, model: &str, cfg: &MixConfig) -> crate::Result<Vec<MixRow>> {
    crate::ensure!(!cfg.classes.is_empty(), "no classes in the mix");
    crate::ensure!(cfg.rate > 0.0 && cfg.rate.is_finite(), "--rate must be > 0");
    let mut rng = SplitMix64(cfg.seed);
    let vocab = u64::from(cfg.vocab.max(1001));
    let token = move |rng: &mut SplitMix64| 1000 + (rng.next_u64() % (vocab - 1000)) as u32;
    let prefixes: Vec<Vec<u32>> =
        cfg.classes.iter().map(|c| (0..c.prefix).map(|_| token(&mut rng)).collect()).collect();
    let total: f64 = cfg.classes.iter().map(|c| c.share).sum();
    let t = Arc::new(t);
    let sem = Arc::new(tokio::sync::Semaphore::new(cfg.in_flight_max.max(1)));
    let start = Instant::now();
    let mut next_at = start;
    let mut tasks = Vec::with_capacity(cfg.requests);
    let mut counted_from = Duration::ZERO;
    for i in 0..cfg.warmup + cfg.requests {
        let mut pick = rng.next_f64() * total;
        let k = cfg
            .classes
            .iter()
            .position(|c| {
                pick -= c.share;
                pick < 0.0
            })
            .unwrap_or(cfg.classes.len() - 1);
        let c = &cfg.classes[k];
        let n = c.prompt.0 + (rng.next_u64() % (c.prompt.1 - c.prompt.0 + 1) as u64) as usize;
        let mut prompt = prefixes[k].clone();
        prompt.extend((0..n).map(|_| token(&mut rng)));
        let body = json!({
            "model": model, "prompt": prompt, "max_tokens": c.output, "temperature": 0,
            "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
        })
        .to_string();
        let headers: Vec<(&'static str, String)> =
            if cfg.class_header { vec![("x-kvfabric-class", c.name.clone())] } else { Vec::new() };
        let u = rng.next_f64().max(1e-12);
        next_at += Duration::from_secs_f64(-u.ln() / cfg.rate);
        tokio::time::sleep_until(tokio::time::Instant::from_std(next_at)).await;
        let due = next_at - start;
        if i == cfg.warmup {
            counted_from = due;
        }
        let permit = sem.clone().acquire_owned().await?;
        let (t, timeout) = (t.clone(), cfg.timeout);
        tasks.push(tokio::spawn(async move {
            let sent = start.elapsed();
            let mut o = one_request_with(&t, body, &headers, timeout).await;
            drop(permit);
            // Held back by the in-flight cap: the wait is the request's too.
            let late = sent.saturating_sub(due);
            o.ttft = o.ttft.map(|x| x + late);
            o.e2e += late;
            o.sent = due;
            (k, o)
        }));
    }
    let mut outs: Vec<Vec<Outcome>> = cfg.classes.iter().map(|_| Vec::new()).collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let (k, o) = task.await?;
        if i >= cfg.warmup {
            outs[k].push(o);
        }
    }
    // Rates over the counted requests: from the first one's arrival to the last answer.
    let duration = start.elapsed().saturating_sub(counted_from).as_secs_f64();
    Ok(cfg.classes.iter().zip(outs).map(|(c, outs)| row(c, &outs, duration)).collect())
}

fn row(c: &MixClass, outs: &[Outcome], duration: f64) -> MixRow {
    let status = |o: &Outcome, code: &str| {
        o.error.as_deref().is_some_and(|e| e.starts_with(&format!("HTTP {code}")))
    };
    let ok: Vec<&Outcome> = outs.iter().filter(|o| o.error.is_none()).collect();
    let shed = outs.iter().filter(|o| status(o, "429")).count();
    let expired = outs.iter().filter(|o| status(o, "504")).count();
    let tpot = |o: &Outcome| {
        (o.completion_tokens > 1 && !o.gaps.is_empty())
            .then(|| o.gaps.iter().sum::<Duration>() / o.gaps.len() as u32)
    };
    let met = ok
        .iter()
        .filter(|o| {
            o.ttft.zip(c.ttft).is_none_or(|(got, want)| got <= want)
                && tpot(o).zip(c.itl).is_none_or(|(got, want)| got <= want)
        })
        .count();
    let ttfts: Vec<Duration> = ok.iter().filter_map(|o| o.ttft).collect();
    let gaps: Vec<Duration> = ok.iter().flat_map(|o| o.gaps.iter().copied()).collect();
    let tpots: Vec<Duration> = ok.iter().filter_map(|o| tpot(o)).collect();
    let tp = Percentiles::of(&tpots);
    MixRow {
        class: c.name.clone(),
        sent: outs.len(),
        ok: ok.len(),
        shed,
        expired,
        errors: outs.len() - ok.len() - shed - expired,
        ttft_ms: p3(&ttfts),
        itl_ms: p3(&gaps),
        tpot_ms: [tp.p50_us / 1e3, tp.p99_us / 1e3],
        throughput_rps: ok.len() as f64 / duration,
        output_tokens_per_s: ok.iter().map(|o| o.completion_tokens).sum::<u64>() as f64 / duration,
        goodput_rps: met as f64 / duration,
        attainment: if outs.is_empty() { 0.0 } else { met as f64 / outs.len() as f64 },
        first_error: outs
            .iter()
            .filter(|o| !status(o, "429") && !status(o, "504"))
            .find_map(|o| o.error.clone()),
    }
}

/// Prints the rows as a table.
pub fn print(url: &str, cfg: &MixConfig, rows: &[MixRow]) {
    println!(
        "{url}: {} requests at {:.2}/s (after {} not counted), classes named in \
         x-kvfabric-class: {}",
        cfg.requests,
        cfg.rate,
        cfg.warmup,
        if cfg.class_header { "yes" } else { "no" }
    );
    println!(
        "{:>12} {:>5} {:>5} {:>5} {:>5} {:>5} {:>22} {:>12} {:>8} {:>9} {:>8} {:>7}",
        "class",
        "sent",
        "ok",
        "429",
        "504",
        "err",
        "TTFT ms p50/p90/p99",
        "ITL ms p99",
        "req/s",
        "out tok/s",
        "goodput",
        "met"
    );
    let f = |x: [f64; 3]| format!("{:.0}/{:.0}/{:.0}", x[0], x[1], x[2]);
    for r in rows {
        println!(
            "{:>12} {:>5} {:>5} {:>5} {:>5} {:>5} {:>22} {:>12.1} {:>8.2} {:>9.1} {:>8.2} {:>6.1}%",
            r.class,
            r.sent,
            r.ok,
            r.shed,
            r.expired,
            r.errors,
            f(r.ttft_ms),
            r.itl_ms[2],
            r.throughput_rps,
            r.output_tokens_per_s,
            r.goodput_rps,
            r.attainment * 100.0
        );
    }
    let goodput: f64 = rows.iter().map(|r| r.goodput_rps).sum();
    println!("goodput (requests that met their class's targets): {goodput:.2}/s");
    for r in rows {
        if let Some(e) = &r.first_error {
            println!("{}: {} failed otherwise; the first: {e}", r.class, r.errors);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_specs_parse() {
        let c =
            parse_mix("interactive:share=0.1,prefix=300,prompt=40,output=32,ttft=300ms,itl=50ms")
                .unwrap();
        assert_eq!((c.share, c.prefix, c.prompt, c.output), (0.1, 300, (40, 40), 32));
        assert_eq!(c.itl, Some(Duration::from_millis(50)));
        let b = parse_mix("batch:share=0.9,prompt=2000-8000,output=16,ttft=30s").unwrap();
        assert_eq!(b.prompt, (2000, 8000));
        for bad in [
            "x",
            "x:share=0",
            "x:share=1,prompt=9-3",
            "x:share=1,colour=red",
            "x:share=1,ttft=soon",
        ] {
            assert!(parse_mix(bad).is_err(), "{bad}");
        }
    }
}
