"""A test-side converter: a Hugging Face checkpoint to a GGUF laid out as llama.cpp lays it out.

It writes Q/K of Llama-architecture models permuted the way llama.cpp's converter does, stacks
routed experts into [E, out, in] tensors, and quantizes with the `gguf` package. It also returns
what each weight becomes after the quantization round trip (in Hugging Face layout), so the
reference model can be given exactly the values the GGUF holds.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from support import kquant_blocks

LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

DENSE = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
STACK = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
         "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def llama3_freq_factors(cfg: dict) -> np.ndarray:
    """Default inverse frequencies over transformers' Llama 3 ones: what llama.cpp stores as rope_freqs."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model("llama", **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = cfg["rope_parameters"]["rope_theta"]
    plain = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    return (plain / scaled.numpy()).astype(np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation: per head, rows in (2, half) order become (half, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes or values to store, what reading them back gives as float32)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype in kquant_blocks.TYPES:     # the gguf package cannot quantize to K-quants
        data = kquant_blocks.quantize_k(w, qtype)
        return data, gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape)
    data = gguf.quants.quantize(w.astype(np.float32), qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape)


def write_gguf(path: Path, arch: str, cfg: dict, tensors: dict[str, np.ndarray],
               types: dict[str, gguf.GGMLQuantizationType]) -> dict[str, np.ndarray]:
    """Write `tensors` (HF names) as a GGUF of architecture `arch`; returns the round-tripped HF tensors.

    `types` maps a substring of the GGUF name to a quantization type (first match wins; F32 otherwise);
    1-D tensors always stay F32, as llama.cpp keeps them.
    """
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 512))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    def qtype_of(name: str, ndim: int) -> gguf.GGMLQuantizationType:
        if ndim > 1:
            for key, qtype in types.items():
                if key in name:
                    return qtype
        return gguf.GGMLQuantizationType.F32

    if cfg["rope_parameters"].get("rope_type") == "llama3":
        # llama.cpp writes Llama 3.1 scaling as a tensor of per-frequency divisors
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(cfg))
    back: dict[str, np.ndarray] = {}
    stacks: dict[tuple[int, str], dict[int, str]] = {}
    for name, value in tensors.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            m = LAYER.fullmatch(name)
            e = EXPERT.fullmatch(m.group(2))
            if e:
                stacks.setdefault((int(m.group(1)), STACK[e.group(2)]), {})[int(e.group(1))] = name
                continue
            gname = f"blk.{m.group(1)}.{DENSE[m.group(2)]}"
        stored = value
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            stored = permute(value, heads if "attn_q" in gname else kv_heads)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            stored = value.reshape(-1)
        qtype = qtype_of(gname, stored.ndim)
        data, _ = roundtrip(stored, qtype)
        w.add_tensor(gname, data, raw_dtype=qtype if qtype != gguf.GGMLQuantizationType.F32 else None)
        # quantization works along rows and the permutation moves whole rows, so the reference can
        # round-trip the unpermuted weight itself: it never relies on an inverse permutation
        back[name] = roundtrip(value, qtype)[1].reshape(value.shape)
    for (layer, stack), members in sorted(stacks.items()):
        names = [members[e] for e in range(len(members))]
        stacked = np.stack([tensors[n] for n in names])
        qtype = qtype_of(f"blk.{layer}.{stack}.weight", 2)
        data, restored = roundtrip(stacked, qtype)
        raw = qtype if qtype != gguf.GGMLQuantizationType.F32 else None
        w.add_tensor(f"blk.{layer}.{stack}.weight", data, raw_dtype=raw)
        for e, n in enumerate(names):
            back[n] = restored.reshape(stacked.shape)[e]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return back
