"""GGUF models: every quantization type the gguf package writes, llama.cpp's Q/K permutation, MoE stacks.

Each test converts a tiny random transformers checkpoint to GGUF the way llama.cpp lays it out,
then compares Colibri reading the GGUF with transformers running the same round-tripped weights.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from engine.kv import KVCache
from engine.loader import load_model
from support.gguf_writer import write_gguf
from support.reference import build_checkpoint, load_reference, reference_logits, relative_error

pytestmark = pytest.mark.parity   # each model read from a GGUF is run against transformers

Q = gguf.GGMLQuantizationType
PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140]


def _convert(tmp_path, model_type, arch, types, **overrides):
    from safetensors.numpy import load_file, save_file

    folder = build_checkpoint(tmp_path / "hf", model_type, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    back = write_gguf(tmp_path / "model.gguf", arch, cfg, tensors, types)
    # the reference reads a checkpoint holding exactly the values the GGUF holds
    rounded = tmp_path / "hf-roundtrip"
    rounded.mkdir()
    (rounded / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in back.items()}, rounded / "model.safetensors", metadata={"format": "pt"})
    return tmp_path / "model.gguf", load_reference(rounded), back


ROWS16_TYPES = {Q.Q4_0, Q.Q8_0}   # these take the rows16 layout (16 rows divide every tiny shape here)


def _check(path, ref, greedy: int = 16):
    """Colibri's logits for the GGUF against transformers' on the same values, then greedy tokens. Q4_0 and Q8_0
    matrices run with 8-bit activations (tests/kernels/test_rows16.py checks those kernels bit for bit): their
    logits are close to the float reference's, as a rows16 container's are, and greedy paths of a random model may
    part; every other type is exact to float rounding."""
    loaded = load_model(path)
    cache = KVCache(loaded.spec, 128)
    ours = loaded.model.forward(PROMPT, cache, all_logits=True)
    if {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1} & ROWS16_TYPES:
        assert relative_error(ours, reference_logits(ref, PROMPT)) < 5e-2
        return loaded
    assert relative_error(ours, reference_logits(ref, PROMPT)) < 1e-4
    seq = list(PROMPT)
    for _ in range(greedy):
        seq.append(int(reference_logits(ref, seq)[-1].argmax()))
    tokens, logits = [], ours[-1]
    for _ in range(greedy):
        tokens.append(int(logits.argmax()))
        logits = loaded.model.forward([tokens[-1]], cache)[-1]
    assert tokens == seq[len(PROMPT):]
    return loaded


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0])
def test_llama_every_writable_type(tmp_path, qtype):
    """One type for all matrices; Q and K are stored permuted as llama.cpp stores them."""
    path, ref, _ = _convert(tmp_path, "llama", "llama", {"": qtype})
    loaded = _check(path, ref)
    types = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1}
    assert types == {qtype}
    assert loaded.spec.architecture == "LlamaForCausalLM" and not loaded.spec.tie_embeddings
    if qtype in ROWS16_TYPES:
        assert loaded.model.layers[0].attn.wq.layout == "rows16"
        assert loaded.model.lm_head.layout == "planes"      # the head's logits keep float activations


def test_llama_mixed_types_and_tied_output(tmp_path):
    types = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
             "ffn_gate": Q.Q8_0, "ffn_up": Q.BF16, "ffn_down": Q.F16, "token_embd": Q.Q8_0}
    path, ref, _ = _convert(tmp_path, "llama", "llama", types, tie_word_embeddings=True,
                            num_key_value_heads=1)
    assert _check(path, ref).spec.tie_embeddings  # no output.weight: the embedding is the head


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama 3.1 GGUFs carry their RoPE scaling as a rope_freqs tensor, not as metadata."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    path, ref, _ = _convert(tmp_path, "llama", "llama", {"": Q.Q5_0}, rope_scaling=llama3, rope_theta=500000.0)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    _check(path, ref)


def test_qwen2_is_not_permuted(tmp_path):
    path, ref, _ = _convert(tmp_path, "qwen2", "qwen2", {"": Q.Q5_0})
    assert _check(path, ref).spec.architecture == "Qwen2ForCausalLM"


def test_qwen3_head_norms(tmp_path):
    path, ref, _ = _convert(tmp_path, "qwen3", "qwen3", {"": Q.Q5_1}, head_dim=24)
    assert _check(path, ref).spec.architecture == "Qwen3ForCausalLM"


def test_mixtral_as_llama_with_experts(tmp_path):
    """llama.cpp writes Mixtral as arch "llama" with expert stacks [E, out, in]."""
    path, ref, _ = _convert(tmp_path, "mixtral", "llama", {"": Q.Q5_0}, num_local_experts=4, num_experts_per_tok=2)
    loaded = _check(path, ref)
    assert loaded.spec.architecture == "MixtralForCausalLM" and loaded.spec.is_moe


def test_qwen2moe_shared_expert(tmp_path):
    path, ref, _ = _convert(tmp_path, "qwen2_moe", "qwen2moe", {"": Q.Q5_1}, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    assert _check(path, ref).spec.architecture == "Qwen2MoeForCausalLM"


def test_qwen3moe(tmp_path):
    path, ref, _ = _convert(tmp_path, "qwen3_moe", "qwen3moe", {"": Q.Q4_0}, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)
    assert _check(path, ref).spec.architecture == "Qwen3MoeForCausalLM"


def test_expert_tensors_are_views_of_one_stack(tmp_path):
    path, _, back = _convert(tmp_path, "mixtral", "llama", {"": Q.Q8_0}, num_local_experts=4, num_experts_per_tok=2)
    loaded = load_model(path)
    experts = loaded.model.experts.experts(0, [0, 3])
    stack = experts[0].gate.a.base
    while stack.base is not None:
        stack = stack.base
    assert np.shares_memory(experts[3].gate.a, stack)    # each expert a view of the repacked stack
    assert np.array_equal(experts[3].down.dequantize(), back["model.layers.0.block_sparse_moe.experts.3.w2.weight"])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0])
def test_block_formats_load_quantized_with_the_same_values(tmp_path, qtype):
    """Colibri runs these formats as they are: the model holds QuantizedTensors equal to gguf's dequantization."""
    from engine.quant import QuantizedTensor

    path, _, back = _convert(tmp_path, "llama", "llama", {"": qtype})
    model = load_model(path).model
    layer = model.layers[0]
    for w, name in ((layer.attn.wq, "self_attn.q_proj"), (layer.attn.wk, "self_attn.k_proj"),
                    (layer.ffn.weights.down, "mlp.down_proj")):
        assert isinstance(w, QuantizedTensor)
        assert np.array_equal(w.dequantize(), back[f"model.layers.0.{name}.weight"])   # q, k un-permuted too
    assert isinstance(layer.input_norm, np.ndarray) and layer.input_norm.dtype == np.float32
