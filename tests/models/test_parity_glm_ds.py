"""GLM-4.5 (`glm4_moe`), DeepSeek-V2 and Kimi K2-shaped DeepSeek-V3 against transformers, on tiny random
checkpoints read from disk: prompt logits within 1e-4 of the largest, 32 greedy tokens identical.

The cases cover each family's options: GLM's partial RoPE (its default half, a quarter, all), q/k norms,
q/k/v biases, expert groups, dense first layers and shared experts on and off; V2's greedy and
group-limited routing, with and without a query low-rank, default and YaRN RoPE, the latent norms' own eps;
K2's many experts in one group with its YaRN (beta_fast = beta_slow = 1).
"""

from __future__ import annotations

import copy

import pytest

from engine.errors import ModelFormatError
from engine.models import ignored_tensors, spec_from_config
from support.families import MLA
from support.reference import (
    assert_matches_reference,
    build_checkpoint,
)

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32

GLM_MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
YARN_UNEQUAL = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}
K2_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16, "beta_fast": 1.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
K2 = dict(MLA, q_lora_rank=32, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
          routed_scaling_factor=2.827, norm_topk_prob=True, rope_scaling=K2_YARN, max_position_embeddings=512)

CASES = {
    # GLM-4.5: half of each head rotating (transformers' default, which it writes into the config), no q/k
    # norms, one dense layer
    "glm-half-rope": ("glm4_moe", dict(GLM_MOE)),
    "glm-qknorm-bias-groups-full-rope": ("glm4_moe", dict(
        GLM_MOE, n_routed_experts=16, num_experts_per_tok=3, use_qk_norm=True, attention_bias=True, n_group=4,
        topk_group=2, first_k_dense_replace=0, partial_rotary_factor=1.0, routed_scaling_factor=2.5,
        norm_topk_prob=False, n_shared_experts=2)),
    "glm-head-dim-quarter-rope-yarn": ("glm4_moe", dict(
        GLM_MOE, head_dim=24, partial_rotary_factor=0.25, use_qk_norm=True, n_shared_experts=0,
        first_k_dense_replace=2, num_hidden_layers=4, num_key_value_heads=1, rope_scaling=YARN,
        tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "glm-groups-bias-no-dense": ("glm4_moe", dict(
        GLM_MOE, attention_bias=True, n_group=2, topk_group=1, first_k_dense_replace=0, num_key_value_heads=4,
        rope_theta=500000.0)),
    # DeepSeek-V2-Lite: no query low-rank, greedy routing, two shared experts
    "v2-lite-greedy": ("deepseek_v2", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3,
                                           first_k_dense_replace=1, n_shared_experts=2)),
    # DeepSeek-V2: query low-rank, group-limited routing (groups ranked by their best), YaRN, routed scaling
    "v2-qlora-group-limited-yarn": ("deepseek_v2", dict(
        MLA, q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=4.0, first_k_dense_replace=1, n_shared_experts=1,
        rope_scaling=YARN, attention_bias=True)),
    "v2-greedy-unequal-mscale-top1": ("deepseek_v2", dict(
        MLA, q_lora_rank=24, n_routed_experts=6, num_experts_per_tok=1, norm_topk_prob=True,
        first_k_dense_replace=0, n_shared_experts=0, rope_scaling=YARN_UNEQUAL, rms_norm_eps=1e-2,
        routed_scaling_factor=1.5)),
    "v2-no-qlora-group-limited-dense-first": ("deepseek_v2", dict(
        MLA, q_lora_rank=None, n_routed_experts=12, num_experts_per_tok=2, topk_method="group_limited_greedy",
        n_group=3, topk_group=1, first_k_dense_replace=2, num_hidden_layers=4)),
    # GLM-4.7-Flash: latent attention, GLM's router, dense and routed layers by mlp_layer_types
    "glm-lite-qlora-interleaved": ("glm4_moe_lite", dict(MLA, q_lora_rank=32, n_routed_experts=8,
                                                         num_experts_per_tok=2)),
    "glm-lite-plain-rope-layer-types-groups": ("glm4_moe_lite", dict(
        MLA, q_lora_rank=None, rope_interleave=False, mlp_layer_types=["sparse", "dense", "sparse", "dense"],
        num_hidden_layers=4, n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2, n_shared_experts=0,
        rope_scaling=YARN_UNEQUAL, attention_bias=True, norm_topk_prob=False)),
    # DeepSeek-V3 with a linear RoPE that sets mscale_all_dim: the reference scales the scores all the same
    "v3-linear-rope-mscale": ("deepseek_v3", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                                  n_group=1, topk_group=1, rope_scaling={
                                                      "rope_type": "linear", "factor": 4.0, "mscale_all_dim": 1.0})),
    # Kimi K2-shaped DeepSeek-V3: many experts, one group, K2's YaRN
    # (a large rms_norm_eps: the latent norms keep 1e-6)
    "k2-64-experts": ("deepseek_v3", dict(K2, n_routed_experts=64, num_experts_per_tok=6, rms_norm_eps=1e-2)),
    "k2-384-experts": ("deepseek_v3", dict(K2, n_routed_experts=384, num_experts_per_tok=8, moe_intermediate_size=16,
                                           num_hidden_layers=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    # a copy: transformers writes into the rope dicts it is given (partial_rotary_factor), which cases share
    folder = build_checkpoint(tmp_path / case, model_type, **copy.deepcopy(overrides))
    assert_matches_reference(folder, PROMPT, N_GREEDY)


def test_glm_spec_reads_the_references_defaults():
    """Keys a GLM config leaves out take transformers' defaults: half of each head rotates, 8 KV heads."""
    spec = spec_from_config({"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 256, "num_attention_heads": 16,
                             "num_hidden_layers": 3, "vocab_size": 100, "first_k_dense_replace": 1})
    attn = spec.layers[0].attn
    assert (attn.head_dim, attn.n_kv_heads, attn.rope.dim, attn.qk_norm) == (16, 8, 8, None)
    moe = spec.layers[1].ffn
    assert (moe.n_experts, moe.top_k, moe.shared_ffn, moe.scoring, moe.correction_bias) == (128, 8, 1408, "sigmoid", True)
    assert spec.rms_eps == 1e-5 and spec.layers[0].ffn.intermediate == 10944


V2 = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "vocab_size": 100, "num_experts_per_tok": 2, "n_routed_experts": 8}


@pytest.mark.parametrize("change, key", [
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok"),
])
def test_deepseek_v2_refuses_what_it_does_not_run(change, key):
    with pytest.raises(ModelFormatError, match=key):
        spec_from_config({**V2, **change})


def test_deepseek_v2_group_limited_routing_needs_its_groups():
    with pytest.raises(ModelFormatError, match="n_group"):
        spec_from_config({**V2, "topk_method": "group_limited_greedy"})


@pytest.mark.parametrize("change, key", [
    ({"n_group": 3}, "n_group"),
    ({"n_group": 8}, "n_group"),                               # one expert a group: no two best to rank by
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
])
def test_glm_refuses_groups_it_cannot_route(change, key):
    config = {**V2, "architectures": ["Glm4MoeForCausalLM"], "num_key_value_heads": 4, **change}
    with pytest.raises(ModelFormatError, match=key):
        spec_from_config(config)


# the shapes of GLM-4.5 (355B) and DeepSeek-V2-Lite as their config.json files give them
GLM45 = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "head_dim": 128, "hidden_size": 5120,
         "intermediate_size": 12288, "max_position_embeddings": 131072, "moe_intermediate_size": 1536,
         "n_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "norm_topk_prob": True,
         "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8,
         "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
         "routed_scaling_factor": 2.5, "topk_group": 1, "use_qk_norm": True, "vocab_size": 151552,
         "first_k_dense_replace": 3, "eos_token_id": [151329, 151336, 151338], "tie_word_embeddings": False}
V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 1, "hidden_size": 2048,
           "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
           "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
           "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
           "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.0,
           "scoring_func": "softmax", "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128,
           "vocab_size": 102400, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                                   "type": "yarn"}}


def test_real_configs_parse_and_skip_their_mtp_layers():
    glm = spec_from_config(GLM45)
    attn, moe = glm.layers[0].attn, glm.layers[3].ffn
    assert (attn.head_dim, attn.rope.dim, attn.qk_norm, attn.qkv_bias, attn.o_bias) == (128, 64, "head", True, False)
    assert sum(isinstance(layer.ffn, type(moe)) for layer in glm.layers) == 89 and moe.shared_ffn == 1536
    allowed = ignored_tensors(GLM45)
    assert allowed.fullmatch("model.layers.92.mlp.experts.0.gate_proj.weight")
    assert allowed.fullmatch("model.layers.92.eh_proj.weight")
    assert not allowed.fullmatch("model.layers.91.mlp.experts.0.gate_proj.weight")

    lite = spec_from_config(V2_LITE)
    mla, moe = lite.layers[0].attn, lite.layers[1].ffn
    assert mla.q_lora_rank is None and mla.rope.interleaved and mla.rope.kind == "yarn" and mla.norm_eps == 1e-6
    assert mla.rope.cos_sin_scale == 1.0 and mla.scale > 192**-0.5       # mscale equal: on the scores only
    assert (moe.scoring, moe.n_group, moe.top_k, moe.norm_topk_prob, moe.shared_ffn) == ("softmax", 1, 6, False, 2816)
    assert not ignored_tensors(V2_LITE).fullmatch("model.layers.27.mlp.gate.weight")


def test_deepseek_v3_spec_reads_the_references_defaults():
    """Keys a DeepSeek-V3 config leaves out take transformers' defaults (groups of 8, three dense layers, a
    shared expert, a query low-rank), as the reference builds the model."""
    spec = spec_from_config({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
                             "num_attention_heads": 4, "vocab_size": 100})
    moe = spec.layers[3].ffn
    assert [type(layer.ffn).__name__ for layer in spec.layers] == ["MLPSpec"] * 3 + ["MoESpec"]
    assert (moe.n_experts, moe.n_group, moe.topk_group, moe.shared_ffn, moe.routed_scaling_factor) == \
        (256, 8, 4, 2048, 2.5)
    assert spec.layers[0].attn.q_lora_rank == 1536
