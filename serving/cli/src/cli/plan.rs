//! `kvfabric plan`.

use anyhow::Context;
use clap::Args;
use kvfabric::layout::KvDtype;
use kvfabric_serving::plan::{plan, resolve_model, Link, PlanInput};

#[derive(Debug, Args)]
#[command(after_help = "Presets: smollm2-135m, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, \
llama-3.1-405b, mistral-7b, qwen3-8b, qwen3-32b, deepseek-r1.\n\
Links (GB/s, one direction): pcie4 32, pcie5 64, pcie6 128, nvlink4 450, nvlink5 900, \
25g 3.125, 100g 12.5, 200g 25, 400g 50, 800g 100; or NAME=GBPS.\n\
Example: kvfabric plan --model llama-3.1-70b --context 8192,131072 --link pcie5,400g")]
pub struct PlanArgs {
    /// A preset name, a Hugging Face config.json (or its directory), or a GGUF file.
    #[arg(long, short, env = "KVFABRIC_MODEL", default_value = "smollm2-135m")]
    model: String,
    /// KV cache dtype, overriding the model's (f32, f16, bf16, fp8, int8).
    #[arg(long)]
    dtype: Option<String>,
    /// Tokens per KV block.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value_t = 16)]
    block_tokens: u32,
    /// Context lengths in tokens, comma-separated (default: 4096, 32768 and the model's
    /// maximum).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    context: Vec<String>,
    /// Concurrent sequences.
    #[arg(long, default_value = "64", allow_negative_numbers = true)]
    concurrency: String,
    /// KV budget of the GPU tier (G1), GB.
    #[arg(long, default_value = "40", allow_negative_numbers = true)]
    gpu_gb: f64,
    /// KV budget of the host tier (G2), GB.
    #[arg(long, default_value = "256", allow_negative_numbers = true)]
    host_gb: f64,
    /// KV budget of the disk tier (G3), GB.
    #[arg(long, default_value = "2000", allow_negative_numbers = true)]
    disk_gb: f64,
    /// Links to time transfers over: names or NAME=GBPS, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "pcie5,nvlink4,100g,400g")]
    link: Vec<String>,
    /// Effective prefill compute rate, TFLOP/s (what one recompute would run at).
    #[arg(long, default_value_t = 400.0, allow_negative_numbers = true)]
    compute_tflops: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_count(what: &str, s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let v: u64 = s
        .parse()
        .with_context(|| format!("{what} must be a whole number of tokens >= 1, got {s:?}"))?;
    anyhow::ensure!(v >= 1, "{what} must be at least 1, got {v}");
    Ok(v)
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let model = resolve_model(&args.model).with_context(|| format!("model {:?}", args.model))?;
    let dtype = args.dtype.as_deref().map(KvDtype::parse).transpose()?;
    let mut contexts = args
        .context
        .iter()
        .map(|c| parse_count("--context", c))
        .collect::<anyhow::Result<Vec<u64>>>()?;
    if contexts.is_empty() {
        contexts = vec![4096, 32768];
        if let Some(max) = model.context_length.filter(|&m| m > 32768) {
            contexts.push(max);
        }
    }
    let links = args.link.iter().map(|l| Link::parse(l)).collect::<Result<Vec<_>, _>>()?;
    let input = PlanInput {
        model,
        dtype,
        block_tokens: args.block_tokens,
        contexts,
        concurrency: parse_count("--concurrency", &args.concurrency)?,
        gpu_gb: args.gpu_gb,
        host_gb: args.host_gb,
        disk_gb: args.disk_gb,
        links,
        compute_tflops: args.compute_tflops,
    };
    let plan = plan(&input)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", plan.render());
    }
    Ok(())
}
