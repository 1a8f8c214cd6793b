"""Phi-3 against transformers on tiny random checkpoints read from disk.

Its checkpoints fuse q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`); engine/formats/fused.py cuts them
by rows. Prompt logits must agree within 1e-4 of the logits' largest magnitude, and 32 greedy tokens
(ours with the KV cache, the reference recomputing) must be identical. The prompt (20 tokens) is longer
than the windows below, so they matter.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.errors import GenerationError, ModelFormatError
from engine.kv import KVCache
from engine.loader import load_model
from engine.models import fused_tensors, spec_from_config
from support.reference import (
    assert_matches_reference,
    build_checkpoint,
    load_reference,
)

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32

CASES = {
    # the reference's defaults at a tiny size: GQA, untied, no window, full rotary
    "gqa-untied-default-rope": dict(),
    # MHA (num_key_value_heads null), tied embeddings, a window shorter than the prompt, another theta
    "mha-tied-window6": dict(num_key_value_heads=None, tie_word_embeddings=True, sliding_window=6,
                             rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # MQA, half the head rotated, a window of 3, GELU-tanh gate
    "mqa-partial-rotary-window3-gelu": dict(num_key_value_heads=1, sliding_window=3, hidden_act="gelu_pytorch_tanh",
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5}),
    # LongRoPE within original_max_position_embeddings (prompt and answer: 52 of 64): its short factors, the
    # cos/sin scale derived from max_position_embeddings / original (512 / 64). Phi3Config takes the top-level key.
    "longrope-short-factors": dict(original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.37 * i for i in range(8)], "long_factor": [3.0 + i for i in range(8)]}),
    # the same with a given attention factor, half the head rotated, a window
    "longrope-partial-attention-factor": dict(sliding_window=5, original_max_position_embeddings=60, rope_parameters={
        "rope_type": "longrope", "rope_theta": 500.0, "original_max_position_embeddings": 60,
        "attention_factor": 1.3, "partial_rotary_factor": 0.5,
        "short_factor": [1.5, 0.8, 2.0, 1.1], "long_factor": [4.0, 5.0, 6.0, 7.0]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_phi3_matches_transformers(case, tmp_path):
    # Phi3Config's token ids (32000) lie outside the tiny vocabulary
    folder = build_checkpoint(tmp_path / case, "phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2, **CASES[case])
    assert_matches_reference(folder, PROMPT, N_GREEDY, architecture="Phi3ForCausalLM")


def _config(**overrides) -> dict:
    cfg = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=160)
    cfg.update(overrides)
    return cfg


def test_fused_rows_follow_the_heads():
    rules = fused_tensors(_config(num_key_value_heads=1))
    qkv = rules[0].pieces
    assert [(p.start, p.stop) for p in qkv] == [(0, 64), (64, 80), (80, 96)]
    assert [(p.start, p.stop) for p in rules[1].pieces] == [(0, 96), (96, 192)]


def test_reference_defaults_fill_a_sparse_config():
    spec = spec_from_config(_config())
    assert spec.rms_eps == 1e-5 and spec.max_position == 4096 and spec.eos_token_ids == (32000,)
    assert all(layer.attn.sliding_window is None for layer in spec.layers)
    spec = spec_from_config(_config(sliding_window=2047))
    assert all(layer.attn.sliding_window == 2047 for layer in spec.layers)


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])
def test_hub_longrope_configs_run_at_their_short_factors_within_the_original_length(kind):
    # Phi-3-mini-128k's layout: original_max_position_embeddings beside rope_scaling, not inside it
    spec = spec_from_config(_config(max_position_embeddings=131072, original_max_position_embeddings=4096,
                                    rope_scaling={"type": kind, "short_factor": [1.0] * 8,
                                                  "long_factor": [2.0] * 8}))
    rope = spec.layers[0].attn.rope
    assert (rope.kind, rope.freq_factors, rope.max_position, spec.max_position) == ("longrope", (1.0,) * 8, 4096, 4096)
    assert rope.cos_sin_scale == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)


@pytest.mark.parametrize(("scaling", "problem"), [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "short_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 8}}, "short_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope type"),
])
def test_rope_phi3_does_not_define_is_refused(scaling, problem, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config(**scaling)))
    with pytest.raises(ModelFormatError, match=problem):
        spec_from_config(json.loads(path.read_text()), str(path))


def test_longrope_positions_past_the_original_length_are_refused(tmp_path):
    """Past original_max_position_embeddings the reference re-rotates the whole sequence with its long factors;
    Colibri refuses the position rather than answer with keys rotated the short way."""
    folder = build_checkpoint(tmp_path / "lr", "phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              **CASES["longrope-short-factors"])
    model = load_model(folder).model
    assert model.spec.max_position == 64
    cache = KVCache(model.spec, 128)
    model.forward(list(range(1, 65)), cache)        # positions 0..63: the short factors' range
    with pytest.raises(GenerationError, match="LongRoPE"):
        model.forward([5], cache)


def test_a_zero_window_is_refused():
    with pytest.raises(ModelFormatError, match="sliding_window"):
        spec_from_config(_config(sliding_window=0))


def test_bf16_checkpoint_converts_to_a_container_of_cut_tensors(tmp_path):
    """The fused rows are cut from a bfloat16 file, and `colibri convert` stores the cut tensors, which load and
    run like the float32 model they stand for."""
    import torch

    from app.hub.convert import ConvertSettings, convert
    from engine.formats.container import Container
    from engine.loader import open_checkpoint

    folder = build_checkpoint(tmp_path / "bf16", "phi3", dtype="bfloat16", pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, num_key_value_heads=1)
    ckpt = open_checkpoint(folder)
    qkv = load_reference(folder).model.layers[1].self_attn.qkv_proj.weight
    with torch.no_grad():
        assert np.array_equal(ckpt.source.load("model.layers.1.self_attn.k_proj.weight"), qkv[64:80].float().numpy())

    out = convert(folder, tmp_path / "q8", ConvertSettings(bits=8), log=lambda m: None)
    names = set(Container.open(out).names())
    assert "model.layers.0.self_attn.v_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    quantized, plain = load_model(out).model, load_model(folder).model
    ours = quantized.forward(PROMPT, KVCache(quantized.spec, 64), all_logits=True)
    expected = plain.forward(PROMPT, KVCache(plain.spec, 64), all_logits=True)
    assert np.abs(ours - expected).max() <= 5e-2 * np.abs(expected).max()
