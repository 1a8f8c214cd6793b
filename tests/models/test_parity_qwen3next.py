"""Qwen3-Next against transformers, and its recurrent state through the cache's features.

Parity: prompt logits within 1e-4 of the largest logit and 32 greedy tokens identical (ours decoding
from the cache, the reference recomputing), over layer patterns, head groupings, shared expert on and
off, sparse steps and partial rotary. Then on a 4-bit container (row-invariant kernels): a batch gives
each sequence its solo logits, prefix reuse and speculative drafts leave outputs unchanged, and what
the state cannot do (go back further, eviction, the fused step) is declined (saved sessions and
checkpointed prefix reuse: tests/generation/test_recurrent_session.py, tests/kv/test_recurrent_checkpoints.py).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.errors import ColibriError, GenerationError, ModelFormatError
from engine.events import DoneEvent
from engine.fused.plan import FusedDecode, _NotFusable
from engine.generation.generate import GenerationRequest, generate_step
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import Scheduler
from engine.generation.speculative import SpeculativeSettings
from engine.kv import KVCache, KVPool, blocks_for
from engine.loader import load_model
from engine.models import spec_from_config
from engine.offload.budget import kv_bytes, working_bytes
from engine.spec import GatedDeltaNetSpec
from support.families import FAMILIES
from support.reference import (
    assert_matches_reference,
    build_checkpoint,
)

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32
SMALL = dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, linear_key_head_dim=16,
             linear_value_head_dim=16)
CASES = {
    # the default pattern (every 4th layer full), value heads grouped 2 per key head, a shared expert
    "interval-grouped-shared": dict(SMALL, num_hidden_layers=4, shared_expert_intermediate_size=48,
                                    linear_num_key_heads=2, linear_num_value_heads=4),
    # full layers first and between, MHA with biases, half the head rotated, no shared expert, unnormalised top-k,
    # a 3-tap convolution and key and value heads of different widths
    "alternating-bias-no-shared": dict(SMALL, num_hidden_layers=4, num_key_value_heads=4, attention_bias=True,
                                       layer_types=["full_attention", "linear_attention"] * 2,
                                       partial_rotary_factor=0.5, shared_expert_intermediate_size=0,
                                       norm_topk_prob=False, linear_conv_kernel_dim=3, linear_num_key_heads=4,
                                       linear_num_value_heads=4, linear_key_head_dim=8),
    # only recurrent layers, one key head for four value heads, top-1, tied embeddings (the reference's cache
    # needs an attention layer: it runs without one)
    "all-linear-mqa-top1-tied": dict(SMALL, layer_types=["linear_attention"] * 3, num_experts_per_tok=1,
                                     shared_expert_intermediate_size=32, linear_num_key_heads=1,
                                     linear_num_value_heads=4, tie_word_embeddings=True, use_cache=False),
    # dense layers by sparse step and mlp_only_layers, one KV head, the full rotary, YaRN
    "sparse-step-dense-yarn": dict(SMALL, num_hidden_layers=4, num_key_value_heads=1, decoder_sparse_step=2,
                                   mlp_only_layers=[3], shared_expert_intermediate_size=40,
                                   layer_types=["linear_attention", "full_attention", "linear_attention",
                                                "full_attention"],
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 128,
                                                    "partial_rotary_factor": 1.0},
                                   linear_num_key_heads=2, linear_num_value_heads=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_next_matches_transformers(case, tmp_path):
    folder = build_checkpoint(tmp_path / case, "qwen3_next", **CASES[case])
    loaded, ref, _ = assert_matches_reference(folder, PROMPT, N_GREEDY, architecture="Qwen3NextForCausalLM")
    assert loaded.spec.is_recurrent == ("linear_attention" in ref.config.layer_types)


# --- the cache's features on a 4-bit container ---

@pytest.fixture(scope="module")
def container(tmp_path_factory):
    model_type, overrides = FAMILIES["qwen3_next"]
    src = build_checkpoint(tmp_path_factory.mktemp("src"), model_type, **overrides)
    return convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)


@pytest.fixture(scope="module")
def model(container):
    loaded = load_model(container)
    yield loaded.model
    loaded.close()


def _solo(model, tokens: list[int], steps: int = 0) -> list[np.ndarray]:
    """Prompt logits, then those of `steps` greedy tokens, on a fresh private cache."""
    cache = KVCache(model.spec, 128)
    out = [model.forward(tokens, cache, all_logits=True)]
    for _ in range(steps):
        out.append(model.forward([int(out[-1][-1].argmax())], cache))
    return out


def test_a_prompt_in_pieces_gives_the_bits_of_one_pass(model):
    """Prefill in chunks (each running on from the state the last left) gives the one-pass logits, bit for bit."""
    whole = _solo(model, PROMPT)[0]
    cache = KVCache(model.spec, 64)
    pieces = [model.forward(PROMPT[a:b], cache, all_logits=True) for a, b in ((0, 7), (7, 8), (8, 20))]
    assert np.array_equal(np.concatenate(pieces), whole)


def test_the_fused_step_declines_deltanet_and_gated_attention(model, tmp_path):
    assert FusedDecode.for_model(model) is None
    with pytest.raises(_NotFusable, match="DeltaNet"):             # for that reason, not another
        FusedDecode(model)
    # gated full attention alone, dense: every other layer feature would fuse on a 4-bit container
    src = build_checkpoint(tmp_path / "gated", "qwen3_next", head_dim=16, num_experts=0,
                           layer_types=["full_attention"] * 2, num_hidden_layers=2)
    out = convert(src, tmp_path / "c", ConvertSettings(bits=4), log=lambda m: None)
    gated = load_model(out)
    try:
        assert not gated.spec.is_recurrent
        assert FusedDecode.for_model(gated.model) is None
        with pytest.raises(_NotFusable, match="gated attention output"):
            FusedDecode(gated.model)
    finally:
        gated.close()


def test_a_batch_gives_each_sequence_its_solo_result(model):
    prompts = [PROMPT[:9], PROMPT[4:], [7, 8, 9]]
    solo = [_solo(model, p, steps=3) for p in prompts]
    pool = KVPool(model.spec, 3 * (blocks_for(128) + 1))
    caches = [KVCache(model.spec, 128, pool=pool) for _ in prompts]
    got = [[x] for x in model.forward_batch(list(zip(prompts, caches)), all_logits=True)]
    for _ in range(3):        # one token of every sequence per pass
        rows = model.forward_batch([([int(g[-1][-1].argmax())], c) for g, c in zip(got, caches)])
        for g, r in zip(got, rows):
            g.append(r)
    for want, have in zip(solo, got):
        for a, b in zip(want, have):
            assert np.array_equal(a, b)


def test_prefix_reuse_falls_back_without_changing_outputs(model):
    """Another sequence's blocks are not adopted without a state checkpoint (blocks cannot rebuild the state;
    this pool is too small to set blocks aside for one: tests/kv/test_recurrent_checkpoints.py has room); the
    same sequence goes on from where it is when the prompt extends what it holds, and starts afresh when it
    diverges."""
    pool = KVPool(model.spec, 4 * (blocks_for(128) + 1), block_size=4)
    first = KVCache(model.spec, 128, pool=pool)
    model.forward(PROMPT, first)
    other = KVCache(model.spec, 128, pool=pool)
    assert other.adopt(PROMPT + [3, 4]) == 0                       # full blocks exist, yet none is taken
    assert pool.checkpoints.made == 0

    longer = PROMPT + [33, 44, 55]
    assert first.adopt(longer) == len(PROMPT)                      # the sequence itself goes on
    assert np.array_equal(model.forward(longer[len(PROMPT):], first, all_logits=True)[-1],
                          _solo(model, longer)[0][-1])
    diverged = PROMPT[:10] + [1, 2, 3]
    assert first.adopt(diverged) == 0                              # cannot go back to 10: runs afresh
    assert np.array_equal(model.forward(diverged, first)[-1], _solo(model, diverged)[0][-1])


def test_the_scheduler_batches_and_chunks_without_changing_tokens(model):
    """Requests sharing a prefix, prefilled in chunks beside others' decoding, give their solo tokens."""
    prompts = [PROMPT[:12], PROMPT[:8] + [9, 31], PROMPT[3:] + [6, 18, 44, 2, 90], [7]]
    greedy = SamplingParams()
    want = [list(itertools.islice(generate_step(model, p, KVCache(model.spec, 64), greedy), 10)) for p in prompts]
    sched = Scheduler(model, KVPool(model.spec, 64, block_size=4), max_len=64, prefill_chunk=8)
    seqs = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=10, sampling=greedy)) for p in prompts]
    sched.run()
    got = [[e for e in s.drain() if isinstance(e, DoneEvent)][0].tokens for s in seqs]
    assert [list(g) for g in got] == want
    assert sched.pool.hits == 0 and sched.pool.used_blocks == 0


def test_truncating_into_the_last_short_step_and_no_further(model):
    cache = KVCache(model.spec, 128)
    model.forward(PROMPT, cache)
    model.forward([4, 5, 6, 7], cache)
    cache.truncate(len(PROMPT) + 2)                                # back into the last step: kept states
    ours = model.forward([9], cache)
    assert np.array_equal(ours, _solo(model, PROMPT + [4, 5, 9])[0][-1:])
    with pytest.raises(GenerationError, match="recurrent state"):
        cache.truncate(5)
    cache.truncate(0)
    assert cache.length == 0 and np.array_equal(model.forward(PROMPT, cache), _solo(model, PROMPT)[0][-1:])


def test_speculative_drafts_give_the_plain_tokens(model):
    prompt = [5, 17, 99, 3, 42, 7] * 4                             # prompt lookup finds n-grams to copy
    greedy = SamplingParams()
    plain = list(itertools.islice(generate_step(model, prompt, KVCache(model.spec, 128), greedy), 24))
    settings = SpeculativeSettings(max_draft=4, adaptive=False)
    cache = KVCache(model.spec, 128)
    drafted = list(itertools.islice(generate_step(model, prompt, cache, greedy, speculative=settings), 24))
    assert drafted == plain


def test_what_the_state_cannot_do_is_refused(model):
    with pytest.raises(ColibriError, match="overflow 'slide'"):
        KVCache(model.spec, 128, overflow="slide")


def test_memory_figures_count_a_state_per_sequence(model):
    """The recurrent layers add their state once (held and the next step's), not per token; only the full
    attention layers' keys and values grow with the context."""
    spec = model.spec
    full = [layer.attn for layer in spec.layers if not isinstance(layer.attn, GatedDeltaNetSpec)]
    states = [layer.attn for layer in spec.layers if isinstance(layer.attn, GatedDeltaNetSpec)]
    state = sum(4 * int(np.prod(shape)) for a in states for shape in a.state_shapes)
    per_token = sum(2 * a.n_kv_heads * (a.head_dim * 4 + 4) for a in full)
    assert kv_bytes(spec, 0) == 2 * state and kv_bytes(spec, 100) == 2 * state + 100 * per_token
    assert working_bytes(spec, 100) > 0
    cache = KVCache(spec, 128)
    model.forward(PROMPT, cache)
    assert cache.nbytes == len(cache.table) * cache.pool.block_bytes + state


# --- config reading ---

def _config(**over) -> dict:
    base = dict(architectures=["Qwen3NextForCausalLM"], hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, vocab_size=160, num_experts=4, num_experts_per_tok=2,
                linear_num_key_heads=2, linear_num_value_heads=4)
    return {**base, **over}


def test_reference_defaults_are_read():
    spec = spec_from_config(_config())
    kinds = [type(layer.attn).__name__ for layer in spec.layers]
    assert kinds == ["GatedDeltaNetSpec"] * 3 + ["AttentionSpec"]   # full_attention_interval 4
    full = spec.layers[3].attn
    assert full.head_dim == 256 and full.rope.dim == 64 and full.output_gate and full.n_kv_heads == 2
    linear = spec.layers[0].attn
    assert isinstance(linear, GatedDeltaNetSpec)
    assert (linear.k_head_dim, linear.v_head_dim, linear.conv_kernel) == (128, 128, 4)
    assert spec.layers[0].ffn.shared_ffn == 512 and spec.layers[0].ffn.norm_topk_prob
    assert spec.norm_offset == 1.0
    interval = spec_from_config(_config(full_attention_interval=2))
    assert [type(layer.attn).__name__ for layer in interval.layers] == ["GatedDeltaNetSpec", "AttentionSpec"] * 2


@pytest.mark.parametrize("over, key", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(full_attention_interval=0), "full_attention_interval"),
])
def test_unsupported_values_are_refused(over, key):
    with pytest.raises(ModelFormatError, match=key):
        spec_from_config(_config(**over))
