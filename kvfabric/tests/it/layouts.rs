//! KV layouts from real model descriptions: Hugging Face `config.json` files as published,
//! and the header of the SmolLM2-135M GGUF that `scripts/fetch-model.sh` caches.

use std::path::PathBuf;

use kvfabric::gguf::GgufHeader;
use kvfabric::layout::{AttentionKind, KvDtype, ModelSpec};

fn data(name: &str) -> PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("tests/data")
    .join(name)
}

/// The default model; `scripts/test.sh` fetches it before running the tests.
fn smollm2_gguf() -> PathBuf {
    let path = std::env::var_os("KVFABRIC_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").expect("HOME is set");
        PathBuf::from(home).join(".cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(path.is_file(), "{} is missing: run scripts/fetch-model.sh", path.display());
    path
}

#[test]
fn llama_3_1_8b_config_matches_the_preset() {
    let m = ModelSpec::from_hf_config_path(data("llama-3.1-8b-instruct.config.json")).unwrap();
    assert_eq!(m.kv.attention, AttentionKind::Mha { num_kv_heads: 8, head_dim: 128 });
    assert_eq!(m.kv.dtype, KvDtype::Bf16);
    assert_eq!(m.kv.bytes_per_token(), 131_072);
    assert_eq!(m.context_length, Some(131_072));
    let preset = ModelSpec::preset("llama-3.1-8b").unwrap();
    assert_eq!(m.kv, preset.kv);
    assert_eq!(m.active_params, preset.active_params, "parameter estimate from the config");
}

#[test]
fn smollm2_config_has_explicit_head_dim_and_tied_embeddings() {
    let m = ModelSpec::from_hf_config_path(data("smollm2-135m-instruct.config.json")).unwrap();
    assert_eq!(m.kv, ModelSpec::preset("smollm2-135m").unwrap().kv);
    assert_eq!(m.kv.bytes_per_token(), 23_040);
    assert_eq!(m.active_params, Some(134_515_008));
}

#[test]
fn deepseek_r1_config_is_mla() {
    let m = ModelSpec::from_hf_config_path(data("deepseek-r1.config.json")).unwrap();
    assert_eq!(m.kv.attention, AttentionKind::Mla { kv_lora_rank: 512, rope_head_dim: 64 });
    assert_eq!(m.kv.num_layers, 61);
    assert_eq!(m.kv.bytes_per_token(), 70_272);
    assert_eq!(m.head_dim, 192);
    assert_eq!(m.active_params, None, "MoE active parameters are not guessed");
    assert_eq!(m.block_layout(64).unwrap().bytes_per_block(), 70_272 * 64);
}

#[test]
fn multimodal_text_config_is_used() {
    let json = r#"{"model_type": "mllama", "text_config": {"num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "torch_dtype": "float16"}}"#;
    let m = ModelSpec::from_hf_config(json).unwrap();
    assert_eq!(m.kv.bytes_per_token(), 40 * 2 * 8 * 128 * 2);
    assert_eq!(m.kv.dtype, KvDtype::F16);
}

#[test]
fn smollm2_gguf_header() {
    let path = smollm2_gguf();
    let h = GgufHeader::from_path(&path).unwrap();
    assert_eq!(h.architecture(), Some("llama"));
    assert_eq!(h.tensors.len(), 272, "30 layers × 9 tensors + embeddings + output norm");
    let m = ModelSpec::from_gguf(&h).unwrap();
    assert_eq!(m.kv.num_layers, 30);
    assert_eq!(m.kv.attention, AttentionKind::Mha { num_kv_heads: 3, head_dim: 64 });
    assert_eq!(m.kv.dtype, KvDtype::F16, "llama.cpp caches KV in f16 by default");
    assert_eq!(m.kv.bytes_per_token(), 23_040);
    assert_eq!(m.num_attention_heads, 9);
    assert_eq!(m.hidden_size, 576);
    assert_eq!(m.context_length, Some(8192));
    // The tensors hold exactly the parameters the config implies (tied embeddings).
    assert_eq!(m.active_params, Some(134_515_008));
    assert_eq!(ModelSpec::from_gguf_path(&path).unwrap(), m);
}

#[test]
fn not_a_gguf_is_a_typed_error() {
    let err = ModelSpec::from_gguf_path(data("deepseek-r1.config.json")).unwrap_err();
    assert!(err.to_string().contains("not a GGUF file"), "{err}");
}
