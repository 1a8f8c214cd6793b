"""Block-scaled FP8 safetensors as published (DeepSeek-V3, Qwen3-FP8): run at 8 bits against transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.quant.published import FP8Tensor
from support.families import FAMILIES
from support.published import dequantized_copy, held, to_fp8
from support.reference import assert_matches_reference, build_checkpoint

PROMPT = [3, 17, 42, 5, 99, 7, 64, 12]


def _fp8_checkpoint(folder, family: str, block, **overrides):
    model_type, extra = FAMILIES[family]
    build_checkpoint(folder, model_type, seed=3, **{**extra, **overrides})
    return to_fp8(folder, block)


def _load_dequantized(folder):
    """transformers reading the FP8 folder with FineGrainedFP8Config(dequantize=True), in float32."""
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                quantization_config=FineGrainedFP8Config(dequantize=True)).eval()


@pytest.mark.parity
@pytest.mark.parametrize("family,block", [("deepseek_v3", (8, 16)), ("qwen3_moe", (32, 32))])
def test_fp8_matches_transformers_dequantized(tmp_path, monkeypatch, family, block):
    import support.reference as reference
    from engine.formats.hf import SafetensorsFolder

    quantized = _fp8_checkpoint(tmp_path, family, block)
    monkeypatch.setattr(reference, "load_reference", _load_dequantized)
    loaded, _, _ = assert_matches_reference(tmp_path, PROMPT, n_greedy=8)

    # the model holds its matrices as the file's FP8 bytes, 1 byte a weight (and a float32 scale a block)
    folder = SafetensorsFolder(tmp_path)
    assert not any(n.endswith("_scale_inv") for n in folder.names())
    sizes = {n: int(np.prod(folder.shape(n))) for n in quantized}
    widened = [n for n in quantized if n.endswith("kv_b_proj.weight")]   # MLA absorbs it into float32 products
    fp8 = held(loaded.model, (FP8Tensor,))
    assert sum(w.codes.size for w in fp8) == sum(sizes.values()) - sum(sizes[n] for n in widened)
    for w in fp8:
        assert w.codes.dtype == np.uint8 and not w.codes.flags.owndata        # a view of the file's map
        assert w.nbytes / w.codes.size <= 1 + 4 / (block[0] * block[1]) * 2  # edges: partial blocks


@pytest.mark.parity
def test_fp8_published_128_blocks_with_partial_edges(tmp_path):
    """128 x 128 blocks over widths they do not divide (DeepSeek-V3's 576-row kv_a_proj_with_mqa has a half block):
    transformers' CPU dequantization refuses those, so the reference reads the dequantized values in float32."""
    _fp8_checkpoint(tmp_path / "fp8", "deepseek_v3", (128, 128), hidden_size=160, intermediate_size=192)
    reference = dequantized_copy(tmp_path / "fp8", tmp_path / "f32")
    import support.reference as ref_module
    from engine.loader import load_model

    ours, theirs = load_model(tmp_path / "fp8"), load_model(reference)
    assert held(ours.model, (FP8Tensor,)) and not held(theirs.model, (FP8Tensor,))
    assert_matches_reference(reference, PROMPT, n_greedy=0)                # the float copy is right
    from engine.kv import KVCache

    a = ours.model.forward(PROMPT, KVCache(ours.spec, 64), all_logits=True)
    b = theirs.model.forward(PROMPT, KVCache(theirs.spec, 64), all_logits=True)
    assert ref_module.relative_error(a, b) < 1e-5


def _edit(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change,message", [
    (dict(activation_scheme="static"), "activation_scheme is 'static'"),
    (dict(fmt="e5m2"), "fmt is 'e5m2'"),
    (dict(weight_block_size=[128]), "weight_block_size is \\[128\\]"),
    (dict(weight_block_size=[16, 16]), "do not match weight_block_size \\[16, 16\\]"),
    (dict(weight_block_size=None), "has no weight_block_size"),
])
def test_fp8_config_errors_name_the_problem(tmp_path, change, message):
    from engine.errors import ModelFormatError
    from engine.loader import load_model

    _fp8_checkpoint(tmp_path, "qwen3_moe", (32, 32))
    _edit(tmp_path, **change)
    with pytest.raises(ModelFormatError, match=message):
        load_model(tmp_path)


def test_fp8_weight_without_its_scale_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.errors import ModelFormatError
    from engine.loader import load_model

    _fp8_checkpoint(tmp_path, "qwen3_moe", (32, 32))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="o_proj.weight has no model.layers.1.self_attn.o_proj.weight_scale_inv"):
        load_model(tmp_path)


KEEP_FLOAT = (("*embed_tokens*", 32), ("lm_head.weight", 32))   # float in the folder: float in the container


def _forward(loaded):
    from engine.kv import KVCache

    return loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), all_logits=True)


def test_fp8_converts_as_published_and_streams(tmp_path):
    """`colibri convert --bits 8` keeps FP8 matrices as they are: the container, held or with its experts
    streamed, gives the folder's logits bit for bit (the float tensors kept float)."""
    from app.hub.convert import ConvertSettings, convert
    from engine.formats.container import Container
    from engine.formats.hf import SafetensorsFolder
    from engine.loader import OffloadOptions, load_model
    from engine.offload.store import StoreSettings

    _fp8_checkpoint(tmp_path / "fp8", "qwen3_moe", (32, 32))
    out = convert(tmp_path / "fp8", tmp_path / "q8", ConvertSettings(bits=8, keep=KEEP_FLOAT),
                  log=lambda m: None)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    stored, published = Container.open(out).load(name), SafetensorsFolder(tmp_path / "fp8").load(name)
    assert isinstance(stored, FP8Tensor) and stored.block == published.block
    np.testing.assert_array_equal(stored.codes, published.codes)
    np.testing.assert_array_equal(stored.scales, published.scales)
    direct = _forward(load_model(tmp_path / "fp8"))
    np.testing.assert_array_equal(_forward(load_model(out)), direct)
    streamed = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 16)))
    try:
        np.testing.assert_array_equal(_forward(streamed), direct)
    finally:
        streamed.close()


def test_fp8_converts_below_8_bits_from_its_dequantized_values(tmp_path):
    """`colibri convert --bits 4` of an FP8 folder quantizes the values the FP8 weights stand for."""
    from app.hub.convert import ConvertSettings, convert
    from engine.formats.container import Container
    from engine.formats.hf import SafetensorsFolder
    from engine.loader import load_model
    from engine.quant import quantize

    _fp8_checkpoint(tmp_path / "fp8", "qwen3_moe", (32, 32))
    out = convert(tmp_path / "fp8", tmp_path / "q4", ConvertSettings(bits=4), log=lambda m: None)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    fp8 = SafetensorsFolder(tmp_path / "fp8").load(name)
    stored = Container.open(out).load(name)
    np.testing.assert_array_equal(stored.dequantize(), quantize(fp8.dequantize(), 4, 32).dequantize())
    # the container is the one a float32 folder of the dequantized values converts into: logits bit for bit
    same = convert(dequantized_copy(tmp_path / "fp8", tmp_path / "f32"), tmp_path / "f32q", ConvertSettings(bits=4),
                   log=lambda m: None)
    np.testing.assert_array_equal(_forward(load_model(out)), _forward(load_model(same)))
