"""gpt-oss's MXFP4 experts as published: run at 4.25 bits against transformers' dequantization."""

from __future__ import annotations

import numpy as np
import pytest

from engine.quant.published import MXFP4Tensor
from support.families import FAMILIES
from support.published import dequantized_copy, held, to_mxfp4
from support.reference import assert_matches_reference, build_checkpoint

PROMPT = [3, 17, 42, 5, 99, 7, 64, 12]


def _mxfp4_checkpoint(folder):
    model_type, extra = FAMILIES["gpt_oss"]
    build_checkpoint(folder, model_type, seed=5, **extra)
    return to_mxfp4(folder)


def _load_dequantized(folder):
    """transformers reading the MXFP4 folder with Mxfp4Config(dequantize=True), in float32."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


@pytest.mark.parity
def test_mxfp4_matches_transformers_dequantized(tmp_path, monkeypatch):
    import support.reference as reference
    from engine.formats.hf import SafetensorsFolder

    quantized = _mxfp4_checkpoint(tmp_path)
    assert len(quantized) == 2 * 3                                         # gate_up and down of 3 layers
    monkeypatch.setattr(reference, "load_reference", _load_dequantized)
    loaded, _, _ = assert_matches_reference(tmp_path, PROMPT, n_greedy=8)

    # every expert matrix is held as the file's 4-bit codes and 8-bit scales: 4.25 bits a weight
    folder = SafetensorsFolder(tmp_path)
    assert not any(n.endswith(("_blocks", "_scales")) for n in folder.names())
    spec = loaded.spec
    mx = held(loaded.model, (MXFP4Tensor,))
    per_expert = 3 * spec.hidden_size * spec.layers[0].ffn.expert_ffn
    assert sum(w.shape[0] * w.shape[1] for w in mx) == spec.n_layers * spec.layers[0].ffn.n_experts * per_expert
    assert all(w.bits_per_weight == 4.25 for w in mx)
    assert all(w.blocks.dtype == np.uint8 and w.scales.dtype == np.uint8 for w in mx)


def test_mxfp4_converts_from_its_dequantized_values(tmp_path):
    """`colibri convert --bits 8` of gpt-oss's MXFP4 folder quantizes the values the MXFP4 experts stand for."""
    from app.hub.convert import ConvertSettings, convert
    from engine.formats.container import Container
    from engine.kv import KVCache
    from engine.loader import load_model, open_checkpoint
    from engine.quant import quantize

    _mxfp4_checkpoint(tmp_path / "mx")
    out = convert(tmp_path / "mx", tmp_path / "q8", ConvertSettings(bits=8), log=lambda m: None)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    mx = open_checkpoint(tmp_path / "mx", quantized=True).source.load(name)
    assert isinstance(mx, MXFP4Tensor)
    stored = Container.open(out).load(name)
    np.testing.assert_array_equal(stored.dequantize(), quantize(mx.dequantize(), 8, 32).dequantize())
    # the container is the one a float32 folder of the dequantized values converts into: logits bit for bit
    same = convert(dequantized_copy(tmp_path / "mx", tmp_path / "f32"), tmp_path / "f32q", ConvertSettings(bits=8),
                   log=lambda m: None)
    ours, theirs = load_model(out), load_model(same)
    np.testing.assert_array_equal(ours.model.forward(PROMPT, KVCache(ours.spec, 64), all_logits=True),
                                  theirs.model.forward(PROMPT, KVCache(theirs.spec, 64), all_logits=True))
