//! Capacity planning (`kvfabric plan`): how much KV a model needs, where it fits, how long it
//! takes to move, and how much prefill compute reusing it saves.
//!
//! Pure arithmetic over a [`ModelSpec`]; the command line only parses and prints.

use std::path::Path;

use kvfabric::layout::{BlockLayout, KvDtype, LayoutError, ModelSpec};

/// Bytes in a GB as this planner counts them (decimal, as link and disk vendors do).
pub const GB: f64 = 1e9;

/// Named links, unidirectional theoretical rates in GB/s.
pub const NAMED_LINKS: &[(&str, f64)] = &[
    ("pcie4", 32.0),
    ("pcie5", 64.0),
    ("pcie6", 128.0),
    ("nvlink4", 450.0),
    ("nvlink5", 900.0),
    ("1g", 0.125),
    ("10g", 1.25),
    ("25g", 3.125),
    ("100g", 12.5),
    ("200g", 25.0),
    ("400g", 50.0),
    ("800g", 100.0),
];

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The model could not be resolved.
    #[error(transparent)]
    Model(#[from] LayoutError),
    /// An input that makes no sense.
    #[error("{0}")]
    Invalid(String),
}

/// A link to move KV over.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Link {
    /// Its name (`pcie5`, or what the user typed).
    pub name: String,
    /// GB/s in one direction.
    pub gbps: f64,
}

impl Link {
    /// Parses `pcie5`, `name=12.5` or a bare `12.5` (GB/s).
    pub fn parse(s: &str) -> Result<Link, PlanError> {
        let s = s.trim();
        if let Some(&(name, gbps)) = NAMED_LINKS.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)) {
            return Ok(Link { name: name.to_string(), gbps });
        }
        let (name, rate) = match s.split_once('=') {
            Some((name, rate)) => (name.trim().to_string(), rate),
            None => (format!("{s}GB/s"), s),
        };
        let gbps: f64 = rate.trim().parse().map_err(|_| {
            let known: Vec<&str> = NAMED_LINKS.iter().map(|(n, _)| *n).collect();
            PlanError::Invalid(format!(
                "unknown link {s:?}: use one of {} or NAME=GBPS",
                known.join(", ")
            ))
        })?;
        if !gbps.is_finite() || gbps <= 0.0 {
            return Err(PlanError::Invalid(format!("link {s:?} needs a rate > 0 GB/s")));
        }
        Ok(Link { name, gbps })
    }
}

/// Resolves a model argument: a preset name, else a path to a GGUF file or a `config.json`
/// (or a directory holding one). A preset's name wins over a file of that name in the
/// working directory (which would change what a command means with where it runs); name such
/// a file as a path (`./smollm2-135m`).
pub fn resolve_model(arg: &str) -> Result<ModelSpec, PlanError> {
    let path_like =
        arg.contains(std::path::MAIN_SEPARATOR) || arg.contains('/') || arg.starts_with('.');
    if !path_like {
        if let Ok(spec) = ModelSpec::preset(arg) {
            return Ok(spec);
        }
    }
    let path = Path::new(arg);
    if path.is_dir() {
        return Ok(ModelSpec::from_hf_config_path(path.join("config.json"))?);
    }
    if path.is_file() {
        let mut magic = [0u8; 4];
        let is_gguf = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .map(|()| magic == kvfabric::gguf::GGUF_MAGIC)
            .unwrap_or(false);
        return Ok(if is_gguf {
            ModelSpec::from_gguf_path(path)?
        } else {
            ModelSpec::from_hf_config_path(path)?
        });
    }
    Ok(ModelSpec::preset(arg)?)
}

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The model.
    pub model: ModelSpec,
    /// KV dtype override.
    pub dtype: Option<KvDtype>,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Context lengths, in tokens.
    pub contexts: Vec<u64>,
    /// Concurrent sequences.
    pub concurrency: u64,
    /// KV budget of the GPU tier, GB.
    pub gpu_gb: f64,
    /// KV budget of the host tier, GB.
    pub host_gb: f64,
    /// KV budget of the disk tier, GB.
    pub disk_gb: f64,
    /// Links to time transfers over.
    pub links: Vec<Link>,
    /// Effective prefill compute rate, TFLOP/s.
    pub compute_tflops: f64,
}

/// The plan: one row per context length.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    /// Model name.
    pub model: String,
    /// KV dtype.
    pub dtype: KvDtype,
    /// Layers.
    pub num_layers: u32,
    /// `mha` or `mla`.
    pub attention: &'static str,
    /// KV bytes per token.
    pub kv_bytes_per_token: u64,
    /// KV bytes per block.
    pub kv_bytes_per_block: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Concurrent sequences planned for.
    pub concurrency: u64,
    /// Tier budgets, GB.
    pub gpu_gb: f64,
    /// Host tier budget, GB.
    pub host_gb: f64,
    /// Disk tier budget, GB.
    pub disk_gb: f64,
    /// Compute rate, TFLOP/s.
    pub compute_tflops: f64,
    /// Links.
    pub links: Vec<Link>,
    /// One row per context length.
    pub contexts: Vec<ContextPlan>,
}

/// The plan for one context length.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ContextPlan {
    /// Tokens per sequence.
    pub context_tokens: u64,
    /// Blocks per sequence (the last may be partial; it still takes a slot).
    pub blocks_per_sequence: u64,
    /// KV bytes per sequence, whole blocks.
    pub kv_bytes_per_sequence: u64,
    /// KV bytes of `concurrency` sequences.
    pub kv_bytes_concurrent: u64,
    /// Whole sequences each tier holds.
    pub sequences_gpu: u64,
    /// Whole sequences the host tier holds.
    pub sequences_host: u64,
    /// Whole sequences the disk tier holds.
    pub sequences_disk: u64,
    /// Seconds to move one sequence's KV over each link, in `links` order.
    pub transfer_seconds: Vec<f64>,
    /// FLOPs of prefilling the sequence from scratch (None when parameters are unknown).
    pub prefill_flops: Option<f64>,
    /// Seconds of that prefill at the compute rate: what a cache hit saves.
    pub prefill_seconds: Option<f64>,
}

fn non_negative(name: &str, v: f64) -> Result<f64, PlanError> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(PlanError::Invalid(format!("{name} must be a number >= 0, got {v}")))
    }
}

/// Computes a plan.
pub fn plan(input: &PlanInput) -> Result<Plan, PlanError> {
    let model = match input.dtype {
        Some(d) => input.model.clone().with_dtype(d),
        None => input.model.clone(),
    };
    let layout: BlockLayout = model.block_layout(input.block_tokens)?;
    let (gpu, host, disk) = (
        non_negative("--gpu-gb", input.gpu_gb)?,
        non_negative("--host-gb", input.host_gb)?,
        non_negative("--disk-gb", input.disk_gb)?,
    );
    if !(input.compute_tflops.is_finite() && input.compute_tflops > 0.0) {
        return Err(PlanError::Invalid(format!(
            "--compute-tflops must be > 0, got {}",
            input.compute_tflops
        )));
    }
    if input.contexts.is_empty() || input.contexts.contains(&0) {
        return Err(PlanError::Invalid("context lengths must be at least 1 token".into()));
    }
    if input.concurrency == 0 {
        return Err(PlanError::Invalid("--concurrency must be at least 1".into()));
    }
    let fits = |budget_gb: f64, seq_bytes: u64| (budget_gb * GB / seq_bytes as f64).floor() as u64;
    let contexts = input
        .contexts
        .iter()
        .map(|&ctx| {
            let blocks = layout.blocks_for_tokens(ctx);
            let seq_bytes = blocks.saturating_mul(layout.bytes_per_block());
            let flops = model.prefill_flops(ctx);
            ContextPlan {
                context_tokens: ctx,
                blocks_per_sequence: blocks,
                kv_bytes_per_sequence: seq_bytes,
                kv_bytes_concurrent: seq_bytes.saturating_mul(input.concurrency),
                sequences_gpu: fits(gpu, seq_bytes),
                sequences_host: fits(host, seq_bytes),
                sequences_disk: fits(disk, seq_bytes),
                transfer_seconds: input
                    .links
                    .iter()
                    .map(|l| seq_bytes as f64 / (l.gbps * GB))
                    .collect(),
                prefill_flops: flops,
                prefill_seconds: flops.map(|f| f / (input.compute_tflops * 1e12)),
            }
        })
        .collect();
    Ok(Plan {
        model: model.name.clone(),
        dtype: model.kv.dtype,
        num_layers: model.kv.num_layers,
        attention: match model.kv.attention {
            kvfabric::layout::AttentionKind::Mha { .. } => "mha",
            kvfabric::layout::AttentionKind::Mla { .. } => "mla",
        },
        kv_bytes_per_token: model.kv.bytes_per_token(),
        kv_bytes_per_block: layout.bytes_per_block(),
        block_tokens: input.block_tokens,
        concurrency: input.concurrency,
        gpu_gb: gpu,
        host_gb: host,
        disk_gb: disk,
        compute_tflops: input.compute_tflops,
        links: input.links.clone(),
        contexts,
    })
}

/// Formats a byte count with a binary unit.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// Formats seconds with a unit that keeps 3 significant digits readable.
pub fn human_seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

impl Plan {
    /// The human table `kvfabric plan` prints.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "model {} — {} layers, {}, KV {}",
            self.model, self.num_layers, self.attention, self.dtype
        );
        let _ = writeln!(
            out,
            "KV per token {} ({} B) · per block of {} tokens {} ({} B)",
            human_bytes(self.kv_bytes_per_token),
            self.kv_bytes_per_token,
            self.block_tokens,
            human_bytes(self.kv_bytes_per_block),
            self.kv_bytes_per_block
        );
        let _ = writeln!(
            out,
            "tiers: GPU {} GB, host {} GB, disk {} GB · concurrency {} · compute {} TFLOP/s\n",
            self.gpu_gb, self.host_gb, self.disk_gb, self.concurrency, self.compute_tflops
        );
        let mut header = vec![
            "context".to_string(),
            "blocks".into(),
            "KV/seq".into(),
            format!("KV×{}", self.concurrency),
            "seqs GPU".into(),
            "seqs host".into(),
            "seqs disk".into(),
        ];
        header.extend(self.links.iter().map(|l| format!("move {}", l.name)));
        header.push("prefill".into());
        let mut rows = vec![header];
        for c in &self.contexts {
            let mut row = vec![
                c.context_tokens.to_string(),
                c.blocks_per_sequence.to_string(),
                human_bytes(c.kv_bytes_per_sequence),
                human_bytes(c.kv_bytes_concurrent),
                c.sequences_gpu.to_string(),
                c.sequences_host.to_string(),
                c.sequences_disk.to_string(),
            ];
            row.extend(c.transfer_seconds.iter().map(|&s| human_seconds(s)));
            row.push(c.prefill_seconds.map(human_seconds).unwrap_or_else(|| "n/a".into()));
            rows.push(row);
        }
        let widths: Vec<usize> = (0..rows[0].len())
            .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
            .collect();
        for row in &rows {
            let line: Vec<String> =
                row.iter().zip(&widths).map(|(cell, w)| format!("{cell:>w$}")).collect();
            let _ = writeln!(out, "{}", line.join("  "));
        }
        let _ = writeln!(
            out,
            "\nmove X: time to move one sequence's KV over link X (unidirectional, theoretical \
             rate); prefill: compute a cache hit saves at the given rate."
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(model: &str) -> PlanInput {
        PlanInput {
            model: ModelSpec::preset(model).unwrap(),
            dtype: None,
            block_tokens: 16,
            contexts: vec![4096, 100],
            concurrency: 8,
            gpu_gb: 40.0,
            host_gb: 256.0,
            disk_gb: 2000.0,
            links: vec![Link::parse("pcie5").unwrap(), Link::parse("x=10").unwrap()],
            compute_tflops: 400.0,
        }
    }

    #[test]
    fn llama_8b_numbers_by_hand() {
        let p = plan(&input("llama-3.1-8b")).unwrap();
        assert_eq!(p.kv_bytes_per_token, 131_072);
        assert_eq!(p.kv_bytes_per_block, 2_097_152);
        let c = &p.contexts[0];
        assert_eq!(c.blocks_per_sequence, 256);
        assert_eq!(c.kv_bytes_per_sequence, 536_870_912);
        assert_eq!(c.kv_bytes_concurrent, 8 * 536_870_912);
        assert_eq!(c.sequences_gpu, (40e9 / 536_870_912.0) as u64); // 74
        assert_eq!(c.sequences_gpu, 74);
        assert!((c.transfer_seconds[0] - 536_870_912.0 / 64e9).abs() < 1e-12);
        assert!((c.transfer_seconds[1] - 536_870_912.0 / 10e9).abs() < 1e-12);
        // 100 tokens take 7 blocks, the last partial.
        assert_eq!(p.contexts[1].blocks_per_sequence, 7);
        let flops = 2.0 * 8_030_261_248.0 * 4096.0 + 2.0 * 32.0 * 4096.0 * 4096.0 * 4096.0;
        assert!((c.prefill_flops.unwrap() - flops).abs() / flops < 1e-12);
        assert!((c.prefill_seconds.unwrap() - flops / 400e12).abs() < 1e-12);
    }

    #[test]
    fn dtype_override_halves_bytes() {
        let mut i = input("llama-3.1-8b");
        i.dtype = Some(KvDtype::Fp8);
        assert_eq!(plan(&i).unwrap().kv_bytes_per_token, 65_536);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut i = input("smollm2-135m");
        i.gpu_gb = -1.0;
        assert!(plan(&i).unwrap_err().to_string().contains("--gpu-gb"));
        let mut i = input("smollm2-135m");
        i.block_tokens = 0;
        assert!(plan(&i).is_err());
        let mut i = input("smollm2-135m");
        i.contexts = vec![0];
        assert!(plan(&i).is_err());
        let mut i = input("smollm2-135m");
        i.host_gb = f64::NAN;
        assert!(plan(&i).is_err());
        assert!(Link::parse("warp9").is_err());
        assert!(Link::parse("x=-3").is_err());
        assert!(resolve_model("no-such-model").is_err());
    }

    #[test]
    fn render_has_every_row_and_link() {
        let text = plan(&input("deepseek-r1")).unwrap().render();
        assert!(text.contains("move pcie5") && text.contains("move x"));
        assert!(text.contains("4096") && text.contains("mla"));
    }

    #[test]
    fn a_preset_name_is_the_preset_and_a_path_is_a_file() {
        // The preset is looked up first: a file of that name in the working directory
        // cannot shadow it (by construction; nothing here touches the working directory).
        let preset = ModelSpec::preset("smollm2-135m").unwrap();
        assert_eq!(
            resolve_model("smollm2-135m").unwrap().block_layout(16).unwrap(),
            preset.block_layout(16).unwrap()
        );
        let dir = std::env::temp_dir().join(format!("kvf-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("smollm2-135m");
        std::fs::write(&file, "not a model").unwrap();
        let by_path = resolve_model(file.to_str().unwrap());
        let _ = std::fs::remove_dir_all(&dir);
        assert!(by_path.is_err(), "a path is read as a file: this one is no model");
    }
}
