"""A small llama with random bf16 weights around a tokenizer directory, for a real vLLM on CPU
(no model hub is reachable here). Needs torch and safetensors (vLLM's environment).

    kvfabric model-dir --out TOKDIR          # SmolLM2's tokenizer and chat template
    python scripts/engines/random-llama.py TOKDIR MODELDIR [tiny|smollm2-135m]

`tiny` (the default): 4 layers of 256, fast; `smollm2-135m`: SmolLM2-135M's shape (30 layers
of 576, 9 query and 3 KV heads of 64), so that compute time and KV bytes are a real model's.
"""
import json, sys, shutil, os
import torch
from safetensors.torch import save_file

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(src, f), os.path.join(out, f))
tok = json.load(open(os.path.join(src, "tokenizer.json")))
vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
vocab = (vocab + 63) // 64 * 64
SHAPES = {"tiny": (256, 4, 4, 4, 512), "smollm2-135m": (576, 30, 9, 3, 1536)}
H, L, NH, KV, I = SHAPES[sys.argv[3] if len(sys.argv) > 3 else "tiny"]
cfg = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NH,
    "num_key_value_heads": KV, "head_dim": H // NH, "vocab_size": vocab,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
g = torch.Generator().manual_seed(0)
def r(*s): return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
t = {"model.embed_tokens.weight": r(vocab, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
D = H // NH
for i in range(L):
    p = f"model.layers.{i}."
    t[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    t[p + "self_attn.q_proj.weight"] = r(NH * D, H)
    t[p + "self_attn.k_proj.weight"] = r(KV * D, H)
    t[p + "self_attn.v_proj.weight"] = r(KV * D, H)
    t[p + "self_attn.o_proj.weight"] = r(H, NH * D)
    t[p + "mlp.gate_proj.weight"] = r(I, H)
    t[p + "mlp.up_proj.weight"] = r(I, H)
    t[p + "mlp.down_proj.weight"] = r(H, I)
save_file(t, os.path.join(out, "model.safetensors"))
print("vocab", vocab)
