//! The shape of a model's KV cache and the canonical layout of a KV block.
//!
//! Core concepts:
//! - [`KvShape`]: what one token costs in KV memory: layers × (K and V, or one MLA latent)
//!   × width × dtype bytes.
//! - [`BlockLayout`]: a [`KvShape`] cut into blocks of `block_tokens` tokens. The canonical
//!   fabric layout keeps one block in one contiguous byte range, ordered
//!   `[layer][plane][token][width]` where a plane is K or V (MHA/GQA) or the latent (MLA).
//!   [`BlockLayout::plane_range`] addresses one layer's K or V inside a block.
//! - [`ModelSpec`]: a named model with its KV shape and what capacity planning needs besides
//!   (parameters, attention width, context length), from a preset
//!   ([`ModelSpec::preset`]), a Hugging Face `config.json` ([`ModelSpec::from_hf_config`]) or
//!   a GGUF header ([`ModelSpec::from_gguf`]).

use std::ops::Range;
use std::path::Path;

use crate::gguf::{GgufError, GgufHeader, GgufValue};
use crate::units::{BlockTokens, Bytes, Tokens};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (e4m3 or e5m2).
    Fp8,
    /// 8-bit integer.
    Int8,
}

impl KvDtype {
    /// Bytes per element.
    pub const fn bytes(self) -> u64 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Fp8 | KvDtype::Int8 => 1,
        }
    }

    /// The canonical name (`f32`, `f16`, `bf16`, `fp8`, `int8`).
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
            KvDtype::Int8 => "int8",
        }
    }

    /// Parses a dtype name, accepting the spellings of PyTorch and Hugging Face configs.
    pub fn parse(s: &str) -> Result<Self, LayoutError> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => KvDtype::F32,
            "f16" | "fp16" | "float16" | "half" => KvDtype::F16,
            "bf16" | "bfloat16" => KvDtype::Bf16,
            "fp8" | "f8" | "float8" | "fp8_e4m3" | "fp8_e5m2" | "float8_e4m3fn" | "float8_e5m2" => {
                KvDtype::Fp8
            }
            "int8" | "i8" => KvDtype::Int8,
            _ => return Err(LayoutError::UnknownDtype(s.to_string())),
        })
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How attention stores its cache per token and layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum AttentionKind {
    /// Multi-head or grouped-query attention: a K and a V vector per KV head.
    Mha {
        /// KV heads (fewer than query heads under GQA).
        num_kv_heads: u32,
        /// Width of one head.
        head_dim: u32,
    },
    /// Multi-head latent attention (DeepSeek-V2/V3/R1): one compressed latent per token,
    /// `kv_lora_rank + rope_head_dim` wide, shared by K and V.
    Mla {
        /// Width of the compressed KV latent.
        kv_lora_rank: u32,
        /// Width of the decoupled RoPE key.
        rope_head_dim: u32,
    },
}

impl AttentionKind {
    /// Planes per layer: 2 (K and V) for MHA, 1 (the latent) for MLA.
    pub const fn planes(self) -> u64 {
        match self {
            AttentionKind::Mha { .. } => 2,
            AttentionKind::Mla { .. } => 1,
        }
    }

    /// Elements per token in one plane of one layer.
    pub const fn plane_width(self) -> u64 {
        match self {
            AttentionKind::Mha { num_kv_heads, head_dim } => num_kv_heads as u64 * head_dim as u64,
            AttentionKind::Mla { kv_lora_rank, rope_head_dim } => {
                kv_lora_rank as u64 + rope_head_dim as u64
            }
        }
    }
}

/// What one token costs in KV memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvShape {
    /// Layers that keep a KV cache.
    pub num_layers: u32,
    /// MHA/GQA or MLA.
    pub attention: AttentionKind,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvShape {
    /// Checks that every dimension is non-zero.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let zero = match self.attention {
            AttentionKind::Mha { num_kv_heads, head_dim } => num_kv_heads == 0 || head_dim == 0,
            AttentionKind::Mla { kv_lora_rank, .. } => kv_lora_rank == 0,
        };
        if self.num_layers == 0 || zero {
            return Err(LayoutError::InvalidValue {
                field: "kv shape",
                reason: "layers, heads and widths must be non-zero".into(),
            });
        }
        Ok(())
    }

    /// KV bytes of one token across all layers.
    pub const fn bytes_per_token(&self) -> u64 {
        self.num_layers as u64
            * self.attention.planes()
            * self.attention.plane_width()
            * self.dtype.bytes()
    }
}

/// A [`KvShape`] cut into blocks of `block_tokens` tokens, one contiguous byte range each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BlockLayout {
    /// The per-token shape.
    pub kv: KvShape,
    /// Tokens per block.
    pub block_tokens: BlockTokens,
}

impl BlockLayout {
    /// A layout; fails on a zero block size or a degenerate shape.
    pub fn new(kv: KvShape, block_tokens: u32) -> Result<Self, LayoutError> {
        kv.validate()?;
        let Some(block_tokens) = BlockTokens::new(block_tokens) else {
            return Err(LayoutError::InvalidValue {
                field: "block_tokens",
                reason: "must be at least 1".into(),
            });
        };
        Ok(BlockLayout { kv, block_tokens })
    }

    /// Bytes of one block.
    pub const fn bytes_per_block(&self) -> u64 {
        self.block_tokens.block_bytes(Bytes(self.kv.bytes_per_token())).0
    }

    /// Bytes of one plane (one layer's K, V or latent) of one block.
    pub const fn plane_bytes(&self) -> u64 {
        self.block_tokens.as_u64() * self.kv.attention.plane_width() * self.kv.dtype.bytes()
    }

    /// Bytes of one token's row within a plane.
    pub const fn row_bytes(&self) -> u64 {
        self.kv.attention.plane_width() * self.kv.dtype.bytes()
    }

    /// The byte range of `layer`'s plane `plane` (0 = K or latent, 1 = V) inside a block, or
    /// None when out of range.
    pub fn plane_range(&self, layer: u32, plane: u32) -> Option<Range<u64>> {
        if layer >= self.kv.num_layers || u64::from(plane) >= self.kv.attention.planes() {
            return None;
        }
        let index = u64::from(layer) * self.kv.attention.planes() + u64::from(plane);
        let start = index * self.plane_bytes();
        Some(start..start + self.plane_bytes())
    }

    /// Blocks needed to hold `tokens` tokens (the last one possibly partial).
    pub const fn blocks_for_tokens(&self, tokens: u64) -> u64 {
        self.block_tokens.blocks_for(Tokens(tokens)).0
    }
}

/// Why a model's KV shape could not be determined.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// No preset by that name.
    #[error("unknown model preset {name:?} (known: {known})")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The preset names, comma-separated.
        known: String,
    },
    /// A dtype name that is not recognised.
    #[error("unknown KV dtype {0:?} (use f32, f16, bf16, fp8 or int8)")]
    UnknownDtype(String),
    /// A field the shape needs is absent.
    #[error("model config lacks {0}")]
    MissingField(&'static str),
    /// A field holds a value that makes no sense.
    #[error("invalid {field}: {reason}")]
    InvalidValue {
        /// The field.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// The config file is not valid JSON.
    #[error("malformed config.json: {0}")]
    Json(#[from] serde_json::Error),
    /// The file could not be read.
    #[error("reading model config: {0}")]
    Io(#[from] std::io::Error),
    /// The GGUF header could not be read.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A GGUF architecture whose KV cache this reader does not understand.
    #[error("unsupported GGUF architecture {0:?}")]
    UnsupportedArchitecture(String),
}

/// A model as capacity planning and the block store see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelSpec {
    /// A human name (preset name, `_name_or_path`, or `general.name`).
    pub name: String,
    /// The per-token KV shape.
    pub kv: KvShape,
    /// Query heads.
    pub num_attention_heads: u32,
    /// Width of a query head (for attention FLOPs).
    pub head_dim: u32,
    /// Hidden size.
    pub hidden_size: u32,
    /// Parameters, when known (for prefill FLOPs); for MoE models, the active parameters.
    pub active_params: Option<u64>,
    /// The longest context the model was trained for, when known.
    pub context_length: Option<u64>,
}

/// The preset names, in the order `kvfabric plan --help` lists them.
pub const PRESETS: &[&str] = &[
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "mistral-7b",
    "qwen3-8b",
    "qwen3-32b",
    "deepseek-r1",
];

impl ModelSpec {
    /// A built-in model (see [`PRESETS`]); KV in bf16 unless the model ships otherwise.
    pub fn preset(name: &str) -> Result<Self, LayoutError> {
        let mha = |num_kv_heads, head_dim| AttentionKind::Mha { num_kv_heads, head_dim };
        // (layers, attention, query heads, head dim, hidden, active params, context)
        let (layers, attention, heads, head_dim, hidden, params, ctx) = match name {
            "smollm2-135m" => (30, mha(3, 64), 9, 64, 576, 134_515_008u64, 8192u64),
            "llama-3.2-1b" => (16, mha(8, 64), 32, 64, 2048, 1_235_814_400, 131_072),
            "llama-3.1-8b" => (32, mha(8, 128), 32, 128, 4096, 8_030_261_248, 131_072),
            "llama-3.1-70b" => (80, mha(8, 128), 64, 128, 8192, 70_553_706_496, 131_072),
            "llama-3.1-405b" => (126, mha(8, 128), 128, 128, 16384, 405_853_388_800, 131_072),
            "mistral-7b" => (32, mha(8, 128), 32, 128, 4096, 7_241_732_096, 32_768),
            "qwen3-8b" => (36, mha(8, 128), 32, 128, 4096, 8_190_735_360, 40_960),
            "qwen3-32b" => (64, mha(8, 128), 64, 128, 5120, 32_762_123_264, 40_960),
            "deepseek-r1" => (
                61,
                AttentionKind::Mla { kv_lora_rank: 512, rope_head_dim: 64 },
                128,
                192,
                7168,
                37_000_000_000,
                163_840,
            ),
            _ => {
                return Err(LayoutError::UnknownPreset {
                    name: name.to_string(),
                    known: PRESETS.join(", "),
                })
            }
        };
        Ok(ModelSpec {
            name: name.to_string(),
            kv: KvShape { num_layers: layers, attention, dtype: KvDtype::Bf16 },
            num_attention_heads: heads,
            head_dim,
            hidden_size: hidden,
            active_params: Some(params),
            context_length: Some(ctx),
        })
    }

    /// Reads a model from a Hugging Face `config.json` file.
    pub fn from_hf_config_path(path: impl AsRef<Path>) -> Result<Self, LayoutError> {
        let text = std::fs::read_to_string(path)?;
        Self::from_hf_config(&text)
    }

    /// Reads a model from the text of a Hugging Face `config.json`. Multimodal configs with a
    /// `text_config` use it. MLA is recognised by `kv_lora_rank`.
    pub fn from_hf_config(json: &str) -> Result<Self, LayoutError> {
        let root: serde_json::Value = serde_json::from_str(json)?;
        if !root.is_object() {
            return Err(LayoutError::InvalidValue {
                field: "config.json",
                reason: "top level is not an object".into(),
            });
        }
        let cfg = match root.get("text_config") {
            Some(t) if t.is_object() => t,
            _ => &root,
        };
        let u = |key: &'static str| -> Result<Option<u32>, LayoutError> {
            match cfg.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v.as_u64().and_then(|v| u32::try_from(v).ok()).map(Some).ok_or(
                    LayoutError::InvalidValue {
                        field: key,
                        reason: format!("expected a non-negative integer, got {v}"),
                    },
                ),
            }
        };
        let layers =
            u("num_hidden_layers")?.ok_or(LayoutError::MissingField("num_hidden_layers"))?;
        let heads =
            u("num_attention_heads")?.ok_or(LayoutError::MissingField("num_attention_heads"))?;
        let hidden = u("hidden_size")?.ok_or(LayoutError::MissingField("hidden_size"))?;
        if heads == 0 {
            return Err(LayoutError::InvalidValue {
                field: "num_attention_heads",
                reason: "must be non-zero".into(),
            });
        }
        let head_dim = u("head_dim")?.unwrap_or(hidden / heads);
        let dtype = ["torch_dtype", "dtype"]
            .iter()
            .find_map(|k| cfg.get(*k).or(root.get(*k)).and_then(|v| v.as_str()))
            .map(KvDtype::parse)
            .transpose()?
            .unwrap_or(KvDtype::Bf16);
        let (attention, q_head_dim) = match u("kv_lora_rank")? {
            Some(rank) => {
                let rope =
                    u("qk_rope_head_dim")?.ok_or(LayoutError::MissingField("qk_rope_head_dim"))?;
                let nope = u("qk_nope_head_dim")?.unwrap_or(0);
                (AttentionKind::Mla { kv_lora_rank: rank, rope_head_dim: rope }, nope + rope)
            }
            None => {
                let kv_heads = u("num_key_value_heads")?.unwrap_or(heads);
                (AttentionKind::Mha { num_kv_heads: kv_heads, head_dim }, head_dim)
            }
        };
        let kv = KvShape { num_layers: layers, attention, dtype };
        kv.validate()?;
        let name = root
            .get("_name_or_path")
            .and_then(|v| v.as_str())
            .or_else(|| root.get("model_type").and_then(|v| v.as_str()))
            .unwrap_or("config.json")
            .to_string();
        let active_params =
            estimate_dense_params(cfg, layers, hidden, heads, q_head_dim, attention);
        Ok(ModelSpec {
            name,
            kv,
            num_attention_heads: heads,
            head_dim: q_head_dim,
            hidden_size: hidden,
            active_params,
            context_length: u("max_position_embeddings")?.map(u64::from),
        })
    }

    /// Reads a model from a GGUF file's header. The KV dtype is f16, llama.cpp's default
    /// cache type; override it with [`ModelSpec::with_dtype`].
    pub fn from_gguf_path(path: impl AsRef<Path>) -> Result<Self, LayoutError> {
        Self::from_gguf(&GgufHeader::from_path(path)?)
    }

    /// Reads a model from a parsed GGUF header (llama-like architectures and deepseek2).
    pub fn from_gguf(h: &GgufHeader) -> Result<Self, LayoutError> {
        let arch = h.architecture().ok_or(LayoutError::MissingField("general.architecture"))?;
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let u = |suffix: &'static str| -> Result<Option<u32>, LayoutError> {
            match h.get(&key(suffix)) {
                None => Ok(None),
                Some(v) => v.as_u64().and_then(|v| u32::try_from(v).ok()).map(Some).ok_or(
                    LayoutError::InvalidValue {
                        field: suffix,
                        reason: format!("expected an unsigned integer, got {v:?}"),
                    },
                ),
            }
        };
        let layers = u("block_count")?.ok_or(LayoutError::MissingField("block_count"))?;
        let heads =
            u("attention.head_count")?.ok_or(LayoutError::MissingField("attention.head_count"))?;
        let hidden = u("embedding_length")?.ok_or(LayoutError::MissingField("embedding_length"))?;
        if heads == 0 {
            return Err(LayoutError::InvalidValue {
                field: "attention.head_count",
                reason: "must be non-zero".into(),
            });
        }
        let (attention, head_dim) = match arch {
            "deepseek2" => {
                let rank = u("attention.kv_lora_rank")?
                    .ok_or(LayoutError::MissingField("attention.kv_lora_rank"))?;
                let rope = u("rope.dimension_count")?
                    .ok_or(LayoutError::MissingField("rope.dimension_count"))?;
                let key_len = u("attention.key_length")?.unwrap_or(rank + rope);
                (AttentionKind::Mla { kv_lora_rank: rank, rope_head_dim: rope }, key_len)
            }
            "llama" | "mistral" | "qwen2" | "qwen3" | "gemma" | "gemma2" | "phi3" | "granite"
            | "olmo" => {
                let kv_heads = u("attention.head_count_kv")?.unwrap_or(heads);
                let head_dim = u("attention.key_length")?.unwrap_or(hidden / heads);
                (AttentionKind::Mha { num_kv_heads: kv_heads, head_dim }, head_dim)
            }
            other => return Err(LayoutError::UnsupportedArchitecture(other.to_string())),
        };
        let kv = KvShape { num_layers: layers, attention, dtype: KvDtype::F16 };
        kv.validate()?;
        let name = h.get("general.name").and_then(GgufValue::as_str).unwrap_or(arch).to_string();
        let params = h.parameter_count();
        Ok(ModelSpec {
            name,
            kv,
            num_attention_heads: heads,
            head_dim,
            hidden_size: hidden,
            active_params: (params > 0).then_some(params),
            context_length: u("context_length")?.map(u64::from),
        })
    }

    /// The same model with another KV dtype.
    pub fn with_dtype(mut self, dtype: KvDtype) -> Self {
        self.kv.dtype = dtype;
        self
    }

    /// The block layout of this model for `block_tokens` tokens per block.
    pub fn block_layout(&self, block_tokens: u32) -> Result<BlockLayout, LayoutError> {
        BlockLayout::new(self.kv, block_tokens)
    }

    /// FLOPs of a prefill of `tokens` tokens from scratch: `2 × params × tokens` for the
    /// weights plus `2 × layers × heads × head_dim × tokens²` for causal attention (QKᵀ and
    /// AV over half the square each). None when the parameter count is unknown.
    pub fn prefill_flops(&self, tokens: u64) -> Option<f64> {
        let params = self.active_params? as f64;
        let t = tokens as f64;
        let attn_width = f64::from(self.num_attention_heads) * f64::from(self.head_dim);
        Some(2.0 * params * t + 2.0 * f64::from(self.kv.num_layers) * attn_width * t * t)
    }
}

/// Parameters of a dense decoder from its config (embeddings, attention, MLP, norms); None
/// when the MLP width is missing or the model is MoE (active parameters unknowable here).
fn estimate_dense_params(
    cfg: &serde_json::Value,
    layers: u32,
    hidden: u32,
    heads: u32,
    q_head_dim: u32,
    attention: AttentionKind,
) -> Option<u64> {
    if ["n_routed_experts", "num_local_experts", "num_experts"]
        .iter()
        .any(|k| cfg.get(*k).is_some())
    {
        return None;
    }
    let inter = cfg.get("intermediate_size")?.as_u64()?;
    let vocab = cfg.get("vocab_size")?.as_u64()?;
    let tied = cfg.get("tie_word_embeddings").and_then(|v| v.as_bool()).unwrap_or(false);
    let (h, l) = (u64::from(hidden), u64::from(layers));
    let q = u64::from(heads) * u64::from(q_head_dim);
    let kv = match attention {
        AttentionKind::Mha { num_kv_heads, head_dim } => {
            2 * u64::from(num_kv_heads) * u64::from(head_dim)
        }
        AttentionKind::Mla { .. } => return None,
    };
    let attn = h * q + h * kv + q * h;
    let mlp = 3 * h * inter;
    let per_layer = attn + mlp + 2 * h;
    let embed = vocab * h * if tied { 1 } else { 2 };
    Some(l * per_layer + embed + h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_bytes_per_token_by_hand() {
        // layers × 2 × kv_heads × head_dim × 2 bytes (bf16); MLA: layers × (512 + 64) × 2.
        let cases = [
            ("smollm2-135m", 30 * 2 * 3 * 64 * 2),
            ("llama-3.2-1b", 16 * 2 * 8 * 64 * 2),
            ("llama-3.1-8b", 131_072),
            ("llama-3.1-70b", 80 * 2 * 8 * 128 * 2),
            ("llama-3.1-405b", 126 * 2 * 8 * 128 * 2),
            ("mistral-7b", 131_072),
            ("qwen3-8b", 36 * 2 * 8 * 128 * 2),
            ("qwen3-32b", 64 * 2 * 8 * 128 * 2),
            ("deepseek-r1", 61 * 576 * 2),
        ];
        assert_eq!(cases.len(), PRESETS.len());
        for (name, bytes) in cases {
            let m = ModelSpec::preset(name).unwrap();
            assert_eq!(m.kv.bytes_per_token(), bytes, "{name}");
            assert_eq!(m.block_layout(16).unwrap().bytes_per_block(), bytes * 16, "{name}");
        }
        assert_eq!(ModelSpec::preset("llama-3.1-70b").unwrap().kv.bytes_per_token(), 327_680);
        assert_eq!(ModelSpec::preset("deepseek-r1").unwrap().kv.bytes_per_token(), 70_272);
    }

    #[test]
    fn dtypes_scale_bytes() {
        let m = ModelSpec::preset("llama-3.1-8b").unwrap();
        assert_eq!(m.clone().with_dtype(KvDtype::F32).kv.bytes_per_token(), 262_144);
        assert_eq!(m.clone().with_dtype(KvDtype::Fp8).kv.bytes_per_token(), 65_536);
        assert_eq!(m.with_dtype(KvDtype::Int8).kv.bytes_per_token(), 65_536);
        assert_eq!(KvDtype::parse("bfloat16").unwrap(), KvDtype::Bf16);
        assert!(matches!(KvDtype::parse("q4"), Err(LayoutError::UnknownDtype(_))));
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let err = ModelSpec::preset("gpt-5").unwrap_err().to_string();
        assert!(err.contains("gpt-5") && err.contains("llama-3.1-8b"), "{err}");
    }

    #[test]
    fn planes_tile_the_block_exactly() {
        for name in PRESETS {
            let l = ModelSpec::preset(name).unwrap().block_layout(16).unwrap();
            let mut next = 0;
            for layer in 0..l.kv.num_layers {
                for plane in 0..l.kv.attention.planes() as u32 {
                    let r = l.plane_range(layer, plane).unwrap();
                    assert_eq!(r.start, next);
                    assert_eq!(r.end - r.start, l.plane_bytes());
                    assert_eq!(l.plane_bytes(), l.row_bytes() * 16);
                    next = r.end;
                }
            }
            assert_eq!(next, l.bytes_per_block(), "{name}");
            assert!(l.plane_range(l.kv.num_layers, 0).is_none());
            assert!(l.plane_range(0, l.kv.attention.planes() as u32).is_none());
        }
    }

    #[test]
    fn zero_sizes_are_rejected() {
        let m = ModelSpec::preset("smollm2-135m").unwrap();
        assert!(m.block_layout(0).is_err());
        let kv = KvShape { num_layers: 0, ..m.kv };
        assert!(BlockLayout::new(kv, 16).is_err());
        assert_eq!(BlockLayout::new(m.kv, 16).unwrap().blocks_for_tokens(33), 3);
    }

    #[test]
    fn malformed_configs_are_typed_errors() {
        assert!(matches!(ModelSpec::from_hf_config("{"), Err(LayoutError::Json(_))));
        assert!(matches!(ModelSpec::from_hf_config("[]"), Err(LayoutError::InvalidValue { .. })));
        assert!(matches!(
            ModelSpec::from_hf_config(r#"{"num_hidden_layers": 2}"#),
            Err(LayoutError::MissingField("num_attention_heads"))
        ));
        assert!(matches!(
            ModelSpec::from_hf_config(
                r#"{"num_hidden_layers": -2, "num_attention_heads": 4, "hidden_size": 64}"#
            ),
            Err(LayoutError::InvalidValue { field: "num_hidden_layers", .. })
        ));
        assert!(matches!(
            ModelSpec::from_hf_config(
                r#"{"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 64}"#
            ),
            Err(LayoutError::InvalidValue { .. })
        ));
        assert!(matches!(
            ModelSpec::from_hf_config(
                r#"{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "torch_dtype": "q3"}"#
            ),
            Err(LayoutError::UnknownDtype(_))
        ));
    }
}
