"""A GGUF holding K-quant tensors (a Q4_K_M's mix) runs them natively, against transformers on the same values."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from engine.kv import KVCache
from engine.loader import load_model
from engine.quant import KQuantTensor, QuantizedTensor
from support.gguf_writer import write_gguf
from support.reference import build_checkpoint, load_reference, reference_logits, relative_error

pytestmark = pytest.mark.parity

Q = gguf.GGMLQuantizationType
PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140]
# llama.cpp's Q4_K_M keeps V, the down projection and the output head in Q6_K; one Q5_0 matrix shows the mix
# with a type Colibri repacks (the first key found in a tensor's name wins; not Q8_0, whose 8-bit activations
# would blur the comparison with the float32 path: tests/formats/test_gguf.py covers it)
Q4_K_M = {"attn_output": Q.Q5_0, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output.weight": Q.Q6_K, "": Q.Q4_K}
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def _convert(tmp_path, types):
    from safetensors.numpy import load_file, save_file

    folder = build_checkpoint(tmp_path / "hf", "llama", **SHAPE)
    cfg = json.loads((folder / "config.json").read_text())
    back = write_gguf(tmp_path / "model.gguf", "llama", cfg, load_file(folder / "model.safetensors"), types)
    rounded = tmp_path / "hf-roundtrip"        # the reference holds exactly the values the GGUF decodes to
    rounded.mkdir()
    (rounded / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in back.items()}, rounded / "model.safetensors", metadata={"format": "pt"})
    return tmp_path / "model.gguf", load_reference(rounded), back


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def test_q4_k_m_mix_runs_natively_and_matches_the_reference(tmp_path):
    path, ref, back = _convert(tmp_path, Q4_K_M)
    file_types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert file_types["blk.0.attn_q.weight"] == Q.Q4_K and file_types["blk.1.ffn_down.weight"] == Q.Q6_K
    loaded = load_model(path)
    model = loaded.model
    layer = model.layers[1]
    raw_v = gguf.GGUFReader(str(path)).get_tensor(
        [t.name for t in gguf.GGUFReader(str(path)).tensors].index("blk.1.attn_v.weight")).data
    kinds = {"q": (layer.attn.wq, Q.Q4_K), "v": (layer.attn.wv, Q.Q6_K), "down": (layer.ffn.weights.down, Q.Q6_K),
             "up": (layer.ffn.weights.up, Q.Q4_K), "embed": (model.embed, Q.Q4_K), "head": (model.lm_head, Q.Q6_K)}
    for what, (w, qtype) in kinds.items():
        assert isinstance(w, KQuantTensor) and w.qtype == qtype, what
    assert isinstance(layer.attn.wo, QuantizedTensor) and layer.attn.wo.bits == 5
    # V holds the file's bytes in the integer kernels' order (a copy); the embedding stays the mapped file; q's rows
    # are un-permuted and equal gguf's values
    assert layer.attn.wv.layout == "rows16" and layer.attn.wq.layout == "rows16" and model.lm_head.layout == "blocks"
    assert np.array_equal(layer.attn.wv.blocks, np.asarray(raw_v).reshape(layer.attn.wv.raw.shape))
    assert isinstance(_root(model.embed.raw), np.memmap)
    assert np.array_equal(layer.attn.wq.rows(np.arange(layer.attn.wq.shape[0])),
                          back["model.layers.1.self_attn.q_proj.weight"])

    # Q4_K and Q6_K products round activations to 8 bits per 32-block (as llama.cpp's do): close to the float32
    # model of the same file, within the bound rows16 containers have (tests/hub/test_convert.py); a wrong mapping
    # is off by the logits' own scale
    cache = KVCache(loaded.spec, 128)
    ours = model.forward(PROMPT, cache, all_logits=True)
    assert relative_error(ours, reference_logits(ref, PROMPT)) < 5e-2


# a Q4_K_M MoE: Q4_K experts with the down stack in Q6_K, the head in Q6_K and one Q5_0 matrix beside them
MOE_TYPES = {"ffn_down_exps": Q.Q6_K, "attn_output": Q.Q5_0, "output.weight": Q.Q6_K, "": Q.Q4_K}
MOE = dict(num_local_experts=4, num_experts_per_tok=2, **SHAPE)


def _moe_gguf(tmp_path, seed: int = 0, **shape):
    """A tiny Mixtral-architecture GGUF of MOE_TYPES: its path and the values its tensors hold (HF names)."""
    from safetensors.numpy import load_file

    folder = build_checkpoint(tmp_path / "hf", "mixtral", seed=seed, **(MOE | shape))
    cfg = json.loads((folder / "config.json").read_text())
    back = write_gguf(tmp_path / "moe.gguf", "llama", cfg, load_file(folder / "model.safetensors"), MOE_TYPES)
    return tmp_path / "moe.gguf", back


def _greedy(model, spec, n: int) -> tuple[np.ndarray, list[int]]:
    """The prompt's logits [P, V] and n greedy tokens after it (the blocks, one token a step)."""
    cache = KVCache(spec, 64)
    logits = model.forward(PROMPT, cache, all_logits=True)
    tokens, last = [], logits[-1]
    for _ in range(n):
        tokens.append(int(last.argmax()))
        last = model.forward([tokens[-1]], cache)[-1]
    return logits, tokens


def test_k_quant_expert_stacks_run_as_the_files_blocks(tmp_path):
    """Each expert of a K-quant stack holds the file's blocks (the stack reordered once into the integer kernels'
    layout, each expert a view of it), and decoding stays close to the float32 path."""
    from engine.formats.gguf_model import GGUFModel
    from engine.loader import open_checkpoint
    from engine.models.transformer import Transformer

    path, back = _moe_gguf(tmp_path)
    g = GGUFModel(path, quantized=True)
    for name, qtype in (("w1", Q.Q4_K), ("w3", Q.Q4_K), ("w2", Q.Q6_K)):
        full = f"model.layers.1.block_sparse_moe.experts.2.{name}.weight"
        expert = g.load(full)
        assert isinstance(expert, KQuantTensor) and expert.qtype == qtype, name
        assert expert.layout == "rows16" and not expert.raw.flags.owndata    # a view of the reordered stack
        assert np.array_equal(expert.rows(np.arange(expert.shape[0])), back[full]), name
    loaded = load_model(path)
    experts = loaded.model.experts.per_layer[0]
    assert all(isinstance(m, KQuantTensor) for e in experts for m in (e.gate, e.up, e.down))
    ours, _ = _greedy(loaded.model, loaded.spec, 12)
    ckpt = open_checkpoint(path, quantized=False)                            # every tensor widened to float32
    plain = Transformer(ckpt.spec, ckpt.source)
    assert isinstance(plain.experts.per_layer[0][0].gate, np.ndarray)
    want, _ = _greedy(plain, ckpt.spec, 12)
    assert relative_error(ours, want) < 5e-2              # 8-bit activations: see the Q4_K_M test above
    loaded.close()


def test_k_quant_moe_holds_about_its_file_not_float32(tmp_path):
    """Loading a K-quant MoE allocates about its file (its Q4_K and Q6_K stacks reordered once, the file's pages given
    back), where widening the experts to float32 would take about 7 times it."""
    import os
    import tracemalloc

    path, _ = _moe_gguf(tmp_path, num_local_experts=16, num_hidden_layers=2)
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        loaded = load_model(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    spec = loaded.spec
    moe = spec.layers[0].ffn
    float32_experts = spec.n_layers * moe.n_experts * 3 * moe.expert_ffn * spec.hidden_size * 4
    assert float32_experts > 5 * size                                         # what the float32 path would hold
    assert peak < 1.5 * size, (peak, size)
    loaded.close()
