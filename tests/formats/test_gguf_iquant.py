"""GGUF files holding IQ4_NL and IQ4_XS tensors load natively: KQuantTensors over the file's mapped bytes, each tensor
in its own type, with exactly the values gguf's dequantization gives."""

from __future__ import annotations

import json

import gguf
import numpy as np

from engine.formats.gguf_model import GGUFModel
from engine.quant import KQuantTensor
from support.gguf_writer import write_gguf
from support.reference import build_checkpoint

Q = gguf.GGMLQuantizationType
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def test_iq4_tensors_load_as_the_files_bytes(tmp_path):
    from safetensors.numpy import load_file

    folder = build_checkpoint(tmp_path / "hf", "llama", **SHAPE)
    cfg = json.loads((folder / "config.json").read_text())
    types = {"attn_output": Q.IQ4_NL, "ffn_down": Q.Q6_K, "": Q.IQ4_XS}
    back = write_gguf(tmp_path / "m.gguf", "llama", cfg, load_file(folder / "model.safetensors"), types)
    g = GGUFModel(tmp_path / "m.gguf", quantized=True)
    want = {"self_attn.o_proj": Q.IQ4_NL, "self_attn.q_proj": Q.IQ4_XS, "mlp.up_proj": Q.IQ4_XS, "mlp.down_proj": Q.Q6_K}
    for part, qtype in want.items():
        name = f"model.layers.1.{part}.weight"
        t = g.load(name)
        assert isinstance(t, KQuantTensor) and t.qtype == qtype, name
        if qtype in (Q.Q6_K, Q.IQ4_XS):      # reordered into the integer kernels' layout: a copy of the same bytes
            assert t.layout == "rows16" and not isinstance(_root(t.raw), np.memmap), name
        else:
            assert isinstance(_root(t.raw), np.memmap) or "q_proj" in name     # q's rows are un-permuted: a copy
        assert np.array_equal(t.rows(np.arange(t.shape[0])), back[name]), name
    head = g.load("lm_head.weight")
    assert isinstance(head, KQuantTensor) and head.qtype == Q.IQ4_XS and head.bits_per_weight == 4.25
