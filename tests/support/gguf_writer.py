"""A test-side converter: a Hugging Face checkpoint to a GGUF laid out as llama.cpp lays it out.

`write_gguf` covers llama (and Mixtral), qwen2/3 and their MoE variants with any type the gguf package
quantizes to; `convert_like_llama_cpp` imitates convert_hf_to_gguf.py for the later architectures.

It writes Q/K of Llama-architecture models permuted the way llama.cpp's converter does, stacks
routed experts into [E, out, in] tensors, and quantizes with the `gguf` package. It also returns
what each weight becomes after the quantization round trip (in Hugging Face layout), so the
reference model can be given exactly the values the GGUF holds.
"""

from __future__ import annotations

import math
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
    if qtype in kquant_blocks.TYPES + kquant_blocks.IQ_TYPES:     # the gguf package cannot quantize to these
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


# --- llama.cpp's converter for olmoe, deepseek2, glm4moe, gpt-oss, olmo2, phi3, gemma2, gemma3, granitemoe,
# minimax-m2, phimoe, ernie4_5-moe -------------------------------------------------------------------------------
# (convert_hf_to_gguf.py's TextModel.set_gguf_parameters plus each model class, as of llama-cpp-python 0.3.36)

CONVERTED = {"olmoe": gguf.MODEL_ARCH.OLMOE, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
             "glm4moe": gguf.MODEL_ARCH.GLM4_MOE, "gpt-oss": gguf.MODEL_ARCH.GPT_OSS, "olmo2": gguf.MODEL_ARCH.OLMO2,
             "phi3": gguf.MODEL_ARCH.PHI3, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
             "granitemoe": gguf.MODEL_ARCH.GRANITE_MOE, "minimax-m2": gguf.MODEL_ARCH.MINIMAXM2,
             "phimoe": gguf.MODEL_ARCH.PHIMOE, "ernie4_5-moe": gguf.MODEL_ARCH.ERNIE4_5_MOE}
HF_TO_GGUF = {"OlmoeForCausalLM": "olmoe", "DeepseekV2ForCausalLM": "deepseek2", "DeepseekV3ForCausalLM": "deepseek2",
              "Glm4MoeForCausalLM": "glm4moe", "GptOssForCausalLM": "gpt-oss", "Olmo2ForCausalLM": "olmo2",
              "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
              "GraniteMoeForCausalLM": "granitemoe", "MiniMaxM2ForCausalLM": "minimax-m2",
              "PhimoeForCausalLM": "phimoe", "Ernie4_5_MoeForCausalLM": "ernie4_5-moe"}
F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16


def _float_type(gname: str, ndim: int, outtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The converter's choice: vectors, norms, routers and anything not a `.weight` stay F32."""
    if ndim <= 1 or gname.endswith("_norm.weight") or ".ffn_gate_inp." in gname or not gname.endswith(".weight"):
        return F32
    return outtype


def _common_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """TextModel.set_gguf_parameters: the keys every architecture gets from config.json (Phi-3's and
    Gemma 2's classes write their own instead: see _arch_metadata; PhiMoE's is Phi-3's)."""
    if w.arch in ("phi3", "gemma2", "phimoe"):
        return
    w.add_block_count(cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers") or 0) * (w.arch == "glm4moe"))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1 if w.arch == "deepseek2" else cfg["num_key_value_heads"])   # MLA as MQA
    params = cfg["rope_parameters"]
    rope = params.get("full_attention", params)          # Gemma 3 nests them by layer type
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "beta_fast" in rope:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_freq_base(rope["rope_theta"])
    if "sliding_attention" in params:
        w.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5 if w.arch == "olmoe" else cfg["rms_norm_eps"])   # OLMoE's class forces 1e-5
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    if cfg.get("scoring_func") is not None:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg["scoring_func"] == "sigmoid"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.get("head_dim") is not None and w.arch != "deepseek2":   # DeepSeek's class rewrites them below
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])


def _arch_metadata(w: gguf.GGUFWriter, cfg: dict, split_kv_b: bool = True) -> None:
    """What each model class adds in its own set_gguf_parameters."""
    if w.arch == "deepseek2":
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_vocab_size(cfg["vocab_size"])
        if cfg.get("q_lora_rank") is not None:
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        if split_kv_b:     # since llama.cpp's MLA rework: the absorbed (MQA) sizes, the per-head ones as *_mla
            w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
            w.add_value_length(cfg["kv_lora_rank"])
            w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
            w.add_value_length_mla(cfg["v_head_dim"])
        else:              # files from before it: the per-head sizes only
            w.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
            w.add_value_length(cfg["v_head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
        if cfg["rope_parameters"].get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * cfg["rope_parameters"]["mscale_all_dim"])
    elif w.arch == "glm4moe":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"].get("partial_rotary_factor", 0.5)))
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_nextn_predict_layers(cfg.get("num_nextn_predict_layers", 0))
    elif w.arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    elif w.arch in ("phi3", "phimoe"):      # PhiMoeModel: Phi3MiniModel's keys plus the expert counts
        if w.arch == "phimoe":
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_count(cfg["num_local_experts"])
        rope = cfg["rope_parameters"]
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 cfg.get("original_max_position_embeddings")))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)     # 0 for none
    elif w.arch == "gemma2":
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif w.arch == "olmo2" and "sliding_window" in cfg:     # OLMo 3 (Olmo2Model's own keys)
        w.add_sliding_window(cfg["sliding_window"])
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    elif w.arch == "minimax-m2":
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_dimension_count(cfg["rotary_dim"])
    elif w.arch == "granitemoe":      # GraniteModel: the multipliers as *_scale keys
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    elif w.arch == "ernie4_5-moe":    # Ernie4_5MoeModel (its shared length as the converter computes it)
        w.add_expert_count(cfg["moe_num_experts"])
        w.add_expert_used_count(cfg["moe_k"])
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["moe_num_shared_experts"])
        if cfg["moe_num_shared_experts"] > 0:
            w.add_expert_shared_feed_forward_length(cfg["intermediate_size"] // cfg["num_key_value_heads"])
    elif w.arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])


def _hf_pieces(cfg: dict, arch: str, name: str, value: np.ndarray, split_kv_b: bool):
    """The converter's modify_tensors: one HF tensor -> [(HF-side name to map, array)]; expert lists are
    stacked by the caller. Returns [] for tensors it drops."""
    if arch == "deepseek2" and name.endswith("kv_b_proj.weight") and split_kv_b:
        heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        kv_b = value.reshape(heads, nope + v, value.shape[-1])
        return [(name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(0, 2, 1)),   # [H, lora, nope]
                (name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:])]                       # [H, v, lora]
    if arch == "gpt-oss" and ".mlp.experts." in name:
        if name.endswith("gate_up_proj"):                 # [E, hidden, 2I] interleaved, stored [in, out]
            t = value.transpose(0, 2, 1)
            return [(name.replace("gate_up_proj", "gate_proj.weight"), t[:, ::2]),
                    (name.replace("gate_up_proj", "up_proj.weight"), t[:, 1::2])]
        if name.endswith("gate_up_proj_bias"):
            return [(name.replace("gate_up_proj_bias", "gate_proj.bias"), value[..., ::2]),
                    (name.replace("gate_up_proj_bias", "up_proj.bias"), value[..., 1::2])]
        if name.endswith("down_proj"):
            return [(name.replace("down_proj", "down_proj.weight"), value.transpose(0, 2, 1))]
        if name.endswith("down_proj_bias"):
            return [(name.replace("down_proj_bias", "down_proj.bias"), value)]
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return [(name, value + np.float32(1.0))]          # Gemma's (1 + w) norms, stored as w + 1
    if arch == "granitemoe":          # LlamaModel's Q/K permutation; the fused experts split (gguf names)
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            return [(name, permute(value, heads))]
        if name.endswith("block_sparse_moe.input_linear.weight"):
            i = cfg["intermediate_size"]
            return [(f"blk.{layer[1]}.ffn_gate_exps.weight", value[:, :i]),
                    (f"blk.{layer[1]}.ffn_up_exps.weight", value[:, i:])]
    if arch == "gpt-oss" and name.endswith(".sinks"):
        return [(name + ".weight", value)]
    if name.endswith("e_score_correction_bias"):
        return [(name.replace("e_score_correction_bias", "e_score_correction.bias"), value)]
    return [(name, value)]


def _join_pieces(name: str, pieces: list[np.ndarray]) -> np.ndarray:
    """gpt-oss's fused expert tensor back from its (round-tripped) converter pieces: _hf_pieces inverted."""
    if name.endswith("gate_up_proj"):
        gate, up = pieces                                 # [E, I, hidden] each
        t = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
        t[:, ::2], t[:, 1::2] = gate, up
        return t.transpose(0, 2, 1)
    (down,) = pieces
    return down.transpose(0, 2, 1)


def convert_like_llama_cpp(path: Path, cfg: dict, tensors: dict[str, np.ndarray],
                           outtype: gguf.GGMLQuantizationType = F32, split_kv_b: bool = True,
                           expert_type: gguf.GGMLQuantizationType | None = None) -> dict[str, np.ndarray]:
    """Write a HF checkpoint's tensors as convert_hf_to_gguf.py writes an olmoe / deepseek2 / glm4moe / gpt-oss /
    olmo2 / phi3 / gemma2 / gemma3 / granitemoe / minimax-m2 / phimoe / ernie4_5-moe model (`--outtype f32` or
    `f16`); returns the HF tensors as the file holds them (after F16 rounding; Gemma's norms as the checkpoint's w,
    which the reader must restore).

    Names come from gguf's own tensor map (the converter's map_tensor_name); per-expert matrices are stacked
    [E, out, in]; DeepSeek's kv_b_proj is split into k_b (transposed) and v_b unless `split_kv_b` is false
    (files from before llama.cpp's MLA rework: kv_b whole, key/value_length the per-head sizes, no *_mla
    keys); gpt-oss's fused gate_up is de-interleaved and its [in, out] stacks transposed;
    Gemma's norms are stored as w + 1; Phi-3's LongRoPE factors become rope_factors_long/short tensors; Granite's
    Q and K are permuted as Llama's and its fused experts split into gate and up stacks.
    `expert_type` stores the routed experts' weight stacks in that type (gguf's quantizer), as the converter
    stores gpt-oss's published MXFP4 experts (repacked bit for bit, the same block layout).
    """
    arch = HF_TO_GGUF[cfg["architectures"][0]]
    n_blocks = cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers") or 0)   # ERNIE writes null
    name_map = gguf.get_tensor_name_map(CONVERTED[arch], n_blocks)
    w = gguf.GGUFWriter(str(path), arch)
    _common_metadata(w, cfg)
    _arch_metadata(w, cfg, split_kv_b)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == F32 else gguf.LlamaFileType.MOSTLY_F16)

    def rounded(x: np.ndarray, qtype) -> np.ndarray:
        return x.astype(np.float32) if qtype == F32 else x.astype(np.float16).astype(np.float32)

    back: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, str]] = {}
    for name, value in tensors.items():
        if name == "lm_head.weight" and (cfg.get("tie_word_embeddings") or arch == "gemma2"):
            continue                                      # Gemma 2's class drops it always
        if name.endswith("norm.weight") and arch in ("gemma2", "gemma3"):
            (_, stored), = _hf_pieces(cfg, arch, name, value, split_kv_b)
            w.add_tensor(name_map.get_name(name, try_suffixes=(".weight",)), stored.astype(np.float32))
            back[name] = value.astype(np.float32)         # the model undoes the shift: the reference keeps w
            continue
        e = re.fullmatch(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight", name)
        if e:   # per-expert matrices: stacked once a layer's are all seen (the converter's _experts)
            stacks.setdefault(f"{e.group(1)}.{e.group(3)}.weight", {})[int(e.group(2))] = name
            continue
        qtypes, restored = set(), []
        for hf, data in _hf_pieces(cfg, arch, name, value, split_kv_b):
            gname = hf if hf.startswith("blk.") else name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gname is not None, f"gguf's tensor map has no name for {hf}"
            if expert_type is not None and re.search(r"ffn_(gate|up|down)_exps\.weight$", gname):
                raw = gguf.quants.quantize(np.ascontiguousarray(data, np.float32), expert_type)
                w.add_tensor(gname, raw, raw_dtype=expert_type)
                restored.append(gguf.quants.dequantize(raw, expert_type).reshape(data.shape))
                qtypes.add(expert_type)
                continue
            qtype = _float_type(gname, data.ndim, outtype)
            w.add_tensor(gname, np.ascontiguousarray(data.astype(np.float32 if qtype == F32 else np.float16)))
            qtypes.add(qtype)
        # the pieces are parts of the original, rounded elementwise by one type: rounding the original by it
        # gives what the file holds, in the checkpoint's own layout (block types: the pieces joined back)
        (qtype,) = qtypes
        back[name] = _join_pieces(name, restored) if restored else rounded(value, qtype)
    rope = cfg["rope_parameters"]
    if arch in ("phi3", "phimoe") and rope.get("long_factor"):    # Phi3MiniModel.generate_extra_tensors
        orig = rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    for merged, members in stacks.items():
        names = [members[i] for i in range(len(members))]
        data = np.stack([tensors[n] for n in names])
        gname = name_map.get_name(merged, try_suffixes=(".weight",))
        if expert_type is not None:
            raw = gguf.quants.quantize(np.ascontiguousarray(data, np.float32), expert_type)
            w.add_tensor(gname, raw, raw_dtype=expert_type)
            restored = gguf.quants.dequantize(raw, expert_type).reshape(data.shape)
            back |= {n: restored[i] for i, n in enumerate(names)}
            continue
        qtype = _float_type(gname, data.ndim, outtype)
        w.add_tensor(gname, np.ascontiguousarray(data.astype(np.float32 if qtype == F32 else np.float16)))
        for n in names:
            back[n] = rounded(tensors[n], qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return back


# llama.cpp's Q4_K_M mix on a tiny Qwen3-MoE: Q6_K for V, the experts' down stacks and the head, Q4_K elsewhere
Q4_K_M_MIX = {"attn_v": gguf.GGMLQuantizationType.Q6_K, "ffn_down_exps": gguf.GGMLQuantizationType.Q6_K,
              "output.weight": gguf.GGMLQuantizationType.Q6_K, "": gguf.GGMLQuantizationType.Q4_K}


def kquant_moe_gguf(folder: Path, num_experts: int = 8, layers: int = 2) -> Path:
    """A tiny mixed-type (Q4_K and Q6_K) Qwen3-MoE GGUF in `folder`, every matrix's rows whole super-blocks."""
    import json

    from safetensors.numpy import load_file

    from support.reference import build_checkpoint

    hf = build_checkpoint(folder / "hf", "qwen3_moe", hidden_size=256, moe_intermediate_size=256, head_dim=64,
                          num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                          num_experts=num_experts, num_experts_per_tok=2, norm_topk_prob=True)
    cfg = json.loads((hf / "config.json").read_text())
    path = folder / "model.gguf"
    write_gguf(path, "qwen3moe", cfg, load_file(hf / "model.safetensors"), Q4_K_M_MIX)
    return path
