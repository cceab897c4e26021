//! `kvfabric model-dir`: writes a Hugging Face style model directory (`tokenizer.json`,
//! `tokenizer_config.json` with the chat template, `config.json`) from a GGUF's vocabulary
//! and template and a KV shape of your choice, for `kvfabric up --engine mock --model-dir`:
//! a mock with a real tokenizer and the KV bytes of the model that config describes.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvfabric::layout::ModelSpec;
use kvfabric_serving::engine::TextCodec;

use crate::cli::stack::default_model_path;

#[derive(Debug, Args)]
pub struct ModelDirArgs {
    /// The directory to write (created).
    #[arg(long)]
    out: PathBuf,
    /// The GGUF whose vocabulary and chat template to take (default: the fetched
    /// SmolLM2-135M-Instruct).
    #[arg(long)]
    from: Option<PathBuf>,
    /// A tokenizer.json to take instead of the GGUF's vocabulary.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    layers: u32,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    heads: u32,
    /// KV heads.
    #[arg(long, default_value_t = 8)]
    kv_heads: u32,
    /// Head size.
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    /// KV dtype as config.json names it (bfloat16, float16, float32).
    #[arg(long, default_value = "bfloat16")]
    dtype: String,
    /// Context length.
    #[arg(long, default_value_t = 8192)]
    context: u32,
}

pub fn run(args: ModelDirArgs) -> anyhow::Result<()> {
    let gguf = args.from.clone().unwrap_or_else(default_model_path);
    let codec = TextCodec::from_gguf_path(&gguf, args.tokenizer.as_deref())
        .with_context(|| format!("reading the vocabulary of {}", gguf.display()))?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    codec.save_to_dir(&args.out)?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_size": args.heads * args.head_dim,
        "intermediate_size": args.heads * args.head_dim * 4,
        "max_position_embeddings": args.context,
        "vocab_size": codec.vocab_size(),
        "torch_dtype": args.dtype,
    });
    let path = args.out.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)
        .with_context(|| format!("writing {}", path.display()))?;
    // Read back as the mock will.
    let spec = ModelSpec::from_hf_config_path(&path)?;
    TextCodec::from_model_dir(&args.out)?;
    let per_token = spec.block_layout(1)?.bytes_per_block();
    say!(
        "{}: {} tokens of vocabulary, {} layers, {} KV heads of {}, {}: {} B of KV per token",
        args.out.display(),
        codec.vocab_size(),
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.dtype,
        per_token
    );
    Ok(())
}
