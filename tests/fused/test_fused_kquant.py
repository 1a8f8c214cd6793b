"""The fused decode step on GGUF K-quant and IQ4 matrices: each tensor runs in its own type (Q2_K .. Q6_K, IQ4_XS,
and mixes with IQ4_NL, Q5_0 and Q8_0), routed experts too, with the same bits as the blocks, and greedy decoding picks
the same tokens."""

from __future__ import annotations

import json

import gguf
import numba
import numpy as np
import pytest

from engine.fused.plan import FusedDecode
from engine.kernels.kquant import KQUANT_FLAG
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from engine.quant import KQuantTensor
from engine.quant.kquant import KINDS
from support.batching import greedy_alone, greedy_together
from support.gguf_writer import write_gguf
from support.reference import build_checkpoint

Q = gguf.GGMLQuantizationType
PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9]
STEPS = 10
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
# every matrix in one K-quant type; then llama.cpp's Q4_K_M mix (Q6_K for V, down and the head), with a Q5_0 and a
# Q8_0 matrix as llama.cpp falls back to where rows are not whole super-blocks (the first key in a name wins)
CASES = {t.name: {"": t} for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)}
CASES["Q4_K_M-mix"] = {"attn_output": Q.Q8_0, "ffn_gate": Q.Q5_0, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K,
                       "output.weight": Q.Q6_K, "": Q.Q4_K}
CASES["IQ4_XS"] = {"": Q.IQ4_XS}
CASES["IQ4_NL-mix"] = {"attn_output": Q.IQ4_NL, "ffn_down": Q.Q6_K, "attn_k": Q.Q8_0, "": Q.IQ4_XS}


def _gguf(tmp_path, types: dict, family: str = "llama", **extra) -> str:
    from safetensors.numpy import load_file

    folder = build_checkpoint(tmp_path / "hf", family, **SHAPE, **extra)
    cfg = json.loads((folder / "config.json").read_text())
    write_gguf(tmp_path / "model.gguf", "llama", cfg, load_file(folder / "model.safetensors"), types)
    return str(tmp_path / "model.gguf")


def _greedy(model, fused: bool, pool: KVPool | None = None) -> tuple[np.ndarray, list[int]]:
    """STEPS greedy steps after PROMPT: their logits [STEPS, V] and tokens."""
    model.context.fused_decode = fused
    cache = KVCache(model.spec, 64, pool=pool)
    logits = model.forward(PROMPT, cache)[-1]
    out, tokens = [], []
    for _ in range(STEPS):
        tokens.append(int(logits.argmax()))
        logits = model.forward([tokens[-1]], cache)[-1]
        out.append(logits)
    cache.release()
    return np.stack(out), tokens


@pytest.fixture
def threads():
    before = numba.get_num_threads()
    yield numba.set_num_threads
    numba.set_num_threads(before)


@pytest.mark.parametrize("name", list(CASES))
def test_k_quant_fused_steps_equal_the_blocks(tmp_path, threads, name):
    types = CASES[name]
    loaded = load_model(_gguf(tmp_path, types))
    model = loaded.model
    mats = [model.lm_head] + [w for layer in model.layers for w in (
        layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.attn.wo, layer.ffn.weights.gate, layer.ffn.weights.up,
        layer.ffn.weights.down)]
    native = [w for w in mats if isinstance(w, KQuantTensor)]
    assert {w.qtype for w in native} == set(types.values()) & set(KINDS)       # held in their types, not widened
    want, want_tokens = _greedy(model, fused=False)
    assert model.context.fused is False                           # never built: the blocks ran every step
    for n in (1, 2):
        threads(n)
        got, tokens = _greedy(model, fused=True, pool=KVPool(model.spec, 32, block_size=4))
        plan = model.context.fused
        assert isinstance(plan, FusedDecode)                      # the fused step ran them, in their own types
        assert (plan.descs[:, 0] == KQUANT_FLAG).sum() == len(native) and plan.kquant is True
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n
        assert tokens == want_tokens, n
    loaded.close()


def test_k_quant_experts_in_the_fused_step_equal_the_blocks(tmp_path, threads):
    """A Q4_K_M MoE (Q4_K gate and up stacks, Q6_K down): the fused step runs each expert in its file's blocks."""
    types = {"ffn_down_exps": Q.Q6_K, "output.weight": Q.Q6_K, "": Q.Q4_K}
    loaded = load_model(_gguf(tmp_path, types, "mixtral", num_local_experts=4, num_experts_per_tok=2))
    model = loaded.model
    experts = [m for layer in model.experts.per_layer.values() for e in layer for m in (e.gate, e.up, e.down)]
    assert all(isinstance(m, KQuantTensor) for m in experts) and experts[2].qtype == Q.Q6_K
    want, want_tokens = _greedy(model, fused=False)
    for n in (1, 2):
        threads(n)
        got, tokens = _greedy(model, fused=True)
        plan = model.context.fused
        assert isinstance(plan, FusedDecode) and plan.moe and plan.kquant is True
        assert (plan.descs[:, 0] == KQUANT_FLAG).sum() >= len(experts)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n
        assert tokens == want_tokens, n
    loaded.close()


def test_a_batch_of_k_quant_experts_decodes_as_each_sequence_alone(tmp_path, threads, monkeypatch):
    """The batch's fused step on a Q4_K_M MoE (each expert the rows chose read once, in its file's blocks): every
    sequence gets the logits of its own single steps, bit for bit."""
    types = {"ffn_down_exps": Q.Q6_K, "output.weight": Q.Q6_K, "": Q.Q4_K}
    loaded = load_model(_gguf(tmp_path, types, "mixtral", num_local_experts=4, num_experts_per_tok=2))
    model = loaded.model
    prompts = [PROMPT, PROMPT[4:], PROMPT[:6]]
    pool = KVPool(model.spec, 3 * 20, block_size=4)
    alone = greedy_alone(model, pool, prompts, STEPS)
    for n in (1, 2):
        threads(n)
        got, calls = greedy_together(model, pool, prompts, STEPS, monkeypatch, 0)
        assert calls == STEPS                            # every step ran as the batch's step,
        assert model.context.batched.plan.kquant is True      # on K-quant blocks
        for k in range(len(prompts)):
            assert np.array_equal(got[k].view(np.uint32), alone[k].view(np.uint32)), (n, k)
    loaded.close()
