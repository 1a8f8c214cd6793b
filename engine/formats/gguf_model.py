"""GGUF files as models: metadata -> a config.json-style dict, tensors -> Hugging Face names.

Architectures as llama.cpp names them: llama (with or without experts; Mistral too), qwen2, qwen3, qwen2moe,
qwen3moe, olmoe, deepseek2 (DeepSeek-V2/V3, Kimi K2), glm4moe, gpt-oss, olmo2, phi3, gemma2, gemma3, and those of
engine/formats/gguf_families.py (granitemoe, minimax-m2, phimoe,
ernie4_5-moe). What
llama.cpp's converter changes is changed back: Llama's Q/K permutation, Gemma's norms stored as w + 1,
DeepSeek's kv_b_proj split into k_b (transposed) and v_b, experts stacked, GLM's MTP blocks counted as layers.

Weights are dequantized to float32 with the `gguf` package (every type it can dequantize), or, when the model runs
them (`quantized=True`), Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matrices become `QuantizedTensor`s holding the same values:
those block formats are Colibri's 4-, 5- and 8-bit group-32 formats with the bytes rearranged (no rounding), so
decode reads 4.5-8.5 bits per weight instead of 32. Q4_0 and Q8_0 matrices but the output head take the rows16
layout (engine/kernels/rows16.py), whose products round activations to 8 bits per 32-block, as llama.cpp's products
of these types do. Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS matrices become `KQuantTensor`s over the file's own
bytes, run by their own kernels (engine/kernels/kquant.py, iquant.py), each tensor in its own type; Q4_K, Q5_K,
Q6_K and IQ4_XS ones but the head and the embedding are reordered once into their rows16 layout
(engine/kernels/krows16.py; a copy, the file's pages given back) and run on integer kernels the same way. An expert stack's experts are row
ranges of the stack (views of it), so a K-quant MoE takes about its file's size.
llama.cpp stores the Q and K projections of Llama-architecture models permuted for its interleaved RoPE;
that permutation is undone here so the shared blocks see Hugging Face layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

import gguf
import numpy as np

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.formats import gguf_families
from engine.formats.gguf_meta import gguf_metadata, open_gguf, release_tensor_pages
from engine.formats.page_release import np_map, release_range
from engine.kernels.krows16 import allowed as krows16_allowed
from engine.kernels.layout import BLOCK, rows16_allowed
from engine.quant.kquant import KINDS as _KQUANTS
from engine.quant.kquant import KQuantTensor
from engine.quant.tensor import QuantizedTensor

# GGUF architecture -> (Hugging Face architecture, its MoE variant when the file has experts)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "MixtralForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", None),
    "qwen3": ("Qwen3ForCausalLM", None),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeForCausalLM", "OlmoeForCausalLM"),
    # DeepSeek-V2/V3, Kimi K2: V3 when its router is sigmoid-scored (see _deepseek2_config)
    "deepseek2": ("DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM"),
    "glm4moe": ("Glm4MoeForCausalLM", "Glm4MoeForCausalLM"),
    "gpt-oss": ("GptOssForCausalLM", "GptOssForCausalLM"),
    # dense families (llama.cpp writes Mistral's checkpoints as "llama", with the Q/K permutation)
    "olmo2": ("Olmo2ForCausalLM", None),
    "phi3": ("Phi3ForCausalLM", None),
    "gemma2": ("Gemma2ForCausalLM", None),
    "gemma3": ("Gemma3ForCausalLM", None),
    **gguf_families.ARCHITECTURES,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# llama.cpp's converter permutes Q and K of these for its interleaved RoPE (undone in GGUFModel.load)
_PERMUTED_QK = ("llama", *gguf_families.PERMUTED_QK)
# Gemma's RMSNorms scale by (1 + w); llama.cpp's converter stores w + 1 (see GGUFModel.load)
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp's Phi-3 long-context RoPE: per-frequency factors as tensors
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_ROPE_FACTOR_ARCHS = ("phi3", *gguf_families.ROPE_FACTOR_TENSORS)
# per-architecture names where llama.cpp's tensor map differs from (or adds to) the table above
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "deepseek2": {
        "attn_q.weight": "self_attn.q_proj.weight",            # no query low-rank (V2-Lite)
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",      # older files; newer ones split it (see _KV_B)
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
    "glm4moe": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
    "olmo2": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": {   # Phi-3 keeps q/k/v and gate/up fused, in its checkpoints as in llama.cpp's
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    "gemma2": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "gemma3": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "gpt-oss": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.bias": "mlp.gate.bias",
    },
    **gguf_families.LAYER_NAMES,
}
_EXPERT_STACKS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
# gpt-oss's experts carry biases, stacked [E, out] as their weights are
_EXPERT_BIAS_STACKS = {"ffn_gate_exps.bias": 0, "ffn_up_exps.bias": 1, "ffn_down_exps.bias": 2}
# newer llama.cpp files split DeepSeek's kv_b_proj per head into k_b (stored transposed, [H, kv_lora, nope])
# and v_b ([H, v, kv_lora]) for its absorbed attention; kv_b_proj is rebuilt from the two
_KV_B = ("attn_k_b.weight", "attn_v_b.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_config(meta: dict[str, Any], n_output: bool, path: str, tensors: Iterable[str] = ()) -> dict[str, Any]:
    """A config.json-style dict for the model a GGUF file describes (its values are checked as a config's are).

    `tensors` (the file's tensor names) settles what the metadata leaves to the weights: whether a GLM layer
    has q/k norms or biases, whether a DeepSeek router has a correction bias.
    """
    try:
        cfg = _gguf_config(meta, n_output, path)
        arch = meta.get("general.architecture")
        if arch in _ARCH_CONFIG:
            _ARCH_CONFIG[arch](cfg, _getter(meta, arch, path), frozenset(tensors))
        return cfg
    except (TypeError, ValueError, OverflowError) as exc:   # a value of the wrong type: a list where a count goes
        raise ModelFormatError(f"{path}: GGUF metadata is malformed ({exc}); download the file again") from None


def _gguf_config(meta: dict[str, Any], n_output: bool, path: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch in gguf_families.FOLDER_ONLY:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} ({gguf_families.FOLDER_ONLY[arch]}) is not read from GGUF files yet; "
            "run the model from its Hugging Face folder (config.json and safetensors) instead")
    if arch not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHITECTURES))}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"{path}: metadata {arch}.{key} is missing; the GGUF file is incomplete")
        return value

    dense_name, moe_name = _ARCHITECTURES[arch]
    n_experts = int(meta.get(f"{arch}.expert_count") or 0)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    if heads < 1:   # the head size below divides by it; the config's own checks come after
        raise ModelFormatError(f"{path}: metadata {arch}.attention.head_count is {heads}, expected at least 1; "
                               "the GGUF file is damaged: download it again")
    cfg: dict[str, Any] = {
        "architectures": [moe_name if n_experts and moe_name else dense_name],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        "tie_word_embeddings": not n_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_parameters"].update(
            rope_type=scaling,
            factor=float(get("rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length", cfg["max_position_embeddings"])),
        )
    if n_experts:
        cfg |= {
            "num_experts": n_experts,
            "num_local_experts": n_experts,
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length", cfg["intermediate_size"])),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": arch != "qwen2moe",
        }
        if arch == "llama":
            cfg["intermediate_size"] = int(get("expert_feed_forward_length", cfg["intermediate_size"]))
    return cfg


def _getter(meta: dict[str, Any], arch: str, path: str):
    """get(key, default): the architecture's metadata value; no default and no value is a clear error."""
    missing = object()

    def get(key: str, default: Any = missing) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is missing:
                raise ModelFormatError(f"{path}: metadata {arch}.{key} is missing; the GGUF file is incomplete")
            return default
        return value
    get.path = path    # type: ignore[attr-defined]   # for the errors an architecture's reader raises
    return get


def _moe_common(cfg: dict[str, Any], get) -> None:
    """DeepSeek-style MoE keys (shared experts, leading dense layers, routed scaling, expert groups)."""
    n_experts = int(get("expert_count"))
    cfg |= {
        "n_routed_experts": n_experts,
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": int(get("expert_group_count", 1)),
        "topk_group": int(get("expert_group_used_count", 1)),
        "num_nextn_predict_layers": 0,
    }


def _olmoe_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    # llama.cpp's OLMoE graph never renormalises the chosen experts' weights (nor does OLMoE's config)
    cfg["norm_topk_prob"] = False


def _deepseek2_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    # gating 2 is sigmoid (V3, R1, Kimi K2); files without the key predate V3 and score by softmax (V2)
    sigmoid = int(get("expert_gating_func", 1)) == 2 or any(t.endswith(".exp_probs_b.bias") for t in tensors)
    heads, rope_dim = cfg["num_attention_heads"], int(get("rope.dimension_count"))
    # the MLA sizes: newer files keep key/value_length for the absorbed (MQA) view and add *_mla
    qk = int(get("attention.key_length_mla", get("attention.key_length")))
    q_lora = get("attention.q_lora_rank", None)
    cfg |= {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": heads,       # llama.cpp writes 1 (its MQA view of MLA); every head has its own
        "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "q_lora_rank": int(q_lora) if q_lora else None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk - rope_dim,
        "v_head_dim": int(get("attention.value_length_mla", get("attention.value_length"))),
        "head_dim": rope_dim,
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "rope_interleave": True,
    }
    _moe_common(cfg, get)
    if sigmoid:
        cfg["topk_method"] = "noaux_tc"
    else:
        cfg["topk_method"] = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
    rope = cfg["rope_parameters"]
    if rope["rope_type"] == "yarn":
        rope |= {"beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                 "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
        log_mul = get("rope.scaling.yarn_log_multiplier", None)
        if log_mul:   # llama.cpp stores 0.1 * mscale_all_dim; DeepSeek's configs give mscale the same value
            rope |= {"mscale_all_dim": float(log_mul) / 0.1, "mscale": float(log_mul) / 0.1}


def _glm4moe_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    # the file's blocks include the MTP layers at the end; they are not decoder layers
    nextn = int(get("nextn_predict_layers", 0))
    cfg["num_hidden_layers"] -= nextn
    cfg["partial_rotary_factor"] = int(get("rope.dimension_count", cfg["head_dim"])) / cfg["head_dim"]
    cfg["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    _moe_common(cfg, get)


def _gpt_oss_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    cfg |= {
        "num_local_experts": int(get("expert_count")),
        "intermediate_size": int(get("expert_feed_forward_length")),
        "sliding_window": int(get("attention.sliding_window")),
        "attention_bias": True,
    }
    cfg.pop("num_experts", None)
    cfg.pop("moe_intermediate_size", None)
    cfg["layer_types"] = swa_layer_types(get, cfg["num_hidden_layers"], 2)   # even layers slide, as llama.cpp's
    rope = cfg["rope_parameters"]
    if rope["rope_type"] == "yarn":
        # llama.cpp's YaRN does not truncate its correction range, as gpt-oss's own config says
        rope |= {"beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                 "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}


def _olmo2_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    # llama.cpp writes OLMo 3 as olmo2 plus a sliding window: running it without the window would be wrong
    if get("attention.sliding_window", None):
        raise UnsupportedArchitectureError(
            f"{get.path}: this olmo2 GGUF has a sliding window (an OLMo 3 model), which Colibri does not run yet; "
            "use an OLMo 2 model")


def _phi3_config(cfg: dict[str, Any], get, tensors: frozenset[str]) -> None:
    window = int(get("attention.sliding_window", 0))
    rope = cfg["rope_parameters"]
    rope["partial_rotary_factor"] = int(get("rope.dimension_count", cfg["head_dim"])) / cfg["head_dim"]
    orig = int(get("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    cfg |= {"sliding_window": window or None, "original_max_position_embeddings": orig}   # 0: none (Phi-3)
    if _ROPE_FACTORS[0] in tensors:     # the factors themselves are read with the tensors (GGUFModel)
        rope |= {"rope_type": "longrope", "original_max_position_embeddings": orig}
        attn = get("rope.scaling.attn_factor", None)
        if attn is not None:
            rope["attention_factor"] = float(attn)


def swa_layer_types(get, n: int, default_pattern: int) -> list[str]:
    """Each layer's type as llama.cpp reads it: `attention.sliding_window_pattern` as one flag a layer, or as
    n (every n-th layer global; 0: none), else the architecture's own n."""
    pattern = get("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} flags for {n} layers")
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]
    p = int(pattern)
    return ["sliding_attention" if p == 0 or i % p < p - 1 else "full_attention" for i in range(n)]


def _gemma_config(cfg: dict[str, Any], get, tensors: frozenset[str], gemma3: bool) -> None:
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    # llama.cpp scales queries by 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models (Gemma 2's 46
    # layers, Gemma 3's 62), as their configs' query_pre_attn_scalar do; GGUF has no key for it
    scalar = hidden // heads if n == (62 if gemma3 else 46) else cfg["head_dim"]
    window = int(get("attention.sliding_window", 0 if gemma3 else 4096))   # llama.cpp's defaults when absent
    cfg |= {"query_pre_attn_scalar": scalar, "sliding_window": window or None, "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": swa_layer_types(get, n, 6 if gemma3 else 2) if window else ["full_attention"] * n}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = get(key, None)     # absent: the family's default (llama.cpp's too: Gemma 2 caps at 50 and 30)
        if value is not None and (not gemma3 or key == "final_logit_softcapping"):
            cfg[key] = float(value)
    if gemma3:
        # global layers: the file's base and scaling; local layers: their own base (10000 unless the file says)
        full = dict(cfg["rope_parameters"])
        full["rope_theta"] = float(get("rope.freq_base", 1_000_000.0))
        local = float(get("rope.freq_base_swa", 10000.0))
        cfg |= {"rope_theta": full["rope_theta"], "rope_local_base_freq": local,
                "rope_parameters": {"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local}}}


# architecture -> what it adds to the config (metadata getter, tensor names)
_ARCH_CONFIG = {"olmoe": _olmoe_config, "deepseek2": _deepseek2_config, "glm4moe": _glm4moe_config,
                "gpt-oss": _gpt_oss_config, "olmo2": _olmo2_config, "phi3": _phi3_config,
                "gemma2": lambda cfg, get, tensors: _gemma_config(cfg, get, tensors, gemma3=False),
                "gemma3": lambda cfg, get, tensors: _gemma_config(cfg, get, tensors, gemma3=True),
                **gguf_families.ARCH_CONFIG}


def _extra_layers(arch: str, cfg: dict[str, Any], layer: int) -> bool:
    """Whether block `layer` is beyond the decoder layers (GLM's MTP layers): read by nothing, not an error."""
    return arch == "glm4moe" and layer >= cfg["num_hidden_layers"]


def kv_b_from_split(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's kv_b_proj [H * (nope + v), kv_lora] from llama.cpp's k_b [H, kv_lora, nope] and v_b [H, v, kv_lora]."""
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


_Q = gguf.GGMLQuantizationType
# block formats that are Colibri formats: type -> (bits, asymmetric, bytes of d [, m], bytes of the high-bit word)
_NATIVE = {_Q.Q4_0: (4, False, 0), _Q.Q4_1: (4, True, 0), _Q.Q5_0: (5, False, 4), _Q.Q5_1: (5, True, 4),
           _Q.Q8_0: (8, False, 0)}


def native_blocks(raw: np.ndarray, qtype: "gguf.GGMLQuantizationType", rows: int, cols: int) -> QuantizedTensor:
    """GGUF blocks of a [rows, cols] matrix (raw bytes) as a QuantizedTensor of the same values.

    ggml's block is d (fp16) [, m (fp16)] [, qh (uint32: bit j = high bit of weight j)], then the codes:
    16 bytes of nibbles (byte j: weight j low, weight 16 + j high; Colibri's nibble plane) or 32
    signed bytes. Q4_0 and Q5_0 store u with w = d * (u - 2**(bits-1)): Colibri's symmetric format;
    Q8_0 stores signed q = u - 128; Q4_1 and Q5_1 store w = d * u + m: the asymmetric format.
    """
    bits, asym, high = _NATIVE[qtype]
    nb = cols // BLOCK
    blocks = np.asarray(raw, np.uint8).reshape(rows, nb, -1)                      # [rows, nb, block bytes]
    head = 4 if asym else 2
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.uint16).reshape(rows, nb)
    mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16).reshape(rows, nb) if asym \
        else np.zeros((rows, 0), np.uint16)
    codes = blocks[..., head + high:]
    if bits == 8:
        a = (codes ^ np.uint8(0x80)).reshape(rows, nb * 32)                      # signed q -> u = q + 128
    else:
        a = np.ascontiguousarray(codes).reshape(rows, nb * 16)
    b = np.ascontiguousarray(blocks[..., head:head + high]).reshape(rows, nb * high) if high \
        else np.zeros((rows, 0), np.uint8)
    return QuantizedTensor((rows, cols), bits, BLOCK, asym, np.ascontiguousarray(a), b, scales, mins)


def kquant_blocks(raw: np.ndarray, qtype: "gguf.GGMLQuantizationType", rows: int, cols: int,
                  where: str) -> KQuantTensor:
    """GGUF K-quant super-blocks of a [rows, cols] matrix (raw bytes) as a KQuantTensor over the same bytes (no copy)."""
    try:
        return KQuantTensor((rows, cols), qtype, np.asarray(raw, np.uint8).reshape(rows, -1))
    except ValueError as exc:
        raise ModelFormatError(f"{where}: {exc}; the GGUF file is damaged: download it again") from None


def _rows(q: QuantizedTensor | KQuantTensor, rows) -> QuantizedTensor | KQuantTensor:
    """Some rows of a quantized matrix (a slice gives views, an index array copies). A rows16 matrix is cut only
    by slices along whole row blocks (an expert of a stack)."""
    if isinstance(q, KQuantTensor):
        return q.take_rows(rows)
    n = q.a[rows].shape[0]
    return QuantizedTensor((n, q.shape[1]), q.bits, q.group, q.asymmetric, np.ascontiguousarray(q.a[rows]),
                           np.ascontiguousarray(q.b[rows]), np.ascontiguousarray(q.scales[rows]),
                           np.ascontiguousarray(q.mins[rows]), q.layout)


# the output head (or the embedding tied to it) keeps float activations: its logits pick the greedy token, and
# rounding its input to 8 bits moves them by about a tenth, enough to flip a near tie the float model decides
_FLOAT_PRODUCTS = frozenset({"lm_head.weight", "model.embed_tokens.weight"})


def _fast(q: QuantizedTensor | KQuantTensor, rows: int) -> QuantizedTensor | KQuantTensor:
    """Q4_0, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS in their rows16 layout when its row blocks of 16 fit `rows` (a
    matrix's, or each expert's of a stack): the integer kernels, which round activations to 8 bits per 32-block as
    llama.cpp's own products of these types do. The dequantized values stay the file's."""
    if isinstance(q, KQuantTensor):
        return q.with_layout("rows16") if krows16_allowed(_KQUANTS[q.qtype], rows) else q
    return q.with_layout("rows16") if rows16_allowed(q.bits, q.asymmetric, rows) else q


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, (pairs, 2) rows back to (2, half) order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModel:
    """A GGUF file's metadata, config and tensors (by Hugging Face name, as float32).

    With `quantized`, matrices stored in a block format Colibri runs as is (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0) load as QuantizedTensors of the same values, and K-quant (Q2_K .. Q6_K) and IQ4 (IQ4_NL, IQ4_XS) ones
    (each expert of a stack too) as KQuantTensors over the file's bytes; routers and vectors stay float32.
    """

    def __init__(self, path: str | Path, quantized: bool = False):
        self.path = str(path)
        self.quantized = quantized
        self.reader = open_gguf(path)
        self.meta = gguf_metadata(self.reader)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._cache: dict[str, np.ndarray | QuantizedTensor] = {}
        self._stack_left: dict[str, set[int]] = {}   # GGUF expert stack -> experts not yet dropped (drop_pages)
        self.config = gguf_config(self.meta, "output.weight" in self._tensors, self.path, self._tensors)
        if not self.config["vocab_size"] and "token_embd.weight" in self._tensors:   # no tokenizer: the table says
            self.config["vocab_size"] = int(self._tensors["token_embd.weight"].shape[-1])
        if "rope_freqs.weight" in self._tensors:  # Llama 3.1 scaling, written as per-frequency factors
            factors = self._dequantized("rope_freqs.weight", keep=False).reshape(-1)
            self.config["rope_parameters"]["freq_factors"] = [float(f) for f in factors]
        if _ROPE_FACTORS[0] in self._tensors and self.config["rope_parameters"].get("rope_type") == "longrope":
            for gname, key in zip(_ROPE_FACTORS, ("long_factor", "short_factor")):
                if gname not in self._tensors:
                    raise ModelFormatError(f"{self.path}: {_ROPE_FACTORS[0]} without {_ROPE_FACTORS[1]}; "
                                           "the GGUF file is incomplete: convert or download it again")
                factors = self._dequantized(gname, keep=False).reshape(-1)
                self.config["rope_parameters"][key] = [float(f) for f in factors]
        self._arch = self.meta["general.architecture"]
        moe_prefix = "block_sparse_moe" if self.config["architectures"][0] == "MixtralForCausalLM" else "mlp"
        proj: tuple[str, ...] = ("w1", "w3", "w2") if moe_prefix == "block_sparse_moe" else \
            ("gate_proj", "up_proj", "down_proj")
        if self._arch in gguf_families.MOE_NAMES:
            moe_prefix, *names = gguf_families.MOE_NAMES[self._arch]
            proj = tuple(names)
        # HF name -> (GGUF tensor name, expert index or None)
        self._names: dict[str, tuple[str, int | None]] = {}
        # HF name -> the GGUF tensors it is rebuilt from (DeepSeek's kv_b_proj from k_b and v_b)
        self._derived: dict[str, tuple[str, str]] = {}
        self.unmapped: list[str] = []    # GGUF tensors with no Hugging Face name: no model reads them
        layer_names = _LAYER_NAMES | _ARCH_LAYER_NAMES.get(self._arch, {})
        global_names = _GLOBAL_NAMES | gguf_families.GLOBAL_NAMES.get(self._arch, {})
        for name, t in self._tensors.items():
            if name in global_names:
                self._names[global_names[name]] = (name, None)
                continue
            m = _BLOCK.fullmatch(name)
            if not m:
                read_above = name == "rope_freqs.weight" or (name in _ROPE_FACTORS and self._arch in _ROPE_FACTOR_ARCHS)
                if not read_above:              # (the RoPE factors went into the config above)
                    self.unmapped.append(name)
                continue
            layer, rest = f"model.layers.{m.group(1)}", m.group(2)
            if _extra_layers(self._arch, self.config, int(m.group(1))):
                continue
            if rest in layer_names:
                self._names[f"{layer}.{layer_names[rest]}"] = (name, None)
            elif rest == _KV_B[0] and self._arch == "deepseek2":
                self._derived[f"{layer}.self_attn.kv_b_proj.weight"] = (name, name.replace(*_KV_B))
            elif rest == _KV_B[1] and self._arch == "deepseek2":
                continue                  # read with its k_b
            elif rest in _EXPERT_BIAS_STACKS:
                for e in range(int(t.shape[-1])):   # ggml order: [out, experts]
                    self._names[f"{layer}.{moe_prefix}.experts.{e}.{proj[_EXPERT_BIAS_STACKS[rest]]}.bias"] = (name, e)
            elif rest == "ffn_gate_inp.weight":
                self._names[f"{layer}.{moe_prefix}.gate.weight"] = (name, None)
            elif rest in _EXPERT_STACKS:
                n_experts = int(t.shape[-1])  # ggml order: [in, out, experts]
                for e in range(n_experts):
                    self._names[f"{layer}.{moe_prefix}.experts.{e}.{proj[_EXPERT_STACKS[rest]]}.weight"] = (name, e)
            else:
                self.unmapped.append(name)

    def names(self) -> Iterable[str]:
        """Every tensor, by Hugging Face name."""
        return [*self._names, *self._derived]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in Hugging Face (row-major [out, in]) order."""
        if name in self._derived:
            k_b, v_b = (self._tensors[g].shape for g in self._derived[name])   # ggml order, reversed below
            return (int(k_b[2]) * (int(k_b[0]) + int(v_b[1])), int(k_b[1]))
        gname, expert = self._names[name]
        shape = tuple(int(d) for d in reversed(self._tensors[gname].shape))
        if self._row_vector(name) and len(shape) == 1:
            shape = (1, shape[0])
        return shape[1:] if expert is not None else shape

    def _row_vector(self, name: str) -> bool:
        """Whether the checkpoint holds this vector as [1, n] (the file may hold [n])."""
        return name.endswith(("shared_expert_gate.weight", *gguf_families.ROW_VECTORS.get(self._arch, ())))

    def location(self, name: str) -> str:
        """The file (and GGUF tensor) holding a tensor."""
        gname = self._derived[name][0] if name in self._derived else self._names.get(name, (name, None))[0]
        return f"{self.path} ({gname})"

    def _dequantized(self, gname: str, keep: bool) -> np.ndarray:
        """The GGUF tensor as float32; expert stacks are kept so each expert is a view of one array."""
        if gname not in self._cache:
            t = self._tensors[gname]
            try:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelFormatError(
                    f"{self.path}: tensor {gname} is {t.tensor_type.name}, which the gguf package cannot dequantize; "
                    "use a GGUF with another quantization (Q4_0, Q4_K_M, Q8_0, F16 ...)"
                ) from None
            data = np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
            if t.tensor_type != gguf.GGMLQuantizationType.F32:   # a copy: the stored bytes leave this process's RSS
                release_range(np_map(self.reader.data), None, int(t.data_offset), int(t.n_bytes))
            if not keep:
                return data
            self._cache[gname] = data
        return self._cache[gname]

    def _native(self, name: str, gname: str) -> bool:
        """Whether `name` loads as a QuantizedTensor or KQuantTensor: a matrix a model multiplies by, in a block format
        the kernels run (an expert of a stack as well: the expert kernels run both)."""
        t = self._tensors[gname]
        native = t.tensor_type in _NATIVE or t.tensor_type in _KQUANTS
        return (self.quantized and native and len(t.shape) >= 2
                and not name.endswith((".gate.weight", "shared_expert_gate.weight")))   # routers stay float32

    def _quantized(self, gname: str, keep: bool) -> QuantizedTensor | KQuantTensor:
        """The GGUF tensor as one QuantizedTensor [rows, in] (an expert stack's rows laid end to end; a copy, so the
        file's pages under it are given back), or a KQuantTensor over the file's own bytes (a view of the memory map)."""
        if gname not in self._cache:
            t = self._tensors[gname]
            shape = [int(d) for d in t.shape]                                    # ggml order: [in, out, ...]
            rows = int(np.prod(shape[1:]))
            if t.tensor_type in _KQUANTS:
                q = kquant_blocks(t.data, t.tensor_type, rows, shape[0], f"{self.path} ({gname})")
                fast = _fast(q, shape[1]) if len(shape) > 2 else q
                if fast is not q:             # a reordered copy: the file's pages under it are given back
                    q = fast
                    release_range(np_map(self.reader.data), None, int(t.data_offset), int(t.n_bytes))
            else:
                q = native_blocks(t.data, t.tensor_type, rows, shape[0])    # a copy: its stored bytes leave the RSS
                release_range(np_map(self.reader.data), None, int(t.data_offset), int(t.n_bytes))
                if len(shape) > 2:            # an expert stack: each expert's rows are whole row blocks, or none is
                    q = _fast(q, shape[1])
            if not keep:
                return q
            self._cache[gname] = q
        return self._cache[gname]

    def load(self, name: str) -> np.ndarray | QuantizedTensor | KQuantTensor:
        """A tensor in Hugging Face layout: float32, dequantized, or (see `quantized`) a QuantizedTensor or a
        KQuantTensor.

        DeepSeek's kv_b_proj, when the file splits it into k_b and v_b, is rebuilt in float32 (k_b is stored
        transposed, so its blocks run along the other axis).
        """
        if name in self._derived:
            k_b, v_b = (self._dequantized(g, keep=False) for g in self._derived[name])
            return kv_b_from_split(k_b, v_b)
        gname, expert = self._names[name]
        if self._native(name, gname):
            q = self._quantized(gname, keep=expert is not None)
            if expert is not None:
                rows = self.shape(name)[0]
                return _rows(q, slice(expert * rows, (expert + 1) * rows))
            if self._arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
                heads = self.config["num_attention_heads"] if ".q_proj." in name else self.config["num_key_value_heads"]
                q = _rows(q, unpermute_qk(np.arange(q.shape[0]), heads))
            if name in _FLOAT_PRODUCTS:
                return q
            fast = _fast(q, q.shape[0])
            if fast is not q and isinstance(q, KQuantTensor):   # a reordered copy: give the file's pages back
                release_tensor_pages(self.reader, self._tensors[gname])
            return fast
        data = self._dequantized(gname, keep=expert is not None)
        if expert is not None:
            return data[expert]
        if self._arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            heads = self.config["num_attention_heads"] if ".q_proj." in name else self.config["num_key_value_heads"]
            data = unpermute_qk(data, heads)
        if self._row_vector(name):
            data = data.reshape(1, -1)
        if self._arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            data = data - np.float32(1.0)          # back to the checkpoint's w (the model applies 1 + w)
        return data

    def release(self) -> None:
        """Drop dequantized stacks kept for expert slicing (the model holds its own references)."""
        self._cache.clear()

    def drop_pages(self, name: str) -> None:
        """Give back a tensor read once: its mapped pages, and for an expert, once every expert of its stack has
        been dropped, the stack kept for slicing and the stack's pages."""
        if name in self._derived:                  # rebuilt from several GGUF tensors (DeepSeek's k_b and v_b)
            for gname in self._derived[name]:
                release_tensor_pages(self.reader, self._tensors[gname])
            return
        gname, expert = self._names[name]
        if expert is not None:
            left = self._stack_left.setdefault(gname, set(range(int(self._tensors[gname].shape[-1]))))
            left.discard(expert)
            if left:
                return
            del self._stack_left[gname]
            self._cache.pop(gname, None)
        release_tensor_pages(self.reader, self._tensors[gname])
