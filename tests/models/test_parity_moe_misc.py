"""MiniMax-M2, ERNIE 4.5 MoE and Phi-3.5-MoE against transformers, and what their configs may not ask for.

Prompt logits within 1e-4 of the reference's largest, and 32 greedy tokens identical (ours through the KV
cache, the reference recomputing the whole sequence), on tiny random checkpoints read from disk: several
configurations per family, covering each optional feature on and off. Then the configs of the released
checkpoints parse as those models, values the reference does not compute are refused by name, and the fused
decode step either runs a family bit for bit as the blocks do or declines it.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.kv import KVCache
from engine.loader import load_model
from engine.models import spec_from_config
from engine.spec import MLPSpec, MoESpec
from support.reference import (
    assert_matches_reference,
    build_checkpoint,
)

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
# LongRoPE over a 16-wide head (8 pairs); the sequence passes original_max_position_embeddings, so the reference
# takes its long-sequence branch too
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.7, 3.5, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0], "short_mscale": 1.19, "long_mscale": 1.19}

CASES = {
    # MiniMax-M2: whole-projection q/k norms, partial RoPE, sigmoid + correction bias, renormalised
    "minimax-rotary-dim": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, rotary_dim=8)),
    "minimax-full-rope-mha-tied-top3": ("minimax_m2", dict(num_local_experts=6, num_experts_per_tok=3, head_dim=16,
                                                           num_key_value_heads=4, tie_word_embeddings=True)),
    "minimax-partial-factor-yarn-mqa-top1": ("minimax_m2", dict(
        num_local_experts=8, num_experts_per_tok=1, head_dim=24, num_key_value_heads=1,
        rope_parameters={**YARN, "rope_theta": 5000000.0, "partial_rotary_factor": 0.5})),
    # ERNIE 4.5: biases everywhere but the experts, shared experts, sparse layer ranges, interleaved RoPE
    "ernie-bias-shared-tied": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                                                    moe_num_shared_experts=1, use_bias=True)),
    "ernie-interval-range-untied": ("ernie4_5_moe", dict(
        num_hidden_layers=4, moe_num_experts=6, moe_k=3, moe_intermediate_size=32, moe_num_shared_experts=0,
        moe_layer_start_index=0, moe_layer_end_index=2, moe_layer_interval=2, tie_word_embeddings=False,
        head_dim=24)),
    "ernie-yarn-mqa-two-shared-norm-floor": ("ernie4_5_moe", dict(
        moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=2,
        num_key_value_heads=1, moe_norm_min=0.6, use_bias=True, rope_parameters={**YARN, "rope_theta": 500000.0})),
    # Phi-3.5-MoE: LayerNorms, biases, sliding window, the sparse mixer's threshold, LongRoPE
    "phimoe-biases-window": ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2, attention_bias=True,
                                            lm_head_bias=True, sliding_window=8)),
    "phimoe-longrope-wide-mixer-tied": ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                                       num_key_value_heads=4, router_jitter_noise=0.5,
                                                       tie_word_embeddings=True, lm_head_bias=True,
                                                       rope_parameters=LONGROPE)),
    "phimoe-mqa-no-threshold": ("phimoe", dict(num_local_experts=6, num_experts_per_tok=2, num_key_value_heads=1,
                                               head_dim=24, router_jitter_noise=0.0)),
    # the reference's sparse mixer routes two experts whatever num_experts_per_tok says
    "phimoe-top4-routes-two": ("phimoe", dict(num_local_experts=6, num_experts_per_tok=4)),
    "phimoe-top1-routes-two": ("phimoe", dict(num_local_experts=4, num_experts_per_tok=1, router_jitter_noise=0.2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    folder = build_checkpoint(tmp_path / case, model_type, **overrides)
    assert_matches_reference(folder, PROMPT, N_GREEDY)


def test_ernie_sparse_layers_follow_start_end_and_interval():
    config = {**ERNIE, "num_hidden_layers": 8, "moe_layer_start_index": 2, "moe_layer_end_index": 6,
              "moe_layer_interval": 2}
    spec = spec_from_config(config)
    assert [isinstance(layer.ffn, MoESpec) for layer in spec.layers] == [False, False, False, True, False, True,
                                                                         False, False]
    everything = spec_from_config({**config, "moe_layer_start_index": 0, "moe_layer_end_index": -1,
                                   "moe_layer_interval": 1})
    assert all(isinstance(layer.ffn, MoESpec) for layer in everything.layers)


# the released checkpoints' configs, trimmed to what the readers look at
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid",
    "shared_intermediate_size": 0, "tie_word_embeddings": False, "use_mtp": True, "use_qk_norm": True,
    "use_routing_bias": True, "vocab_size": 200064,
}
ERNIE = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 2560, "intermediate_size": 12288, "max_position_embeddings": 131072, "model_type": "ernie4_5_moe",
    "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 28, "pad_token_id": 0,
    "rms_norm_eps": 1e-05, "vocab_size": 103424, "rope_theta": 500000, "use_bias": False,
    "tie_word_embeddings": True, "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_intermediate_size": 1536,
    "moe_num_experts": 64, "moe_k": 6, "moe_layer_interval": 1, "moe_use_aux_free": True, "moe_num_shared_experts": 2,
    "num_nextn_predict_layers": 1,
}
PHI35_MOE = {
    "architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "bos_token_id": 1, "eos_token_id": 32000,
    "hidden_act": "silu", "hidden_size": 4096, "input_jitter_noise": 0.01, "intermediate_size": 6400,
    "lm_head_bias": True, "max_position_embeddings": 131072, "model_type": "phimoe", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 16,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": {"long_factor": [1.0 + i for i in range(64)], "long_mscale": 1.243163121016122,
                     "original_max_position_embeddings": 4096, "short_factor": [1.0 + i / 64 for i in range(64)],
                     "short_mscale": 1.243163121016122, "type": "longrope"},
    "router_jitter_noise": 0.01, "sliding_window": 131072, "tie_word_embeddings": False, "vocab_size": 32064,
}


def test_released_configs_parse_as_those_models():
    m = spec_from_config(MINIMAX_M2)
    attn, moe = m.layers[0].attn, m.layers[0].ffn
    assert (m.n_layers, attn.head_dim, attn.rope.dim, attn.rope.theta, attn.qk_norm) == (62, 128, 64, 5e6, "full")
    assert (moe.n_experts, moe.top_k, moe.expert_ffn, moe.scoring, moe.correction_bias) == (256, 8, 1536, "sigmoid",
                                                                                              True)
    e = spec_from_config(ERNIE)
    assert isinstance(e.layers[0].ffn, MLPSpec) and all(isinstance(layer.ffn, MoESpec) for layer in e.layers[1:])
    moe = e.layers[1].ffn
    assert (moe.n_experts, moe.top_k, moe.shared_ffn, moe.norm_min, e.tie_embeddings) == (64, 6, 3072, 0.0, True)
    assert e.layers[0].attn.rope.interleaved and e.layers[0].attn.head_dim == 128
    p = spec_from_config(PHI35_MOE)
    attn, moe = p.layers[0].attn, p.layers[0].ffn
    assert (p.norm, p.lm_head_bias, attn.qkv_bias, attn.o_bias, attn.sliding_window) == ("layer", True, True, True,
                                                                                        131072)
    assert (attn.rope.kind, attn.rope.cos_sin_scale, moe.scoring, moe.top_k, moe.jitter_eps) == (
        "longrope", 1.243163121016122, "sparsemixer", 2, 0.01)
    assert attn.rope.freq_factors == tuple(PHI35_MOE["rope_scaling"]["short_factor"])


def test_left_out_keys_take_the_references_defaults():
    """A key missing from config.json reads as the family's modelling code defaults it, not as the generic readers do."""
    trimmed = {k: v for k, v in MINIMAX_M2.items() if k not in ("head_dim", "rope_theta", "num_key_value_heads")}
    attn = spec_from_config(trimmed).layers[0].attn
    assert (attn.head_dim, attn.rope.theta, attn.n_kv_heads, attn.rope.dim) == (128, 5e6, 8, 64)
    ernie = spec_from_config({k: v for k, v in ERNIE.items() if k not in ("tie_word_embeddings", "rope_theta")})
    assert ernie.tie_embeddings and ernie.layers[0].attn.rope.theta == 500000.0
    phi = {k: v for k, v in PHI35_MOE.items() if k not in ("router_jitter_noise", "num_key_value_heads")}
    assert spec_from_config(phi).layers[0].ffn.jitter_eps == 0.01
    assert spec_from_config(phi).layers[0].attn.n_kv_heads == 8
    assert spec_from_config({**phi, "num_key_value_heads": None}).layers[0].attn.n_kv_heads == 32   # null: MHA


@pytest.mark.parametrize(("config", "key", "expected"), [
    ({**MINIMAX_M2, "use_qk_norm": False}, "use_qk_norm", "always normalises q and k"),
    ({**MINIMAX_M2, "qk_norm_type": "per_head"}, "qk_norm_type", "'per_layer'"),
    ({**MINIMAX_M2, "scoring_func": "softmax"}, "scoring_func", "'sigmoid'"),
    ({**MINIMAX_M2, "shared_intermediate_size": 1536}, "shared_intermediate_size", "no shared expert"),
    ({**MINIMAX_M2, "attn_type_list": [0] + [1] * 61}, "attn_type_list", "62 entries of 1"),
    ({**MINIMAX_M2, "sliding_window": 4096}, "sliding_window", "attends to all positions"),
    ({**ERNIE, "partial_rotary_factor": 0.5}, "partial_rotary_factor", "rotates every feature"),
    ({**ERNIE, "use_rmsnorm": False}, "use_rmsnorm", "RMSNorm"),
    ({**ERNIE, "moe_k": 65}, "num_experts_per_tok", "at most the 64 experts"),
    ({**PHI35_MOE, "num_local_experts": 1}, "num_local_experts", "at least the two"),
    ({**PHI35_MOE, "rope_scaling": {**PHI35_MOE["rope_scaling"], "long_mscale": 1.5}}, "long_mscale",
     "a cache of keys cannot follow"),
    ({**PHI35_MOE, "rope_scaling": {**PHI35_MOE["rope_scaling"], "short_factor": [1.0] * 63}}, "short_factor",
     "64 positive numbers"),
    ({**PHI35_MOE, "sliding_window": 0}, "sliding_window", "a window of positions >= 1"),
])
def test_what_the_reference_does_not_compute_is_refused(config, key, expected):
    with pytest.raises(ModelFormatError, match=rf"'{key}' is .*expected .*{expected}"):
        spec_from_config(config)


def test_phimoe_refuses_rope_kinds_it_does_not_run():
    with pytest.raises(ModelFormatError, match=r"rope type 'yarn' is not supported for PhiMoE"):
        spec_from_config({**PHI35_MOE, "rope_scaling": {**PHI35_MOE["rope_scaling"], "type": "yarn"}})


def _converted(tmp_path_factory, model_type: str, **overrides):
    from app.hub.convert import ConvertSettings, convert

    src = build_checkpoint(tmp_path_factory.mktemp(model_type), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _greedy(model, fused: bool) -> np.ndarray:
    model.context.fused_decode = fused
    cache = KVCache(model.spec, 64)
    rows = [model.forward(PROMPT[:12], cache)[-1]]
    for _ in range(8):
        rows.append(model.forward([int(rows[-1].argmax())], cache)[-1])
    cache.release()
    return np.stack(rows)


@pytest.mark.parametrize("model_type, overrides", [
    # interleaved RoPE, softmax routing with a correction bias
    ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=0)),
    # q/k norms over the whole projection, partial RoPE, sigmoid routing with a correction bias
    ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, rotary_dim=8, num_key_value_heads=1)),
    ("olmoe", dict(num_experts=8, num_experts_per_tok=2)),      # whole-projection norms without clip_qkv
])
def test_fused_step_runs_the_family_as_the_blocks_do(tmp_path_factory, model_type, overrides):
    """Through the fused kernel, the same bits as the blocks one at a time."""
    model = _converted(tmp_path_factory, model_type, **overrides).model
    want = _greedy(model, fused=False)
    got = _greedy(model, fused=True)
    assert model.context.fused not in (None, False)              # it ran fused
    assert np.array_equal(got, want)


@pytest.mark.parametrize("model_type, overrides", [
    ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2, lm_head_bias=True)),
    ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=0,
                          use_bias=True)),
])
def test_fused_step_declines_what_it_does_not_compute(tmp_path_factory, model_type, overrides):
    """LayerNorm and the sparse mixer, biases on MLPs and the head: the blocks run."""
    model = _converted(tmp_path_factory, model_type, **overrides).model
    _greedy(model, fused=True)
    assert model.context.fused is None


@pytest.mark.parametrize("model_type, overrides", [
    ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.3, lm_head_bias=True)),
    ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                          use_bias=True, moe_norm_min=0.6)),
])
def test_a_batch_gives_each_sequence_its_own_bits(tmp_path_factory, model_type, overrides):
    """LayerNorm, the sparse mixer and the norm floor are computed row by row: two sequences run together (a prompt
    each, then a token each) give exactly the logits each gives alone."""
    model = _converted(tmp_path_factory, model_type, **overrides).model
    prompts = [PROMPT[:9], PROMPT[4:17]]
    alone = []
    for p in prompts:
        cache = KVCache(model.spec, 64)
        first = model.forward(p, cache)
        alone.append((first, model.forward([int(first.argmax())], cache)))
    caches = [KVCache(model.spec, 64) for _ in prompts]
    firsts = model.forward_batch(list(zip(prompts, caches)))
    seconds = model.forward_batch([([int(f.argmax())], c) for f, c in zip(firsts, caches)])
    for (want_first, want_second), first, second in zip(alone, firsts, seconds):
        assert np.array_equal(first, want_first) and np.array_equal(second, want_second)


def test_the_planners_forward_runs_layernorm_and_the_head_bias(tmp_path):
    """The sensitivity pass resumes the forward pass at a layer: with LayerNorm and a head bias it is still the
    model's own forward, bit for bit."""
    from engine.loader import open_checkpoint
    from engine.models.transformer import Transformer, embed_rows
    from engine.plan.sensitivity import Resident, forward_from

    ckpt = open_checkpoint(build_checkpoint(tmp_path, "phimoe", num_local_experts=4, num_experts_per_tok=2,
                                            lm_head_bias=True, attention_bias=True))
    model = Transformer(ckpt.spec, Resident(ckpt.source))
    expected = model.forward(PROMPT, KVCache(model.spec, len(PROMPT)), all_logits=True)
    keep: list[np.ndarray] = []
    assert np.array_equal(forward_from(model, embed_rows(model.embed, np.asarray(PROMPT)), 0, keep=keep), expected)
    assert np.array_equal(forward_from(model, keep[2], 2), expected)
