"""Fused checkpoint tensors cut into the engine's tensors (engine/formats/fused.py), on plain arrays."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.formats.fused import FusedTensor, Piece, split_fused


class ArraySource:
    """A TensorSource over a dict of float32 arrays (no stored bytes: pieces come from the whole tensor)."""

    path = "arrays"

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def names(self):
        return self.tensors.keys()

    def shape(self, name):
        return self.tensors[name].shape

    def load(self, name):
        return self.tensors[name]

    def location(self, name):
        return f"arrays:{name}"


# Phi-3's fused attention and MLP: q, k, v stacked by rows, gate then up by rows (not per expert)
PHI3 = (
    FusedTensor(r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", (
        Piece(r"model.layers.\1.self_attn.q_proj.weight", start=0, stop=8),
        Piece(r"model.layers.\1.self_attn.k_proj.weight", start=8, stop=12),
        Piece(r"model.layers.\1.self_attn.v_proj.weight", start=12, stop=16),
    )),
    FusedTensor(r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", (
        Piece(r"model.layers.\1.mlp.gate_proj.weight", start=0, stop=6),
        Piece(r"model.layers.\1.mlp.up_proj.weight", start=6, stop=12),
    )),
)


def test_rows_of_a_fused_matrix_become_tensors_of_their_own():
    rng = np.random.default_rng(0)
    qkv, gate_up = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(12, 8)).astype(np.float32)
    src = split_fused(ArraySource({"model.layers.3.self_attn.qkv_proj.weight": qkv,
                                   "model.layers.3.mlp.gate_up_proj.weight": gate_up, "other": np.zeros(2, np.float32)}),
                      PHI3)
    assert sorted(src.names()) == sorted(["other", "model.layers.3.self_attn.q_proj.weight",
                                          "model.layers.3.self_attn.k_proj.weight",
                                          "model.layers.3.self_attn.v_proj.weight", "model.layers.3.mlp.gate_proj.weight",
                                          "model.layers.3.mlp.up_proj.weight"])
    assert src.shape("model.layers.3.self_attn.k_proj.weight") == (4, 8)
    assert np.array_equal(src.load("model.layers.3.self_attn.v_proj.weight"), qkv[12:16])
    assert np.array_equal(src.load("model.layers.3.mlp.up_proj.weight"), gate_up[6:])
    assert src.location("model.layers.3.self_attn.q_proj.weight") == "arrays:model.layers.3.self_attn.qkv_proj.weight"


def test_per_expert_pieces_are_strided_and_transposed_copies_or_views():
    rng = np.random.default_rng(1)
    gate_up = rng.normal(size=(3, 8, 10)).astype(np.float32)        # [E, in, 2I] interleaved, gpt-oss style
    down = rng.normal(size=(3, 4, 8)).astype(np.float32)            # [E, out, in]: already [out, in]
    rules = (
        FusedTensor(r"(L)\.gate_up", (Piece(r"\1.experts.{e}.gate.weight", axis=1, step=2, transpose=True),
                                      Piece(r"\1.experts.{e}.up.weight", axis=1, start=1, step=2, transpose=True)),
                    per_expert=True),
        FusedTensor(r"(L)\.down", (Piece(r"\1.experts.{e}.down.weight"),), per_expert=True),
    )
    src = split_fused(ArraySource({"L.gate_up": gate_up, "L.down": down}), rules)
    assert len(list(src.names())) == 9
    gate = src.load("L.experts.2.gate.weight")
    assert src.shape("L.experts.2.gate.weight") == gate.shape == (5, 8)
    assert np.array_equal(gate, gate_up[2][:, ::2].T) and gate.flags.c_contiguous
    assert np.array_equal(src.load("L.experts.0.up.weight"), gate_up[0][:, 1::2].T)
    d = src.load("L.experts.1.down.weight")
    assert np.array_equal(d, down[1]) and np.shares_memory(d, down)   # contiguous already: a view, no copy


def test_a_source_without_fused_tensors_is_left_as_it_is():
    base = ArraySource({"model.layers.0.self_attn.q_proj.weight": np.zeros((2, 2), np.float32)})
    assert split_fused(base, PHI3) is base


def test_a_tensor_stored_both_fused_and_alone_is_refused():
    base = ArraySource({"model.layers.0.mlp.gate_up_proj.weight": np.zeros((12, 8), np.float32),
                        "model.layers.0.mlp.gate_proj.weight": np.zeros((6, 8), np.float32)})
    with pytest.raises(ModelFormatError, match="both on its own and inside a fused tensor"):
        split_fused(base, PHI3)
