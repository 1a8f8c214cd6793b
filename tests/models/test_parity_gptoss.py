"""gpt-oss and Granite-MoE against transformers on tiny random checkpoints read from disk.

Both store their routed experts fused (engine/formats/fused.py cuts them per expert). Prompt logits
must agree within 1e-4 of the logits' largest magnitude, and 32 greedy tokens (ours with the KV cache,
the reference recomputing) must be identical. The prompt (20 tokens) is longer than every sliding
window below, so the windows matter; small `swiglu_limit`s make the clamp bite.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.kv import KVCache
from engine.loader import load_model, open_checkpoint
from engine.models import spec_from_config
from support.reference import (
    assert_matches_reference,
    build_checkpoint,
    load_reference,
    relative_error,
)

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32
YARN_TRUNCATED = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                  "beta_slow": 1.0, "truncate": True, "rope_theta": 150000.0}

CASES = {
    # the reference's defaults: sliding / full alternating, YaRN (factor 32, untruncated), biases everywhere
    "gptoss-defaults-window6": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                sliding_window=6)),
    # every layer sliding, plain RoPE, a clamp that bites, top-3 of 6
    "gptoss-all-sliding-plain-rope-clamp": ("gpt_oss", dict(
        num_local_experts=6, num_experts_per_tok=3, head_dim=16, sliding_window=4, swiglu_limit=0.3,
        swiglu_alpha=1.2, layer_types=["sliding_attention"] * 3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # full layers first, MHA, no attention biases, truncated YaRN, top-1
    "gptoss-full-first-mha-nobias-yarn-truncate": ("gpt_oss", dict(
        num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=4, head_dim=16,
        attention_bias=False, sliding_window=10, swiglu_limit=1.0,
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=YARN_TRUNCATED)),
    "granitemoe-multipliers": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2,
                                                  embedding_multiplier=12.0, residual_multiplier=0.22,
                                                  attention_multiplier=0.05, logits_scaling=8.0)),
    "granitemoe-top1-mqa-tied-bias-scaled-embed": ("granitemoe", dict(num_local_experts=8, num_experts_per_tok=1,
                                                         num_key_value_heads=1, attention_bias=True,
                                                         tie_word_embeddings=True, embedding_multiplier=3.0)),
    "granitemoe-top3-linear-rope": ("granitemoe", dict(num_local_experts=6, num_experts_per_tok=3,
                                                       embedding_multiplier=2.0, residual_multiplier=1.5,
                                                       attention_multiplier=0.3, logits_scaling=0.5,
                                                       rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 10000.0})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    folder = build_checkpoint(tmp_path / case, model_type, **overrides)
    assert_matches_reference(folder, PROMPT, N_GREEDY)


def test_fused_experts_are_cut_per_expert_from_a_bf16_file(tmp_path):
    """The pieces are the reference's own slices of the fused tensors, widened one expert at a time."""
    import torch

    folder = build_checkpoint(tmp_path / "bf16", "gpt_oss", dtype="bfloat16", num_local_experts=4,
                              num_experts_per_tok=2, head_dim=16)
    ckpt = open_checkpoint(folder)
    names = set(ckpt.source.names())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert "model.layers.1.mlp.experts.3.down_proj.bias" in names and "model.layers.1.mlp.gate.bias" in names
    experts = load_reference(folder).model.layers[1].mlp.experts
    gate = ckpt.source.load("model.layers.1.mlp.experts.2.gate_proj.weight")           # [I, hidden]
    up_bias = ckpt.source.load("model.layers.1.mlp.experts.2.up_proj.bias")            # [I]
    down = ckpt.source.load("model.layers.1.mlp.experts.2.down_proj.weight")           # [hidden, I]
    with torch.no_grad():
        assert np.array_equal(gate, experts.gate_up_proj[2][:, ::2].T.float().numpy())
        assert np.array_equal(up_bias, experts.gate_up_proj_bias[2][1::2].float().numpy())
        assert np.array_equal(down, experts.down_proj[2].T.float().numpy())
    assert gate.flags.c_contiguous and not gate.flags.writeable


def test_a_quantization_other_than_mxfp4_is_refused_with_its_reason(tmp_path):
    # MXFP4 runs (tests/formats/test_mxfp4.py); another method's tensors would be misread
    folder = build_checkpoint(tmp_path / "mx", "gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with pytest.raises(ModelFormatError, match="'awq'"):
        spec_from_config(config)


def test_granite_config_refuses_a_zero_multiplier():
    config = {"architectures": ["GraniteMoeForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10, "logits_scaling": 0.0}
    with pytest.raises(ModelFormatError, match="logits_scaling"):
        spec_from_config(config)


def test_the_planners_forward_pass_applies_granites_multipliers(tmp_path):
    """`colibri convert --budget` measures sensitivity with its own resumable pass: it must be the model's."""
    from engine.plan.sensitivity import forward_from

    model_type, overrides = CASES["granitemoe-multipliers"]
    model = load_model(build_checkpoint(tmp_path / "g", model_type, **overrides)).model
    ours = model.forward(PROMPT, KVCache(model.spec, 64), all_logits=True)
    planned = forward_from(model, model.embed_tokens(np.asarray(PROMPT)), 0)
    assert relative_error(planned, ours) < 1e-5


def test_fused_experts_that_do_not_fit_the_config_are_refused(tmp_path):
    folder = build_checkpoint(tmp_path / "bad", "granitemoe", num_local_experts=4, num_experts_per_tok=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))   # the tensors hold 96
    with pytest.raises(ModelFormatError, match="input_linear.weight .*cannot hold"):
        open_checkpoint(folder)
