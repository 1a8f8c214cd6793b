"""Recurrent-state checkpoints: a hybrid model's sequences share cached prefixes through snapshots of their
DeltaNet layers' states at block boundaries, and the recurrence runs a whole step in one call.

The kernel against plain numpy; then, on a tiny Qwen3-Next 4-bit container: greedy output and logits the
same whatever the chunking, a new sequence restoring the longest checkpointed boundary with outputs equal
to no reuse, and checkpoints bounded by (and counted in) the pool's blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels.deltanet import delta_rule
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from engine.recurrent import state_bytes
from support.recurrent import PROMPT, greedy_run, qwen3_next_container


def _reference(rec, q, k, v, decay, beta):
    """The gated delta rule token by token in float64: outputs [T, H, Dv] and the state after each token."""
    s, outs, states = rec.astype(np.float64), [], []
    for t in range(q.shape[0]):
        s = s * decay[t][:, None, None]                                       # [H, Dk, Dv]
        pred = np.einsum("hk,hkv->hv", k[t], s)                               # [H, Dv]
        s = s + np.einsum("hk,hv->hkv", k[t], (v[t] - pred) * beta[t][:, None])
        outs.append(np.einsum("hk,hkv->hv", q[t], s))
        states.append(s)
    return np.stack(outs), states


def test_the_kernel_matches_numpy_and_copies_out_the_states_asked_for():
    rng = np.random.default_rng(0)
    t, h, dk, dv = 9, 3, 8, 5
    q, k = (rng.normal(size=(t, h, dk)).astype(np.float32) * 0.3 for _ in range(2))
    v = rng.normal(size=(t, h, dv)).astype(np.float32)
    decay = rng.uniform(0.5, 1.0, size=(t, h)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(t, h)).astype(np.float32)
    rec0 = rng.normal(size=(h, dk, dv)).astype(np.float32)
    want, states = _reference(rec0, q, k, v, decay, beta)
    rec, out = rec0.copy(), np.empty((t, h, dv), np.float32)
    keep = np.array([1, 4, 4, 8], np.int64)
    kept = np.empty((len(keep), h, dk, dv), np.float32)
    delta_rule(rec, q, k, v, decay, beta, out, keep, kept)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rec, states[-1], rtol=1e-5, atol=1e-5)
    for m, c in enumerate(keep):
        np.testing.assert_allclose(kept[m], states[c - 1], rtol=1e-5, atol=1e-5)
    # one call over the step gives the bits of a call per token
    step, out1 = rec0.copy(), np.empty_like(out)
    none = np.empty((0, h, dk, dv), np.float32)
    for i in range(t):
        a = slice(i, i + 1)
        delta_rule(step, q[a], k[a], v[a], decay[a], beta[a], out1[a], np.empty(0, np.int64), none)
    assert np.array_equal(out1, out) and np.array_equal(step, rec)
    assert np.array_equal(kept[1], kept[2])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    loaded = load_model(qwen3_next_container(tmp_path_factory.mktemp("q3n")))
    yield loaded.model
    loaded.close()


def _chunked(model, tokens, chunk, cache):
    return np.concatenate([model.forward(tokens[a : a + chunk], cache, all_logits=True)
                           for a in range(0, len(tokens), chunk)])


@pytest.mark.parametrize("block_size", [4, 32])
def test_chunking_changes_no_bit_of_logits_or_greedy_tokens(model, block_size):
    """Prompt chunks short (kept per token), long, and crossing block boundaries (checkpointed) give one pass's
    logits and greedy continuation."""
    prompt = PROMPT * 2                                           # 40 tokens
    want, tokens = greedy_run(model, prompt, 8)
    for chunk in (1, 3, 16, 17, 40):
        pool = KVPool(model.spec, 400, block_size=block_size)
        cache = KVCache(model.spec, 128, pool=pool)
        got = _chunked(model, prompt, chunk, cache)
        assert np.array_equal(got, want), chunk
        _, more = greedy_run(model, [tokens[0]], 7, cache)
        assert [tokens[0]] + more[:7] == tokens, chunk


def _pool(model, n_blocks=400):
    return KVPool(model.spec, n_blocks, block_size=4)


def test_a_new_sequence_goes_on_from_the_longest_checkpoint(model):
    pool = _pool(model)
    first = KVCache(model.spec, 128, pool=pool)
    model.forward(PROMPT[:17], first)        # a long step: the state at its last boundary, 16
    model.forward(PROMPT[17:], first)        # a short one: at each boundary it crosses, 20
    cps = pool.checkpoints
    assert cps.made == 2 and cps.reserved > 0 and cps.nbytes == 2 * state_bytes([s.state() for s in first.states])
    for prompt, held in ((PROMPT + [3, 4], 20),                   # the whole prompt's state
                         (PROMPT[:18] + [8, 8, 8], 16),           # blocks up to 16 match, and its checkpoint
                         (PROMPT[:15] + [1, 2], 0),               # blocks to 12 match, no checkpoint there
                         ([6] + PROMPT, 0)):                      # nothing shared
        used = cps.used
        other = KVCache(model.spec, 128, pool=pool)
        assert other.adopt(prompt) == held
        assert cps.used == used + (held > 0)
        logits, tokens = greedy_run(model, prompt[held:], 6, other)
        want, want_tokens = greedy_run(model, prompt, 6)
        assert np.array_equal(logits, want[held:]) and tokens == want_tokens
        other.release()
    # the first sequence moves on: its own cached prefix and checkpoints still serve a diverging prompt
    assert first.adopt(PROMPT[:17] + [9, 9]) == 16
    logits, _ = greedy_run(model, [9, 9], 0, first)
    assert np.array_equal(logits, greedy_run(model, PROMPT[:16] + [9, 9], 0)[0][16:])


def test_checkpoints_are_bounded_counted_and_give_way_to_sequences(model):
    pool = _pool(model, n_blocks=120)
    cps = pool.checkpoints
    cost = cps.cost([s.state() for s in KVCache(model.spec, 128).states])
    assert cost is not None and 1 < cost <= cps.limit and cps.useful
    assert cps.snapshot_bytes == state_bytes([s.state() for s in KVCache(model.spec, 128).states])
    small = KVPool(model.spec, 2 * cost - 1, block_size=4)       # too few blocks to set aside for one
    assert not small.checkpoints.useful and KVCache(model.spec, 128, pool=small).checkpoint_boundaries(40) == []
    seqs = []
    for i in range(6):                                            # distinct prompts, each checkpointed once
        cache = KVCache(model.spec, 128, pool=pool)
        model.forward([i + 1] * 8, cache)
        seqs.append(cache)
        assert cps.reserved <= cps.limit and cps.reserved == cost * len(cps.entries)
    assert 0 < len(cps.entries) < 6                               # the oldest made room for newer ones
    assert pool.nbytes == ((pool.n_blocks - len(pool.free) - cps.reserved) * pool.block_bytes + cps.nbytes)
    # a sequence that needs the blocks set aside gets them: snapshots go before a KVFullError
    for cache in seqs:
        cache.release()
    pool.drop_cached()
    assert not cps.entries and cps.reserved == 0
    for i in range(3):
        model.forward([i + 1] * 8, KVCache(model.spec, 128, pool=pool))   # checkpoints, left cached
    big = KVCache(model.spec, 4 * (pool.n_blocks - 6), pool=pool)
    big.positions(4 * (pool.n_blocks - 6))                        # takes nearly every block
    assert not cps.entries and cps.reserved == 0


def test_a_pool_without_prefix_cache_keeps_no_checkpoints(model):
    pool = KVPool(model.spec, 400, block_size=4, prefix_cache=False)
    assert pool.checkpoints is None
    cache = KVCache(model.spec, 128, pool=pool)
    assert np.array_equal(_chunked(model, PROMPT, 7, cache), greedy_run(model, PROMPT, 0)[0])
    assert KVCache(model.spec, 128, pool=pool).adopt(PROMPT + [1]) == 0


def test_a_model_of_recurrent_layers_only_has_no_blocks_to_charge_checkpoints_to():
    """Its pool's blocks hold no bytes: checkpoints would not be counted in the budget, so none is kept."""
    from engine.models import spec_from_config
    spec = spec_from_config(dict(architectures=["Qwen3NextForCausalLM"], hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, vocab_size=160, num_experts=4, num_experts_per_tok=2,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                 linear_value_head_dim=16, layer_types=["linear_attention"] * 2))
    pool = KVPool(spec, 64, block_size=4)
    states = [KVCache(spec, 64, pool=pool).states[0].state()]
    assert pool.block_bytes == 0 and pool.checkpoints.cost(states) is None and not pool.checkpoints.useful
    assert not pool.checkpoints.put(b"d" * 16, states) and not pool.checkpoints.entries


def test_a_shared_prefix_is_checkpointed_where_prompts_part(model):
    """A system prompt ending inside a step gets no checkpoint from its first run; the second prompt sharing it
    finds its blocks without one, runs afresh and checkpoints where they stop matching; the third resumes
    there. Every output equals no reuse."""
    pool = _pool(model)
    system = PROMPT[:14]                                          # blocks match up to 12
    held = []
    for tail in ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]):
        prompt = system + tail
        cache = KVCache(model.spec, 128, pool=pool)
        held.append(cache.adopt(prompt))
        logits, tokens = greedy_run(model, prompt[held[-1]:], 4, cache)
        want, want_tokens = greedy_run(model, prompt, 4)
        assert np.array_equal(logits, want[held[-1]:]) and tokens == want_tokens
        cache.release()
    assert held == [0, 0, 12]


def test_drafts_rolled_back_across_boundaries_leave_only_true_checkpoints(model):
    """Speculative steps cross block boundaries and roll rejected drafts back: the tokens are the plain ones,
    and a sequence resuming from what that left in the pool gets the outputs of no reuse."""
    import itertools

    from engine.generation.generate import generate_step
    from engine.generation.sampling import SamplingParams
    from engine.generation.speculative import SpeculativeSettings

    prompt = [5, 17, 99, 3, 42, 7] * 4                            # prompt lookup finds n-grams to copy
    greedy = SamplingParams()
    plain = list(itertools.islice(generate_step(model, prompt, KVCache(model.spec, 128), greedy), 24))
    pool = _pool(model)
    cache = KVCache(model.spec, 128, pool=pool)
    settings = SpeculativeSettings(max_draft=4, adaptive=False)
    assert list(itertools.islice(generate_step(model, prompt, cache, greedy, speculative=settings), 24)) == plain
    assert pool.checkpoints.made > 1
    cache.release()
    helds = []
    for n in (26, 31, 40):                                        # resume inside what the drafts went through
        other = KVCache(model.spec, 128, pool=pool)
        full = prompt + plain[: n - len(prompt)] + [1]
        held = other.adopt(full)
        helds.append(held)
        logits, tokens = greedy_run(model, full[held:], 3, other)
        want, want_tokens = greedy_run(model, full, 3)
        assert np.array_equal(logits, want[held:]) and tokens == want_tokens
        other.release()
    assert helds[0] == 24 and helds[1] > 24 and helds[2] > helds[1]
