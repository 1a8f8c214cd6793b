"""gpt-oss's MXFP4 experts as published: run at 4.25 bits against transformers' dequantization."""

from __future__ import annotations

import numpy as np
import pytest

from engine.quant.published import MXFP4Tensor
from support.families import FAMILIES
from support.published import held, to_mxfp4
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


def test_mxfp4_converts_as_published_and_streams(tmp_path):
    """`colibri convert --bits 4` keeps gpt-oss's MXFP4 experts as they are (4.25 bits, no second rounding): the
    container, held or with its experts streamed, gives the folder's logits bit for bit (the rest kept float)."""
    from app.hub.convert import ConvertSettings, convert
    from engine.formats.container import Container
    from engine.kv import KVCache
    from engine.loader import OffloadOptions, load_model, open_checkpoint
    from engine.offload.store import StoreSettings

    def forward(loaded):
        return loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), all_logits=True)

    _mxfp4_checkpoint(tmp_path / "mx")
    keep = (("*self_attn*", 32), ("*embed_tokens*", 32), ("lm_head.weight", 32))
    out = convert(tmp_path / "mx", tmp_path / "q4", ConvertSettings(bits=4, keep=keep), log=lambda m: None)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    published = open_checkpoint(tmp_path / "mx", quantized=True).source.load(name)
    stored = Container.open(out).load(name)
    assert isinstance(stored, MXFP4Tensor) and stored.bits_per_weight == 4.25
    np.testing.assert_array_equal(stored.blocks, published.blocks)
    np.testing.assert_array_equal(stored.scales, published.scales)
    direct = forward(load_model(tmp_path / "mx"))
    np.testing.assert_array_equal(forward(load_model(out)), direct)
    streamed = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 16)))
    try:
        np.testing.assert_array_equal(forward(streamed), direct)
    finally:
        streamed.close()
