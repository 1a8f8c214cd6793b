"""Samplers and logits processors on hand-built distributions whose answers are known."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine.errors import GenerationError
from engine.generation.sampling import (
    History,
    SamplingParams,
    _draw,
    apply_processors,
    apply_temperature,
    greedy,
    make_logits_processors,
    make_sampler,
    min_p_filter,
    presence_frequency_penalty,
    repetition_penalty,
    softmax,
    top_k_filter,
    top_p_filter,
)


def logp(*probs: float) -> np.ndarray:
    """Float32 logits whose softmax is the given probabilities (0 -> -inf) to ~1e-7: the top
    logit is 0, so every other one is log(p_i / p_top) rounded once."""
    with np.errstate(divide="ignore"):
        x = np.log(np.array(probs, dtype=np.float64))
    return (x - x.max()).astype(np.float32)


def kept(filtered: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(filtered)).tolist())


def draws(params: SamplingParams, logits: np.ndarray, n: int) -> np.ndarray:
    s = make_sampler(params)
    return np.array([s(logits) for _ in range(n)])


# --------------------------------------------------------------------------- references


def ref_top_k(x: np.ndarray, k: int) -> set[int]:
    """Stable sort by descending logit, ties by id: the first k."""
    return set(np.argsort(-x.astype(np.float64), kind="stable")[:k].tolist())


def ref_top_p(x: np.ndarray, p: float) -> set[int]:
    """Stable sort by descending probability, ties by id: the shortest prefix with mass >= p."""
    probs = softmax(x)
    order = np.argsort(-probs, kind="stable")
    mass = np.cumsum(probs[order])
    j = int(np.searchsorted(mass, p - 1e-6, side="left"))
    return set(order[: j + 1].tolist())


def ref_min_p(x: np.ndarray, min_p: float) -> set[int]:
    probs = softmax(x)
    return set(np.flatnonzero(probs >= min_p * probs.max() * (1 - 1e-6)).tolist())


def distributions(vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Shapes that exercise every path of the filters: peaked, flat, tied, masked."""
    rng = np.random.default_rng(seed)
    peaked = rng.standard_normal(vocab) * 8
    flat = rng.standard_normal(vocab) * 0.7
    nearly_uniform = rng.uniform(0.0, 0.05, vocab)  # one log-probability bucket holds them all
    tied = rng.integers(0, 6, vocab).astype(np.float64) * 0.5  # few distinct values, many ties
    masked = flat.copy()
    masked[rng.random(vocab) < 0.9] = -np.inf  # most of the vocabulary forbidden
    return {
        name: arr.astype(np.float32)
        for name, arr in dict(
            peaked=peaked, flat=flat, nearly_uniform=nearly_uniform, tied=tied, masked=masked
        ).items()
    }


# --------------------------------------------------------------------------- greedy


def test_greedy_picks_argmax_and_breaks_ties_to_lowest_id():
    assert greedy(np.array([0.1, 2.0, -1.0, 1.9], dtype=np.float32)) == 1
    assert greedy(np.array([1.0, 3.0, 3.0, 3.0], dtype=np.float32)) == 1
    assert greedy(np.array([-np.inf, -5.0, -np.inf], dtype=np.float32)) == 1
    s = make_sampler(SamplingParams(temperature=0.0, top_k=1, seed=3))
    before = s.get_state()
    assert s(np.array([5.0, 1.0, 5.0], dtype=np.float32)) == 0
    assert s.get_state() == before  # greedy uses no randomness


def test_temperature_zero_ignores_filters_and_is_greedy():
    x = np.array([1.0, 4.0, 4.0, 0.0], dtype=np.float32)
    s = make_sampler(SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.9))
    assert [s(x) for _ in range(20)] == [1] * 20
    ids, probs = s.distribution(x)
    assert ids.tolist() == [1] and probs.tolist() == [1.0]


# --------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_of_logits_over_temperature(t):
    x = np.array([1.0, 0.2, -0.5, 0.0, 1.5, -1.0], dtype=np.float32)
    n = 20_000
    freq = np.bincount(draws(SamplingParams(temperature=t, seed=11), x, n), minlength=6) / n
    want = softmax(x / t)
    # Five standard deviations of a binomial frequency: a correct sampler passes (the seed is
    # fixed), and a wrong temperature cannot, as the check on the other temperatures shows.
    tol = 5 * np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(freq - want) <= tol), (freq, want, tol)
    for other in {0.5, 1.0, 2.0} - {t}:
        assert np.any(np.abs(softmax(x / other) - want) > 2 * tol)


def test_apply_temperature_divides_in_float64():
    x = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    out = apply_temperature(x, 0.5)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, np.array([2.0, -4.0, 1.0]))
    with pytest.raises(ValueError):
        apply_temperature(x, 0.0)


def test_softmax_is_float64_stable_and_zero_for_minus_inf():
    p = softmax(np.array([1000.0, 1000.0, -np.inf, 999.0], dtype=np.float32))
    assert p.dtype == np.float64
    assert p[2] == 0.0 and math.isclose(p.sum(), 1.0)
    assert math.isclose(p[0], p[1]) and math.isclose(p[3] / p[0], math.exp(-1))


# --------------------------------------------------------------------------- top_k


def test_top_k_keeps_the_k_largest():
    x = np.array([1.0, 3.0, 2.0, 2.5, 0.0], dtype=np.float32)
    assert kept(top_k_filter(x, 1)) == {1}
    assert kept(top_k_filter(x, 2)) == {1, 3}
    assert kept(top_k_filter(x, 3)) == {1, 2, 3}
    assert kept(top_k_filter(x, 0)) == set(range(5))  # off
    assert kept(top_k_filter(x, 9)) == set(range(5))
    out = top_k_filter(x, 2)
    assert out.dtype == np.float32 and out[1] == 3.0 and out[3] == 2.5


def test_top_k_ties_at_the_kth_value_go_to_the_lowest_ids():
    x = np.array([5.0, 2.0, 1.0, 2.0, 2.0], dtype=np.float32)
    assert kept(top_k_filter(x, 2)) == {0, 1}
    assert kept(top_k_filter(x, 3)) == {0, 1, 3}
    assert kept(top_k_filter(np.zeros(6, dtype=np.float32), 4)) == {0, 1, 2, 3}


@pytest.mark.parametrize("k", [1, 7, 40, 300, 2000])
def test_top_k_matches_a_full_stable_sort_on_large_vocabularies(k):
    for name, x in distributions(50_000, seed=k).items():
        assert kept(top_k_filter(x, k)) == ref_top_k(x, k), name


# --------------------------------------------------------------------------- top_p


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = logp(0.5, 0.25, 0.125, 0.125)
    assert kept(top_p_filter(x, 0.3)) == {0}
    assert kept(top_p_filter(x, 0.5)) == {0}  # mass hits p exactly: stop
    assert kept(top_p_filter(x, 0.75)) == {0, 1}  # mass hits p exactly: stop
    assert kept(top_p_filter(x, 0.75 + 1e-5)) == {0, 1, 2}  # just past it: one more
    assert kept(top_p_filter(x, 0.9)) == {0, 1, 2, 3}
    assert kept(top_p_filter(x, 1.0)) == {0, 1, 2, 3}  # off
    assert kept(top_p_filter(x, 1e-12)) == {0}  # always the top token


def test_top_p_follows_probability_not_id_order_and_ties_go_to_lowest_ids():
    assert kept(top_p_filter(logp(0.125, 0.5, 0.125, 0.25), 0.75)) == {1, 3}
    x = logp(0.2, 0.4, 0.2, 0.2)
    assert kept(top_p_filter(x, 0.6)) == {0, 1}
    assert kept(top_p_filter(x, 0.61)) == {0, 1, 2}
    assert kept(top_p_filter(logp(0.25, 0.25, 0.25, 0.25), 0.5)) == {0, 1}


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99, 0.99999])
def test_top_p_matches_a_full_stable_sort_on_large_vocabularies(p):
    for vocab in (300, 5000):
        for name, x in distributions(vocab, seed=int(p * 1e5)).items():
            assert kept(top_p_filter(x, p)) == ref_top_p(x, p), (vocab, name)


# --------------------------------------------------------------------------- min_p


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    x = logp(0.5, 0.125, 0.25, 0.0625, 0.0, 0.0625)
    assert kept(min_p_filter(x, 0.25)) == {0, 1, 2}  # 0.125 == 0.25 * 0.5: on the boundary, kept
    assert kept(min_p_filter(x, 0.25 + 1e-5)) == {0, 2}
    assert kept(min_p_filter(x, 0.125)) == {0, 1, 2, 3, 5}
    assert kept(min_p_filter(x, 1.0)) == {0}
    assert kept(min_p_filter(x, 0.0)) == {0, 1, 2, 3, 5}  # off (the -inf token stays out)
    x64 = np.log([0.4, 0.1, 0.3, 0.09])  # float64 logits work as well
    assert kept(min_p_filter(x64, 0.25)) == {0, 1, 2}
    assert kept(min_p_filter(logp(0.3, 0.3, 0.4 - 1e-3), 1.0)) == {2}
    assert kept(min_p_filter(logp(0.4, 0.2, 0.4), 1.0)) == {0, 2}  # ties at the top


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_matches_the_definition_on_large_vocabularies(min_p):
    for name, x in distributions(5000, seed=int(min_p * 100)).items():
        assert kept(min_p_filter(x, min_p)) == ref_min_p(x, min_p), name


# --------------------------------------------------------------------------- the chain


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(temperature=1.0, top_k=2), {0, 4}),
        (SamplingParams(temperature=1.0, top_p=0.6), {0, 4}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 4}),
        # T=2 weights sqrt(p); top_k drops 2, 5; top_p drops 1 (0.32 + 0.30 + 0.21 >= 0.8);
        # min_p drops 3 (0.387 < 0.7 * 0.592).
        (SamplingParams(temperature=2.0, top_k=4, top_p=0.8, min_p=0.7), {0, 4}),
    ],
)
def test_excluded_tokens_are_never_drawn(params, allowed):
    x = logp(0.3, 0.1, 0.05, 0.15, 0.35, 0.05)
    got = set(draws(SamplingParams(**{**params.__dict__, "seed": 5}), x, 10_000).tolist())
    assert got == allowed  # each allowed token is likely enough to appear in 10k draws


def test_sampler_distribution_equals_the_chain_of_pure_filters():
    for name, x in distributions(20_000, seed=8).items():
        for params in (
            SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
            SamplingParams(temperature=1.3, top_p=0.95),
            SamplingParams(temperature=0.9, min_p=0.2),
            SamplingParams(temperature=1.0),
        ):
            chained = apply_temperature(x, params.temperature)
            chained = min_p_filter(
                top_p_filter(top_k_filter(chained, params.top_k), params.top_p), params.min_p
            )
            ids, probs = make_sampler(params).distribution(x)
            assert set(ids.tolist()) == kept(chained), (name, params)
            np.testing.assert_allclose(probs, softmax(chained)[ids], rtol=1e-9, atol=1e-15)


def test_chain_order_is_top_k_then_top_p_then_min_p():
    # top_p over the two survivors of top_k (renormalised) keeps only the first of them.
    x = logp(0.4, 0.1, 0.3, 0.2)
    ids, probs = make_sampler(SamplingParams(temperature=1.0, top_k=2, top_p=0.55)).distribution(x)
    assert ids.tolist() == [0, 2] or ids.tolist() == [0]
    assert ids.tolist() == [0]  # 0.4 / 0.7 = 0.57 >= 0.55
    ids, _ = make_sampler(SamplingParams(temperature=1.0, top_k=2, top_p=0.6)).distribution(x)
    assert ids.tolist() == [0, 2]


def test_two_level_draw_matches_a_plain_cumulative_search():
    rng = np.random.default_rng(2)
    for vocab in (1000, 5000, 70_001):
        w = np.exp(rng.standard_normal(vocab) * 3)
        w[rng.random(vocab) < 0.3] = 0.0
        cdf = np.cumsum(w)
        for u in rng.random(300):
            want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
            assert _draw(w, float(u)) == want
            assert w[want] > 0


def test_draws_on_a_large_vocabulary_follow_the_distribution():
    vocab = 60_000
    x = np.full(vocab, -np.inf, dtype=np.float32)
    hot = np.array([7, 300, 12_345, 40_000, 59_999])
    x[hot] = np.log([0.1, 0.2, 0.3, 0.15, 0.25])
    n = 5000
    got = draws(SamplingParams(temperature=1.0, seed=4), x, n)
    assert set(got.tolist()) <= set(hot.tolist())
    freq = np.array([(got == h).mean() for h in hot])
    want = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n))


def test_bad_logits_are_refused_clearly():
    s = make_sampler(SamplingParams(temperature=1.0, seed=0))
    with pytest.raises(GenerationError, match="NaN"):
        s(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(GenerationError, match="masked"):
        s(np.full(3, -np.inf, dtype=np.float32))
    with pytest.raises(GenerationError, match="NaN"):
        make_sampler(SamplingParams())(np.array([np.inf, 0.0]))


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = np.array([2.0, -2.0, 0.5, -1.0, 3.0, 0.0], dtype=np.float32)
    out = repetition_penalty(x, [0, 1, 1, 1, 3, 5], 2.0)
    np.testing.assert_array_equal(out, np.array([1.0, -4.0, 0.5, -2.0, 3.0, 0.0], dtype=np.float32))
    assert out.dtype == np.float32
    out = repetition_penalty(x, [0, 1], 0.5)  # < 1 encourages repetition
    np.testing.assert_array_equal(out[:2], [4.0, -1.0])
    np.testing.assert_array_equal(repetition_penalty(x, [], 2.0), x)


def test_presence_and_frequency_penalties_subtract_by_presence_and_count():
    x = np.array([1.0, 1.0, -1.0, 0.0, 2.0], dtype=np.float32)
    out = presence_frequency_penalty(x, [1, 1, 1, 4], presence=0.5, frequency=0.25)
    np.testing.assert_allclose(out, [1.0, 1.0 - 0.5 - 0.75, -1.0, 0.0, 2.0 - 0.5 - 0.25])
    out = presence_frequency_penalty(x, [2, 2], presence=-1.0, frequency=0.0)
    np.testing.assert_allclose(out, [1.0, 1.0, 0.0, 0.0, 2.0])
    out = presence_frequency_penalty(x, [3, 3, 3], presence=0.0, frequency=-0.5)
    np.testing.assert_allclose(out, [1.0, 1.0, -1.0, 1.5, 2.0])


@pytest.mark.parametrize("vocab, length", [(64, 500), (10_000, 50)])
def test_penalties_on_short_and_long_histories(vocab, length):
    # Histories longer than vocab / 8 are counted over the vocabulary, shorter ones sorted.
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal(vocab).astype(np.float32)
    hist = rng.integers(0, min(vocab, 40), length)
    counts = np.bincount(hist, minlength=vocab)
    want = x - (0.3 + 0.1 * counts) * (counts > 0)
    np.testing.assert_allclose(presence_frequency_penalty(x, hist, 0.3, 0.1), want, rtol=1e-6)
    want = np.where(counts > 0, np.where(x > 0, x / 1.3, x * 1.3), x)
    np.testing.assert_allclose(repetition_penalty(x, list(hist), 1.3), want, rtol=1e-6)


def test_processors_read_the_history_they_declare_and_the_last_n():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    procs = make_logits_processors(params)
    x = np.array([2.0, 2.0, 2.0, 2.0, 2.0], dtype=np.float32)
    history = History.of(prompt=[0, 2], generated=[1, 1])
    out = apply_processors(x, history, procs)
    # repetition over prompt + generated {0, 1, 2}; presence/frequency over generated {1: 2}
    np.testing.assert_allclose(out, [1.0, 1.0 - 1.0 - 1.0, 1.0, 2.0, 2.0])
    # A plain sequence goes to every processor as it is.
    out = apply_processors(x, [3], procs)
    np.testing.assert_allclose(out, [2.0, 2.0, 2.0, 1.0 - 1.5, 2.0])
    # penalty_last_n windows each processor's own history.
    procs = make_logits_processors(SamplingParams(**{**params.__dict__, "penalty_last_n": 1}))
    out = apply_processors(x, History.of(prompt=[0, 2, 4], generated=[3, 1]), procs)
    np.testing.assert_allclose(out, [2.0, 1.0 - 1.5, 2.0, 2.0, 2.0])


def test_processor_list_and_plain_callables():
    assert make_logits_processors(SamplingParams(temperature=0.8, top_k=5)) == []
    assert [type(p).__name__ for p in make_logits_processors(SamplingParams(frequency_penalty=0.1))] == [
        "PresenceFrequencyPenalty"
    ]
    seen = []
    x = np.zeros(4, dtype=np.float32)
    apply_processors(x, History.of([0, 1], [2]), [lambda lg, ids: seen.append(list(ids)) or lg])
    assert seen == [[0, 1, 2]]  # no `wants`: the whole context
    assert apply_processors(x, [1], []) is x


def test_history_views_and_bad_ids():
    h = History.of([5, 6, 7], [8])
    assert list(h.prompt) == [5, 6, 7] and list(h.generated) == [8]
    assert list(h.view("context")) == [5, 6, 7, 8] and list(h.view("generated")) == [8]
    with pytest.raises(ValueError):
        History([1, 2], 3)
    with pytest.raises(GenerationError, match="outside the model's vocabulary"):
        repetition_penalty(np.zeros(4, dtype=np.float32), [1, 4], 1.5)
    with pytest.raises(GenerationError, match="outside the model's vocabulary"):
        presence_frequency_penalty(np.zeros(4, dtype=np.float32), [-1], 0.5, 0.0)


# --------------------------------------------------------------------------- seeds and state


def test_same_seed_same_draws_different_seeds_differ():
    x = np.linspace(-1, 1, 100).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    a, b = draws(p, x, 300), draws(p, x, 300)
    np.testing.assert_array_equal(a, b)
    c = draws(SamplingParams(**{**p.__dict__, "seed": 1235}), x, 300)
    assert (a != c).mean() > 0.5
    d, e = draws(SamplingParams(temperature=1.0), x, 300), draws(SamplingParams(temperature=1.0), x, 300)
    assert (d != e).mean() > 0.5  # seed None: fresh entropy each time


def test_saved_state_resumes_the_identical_stream():
    x = np.linspace(-2, 2, 500).astype(np.float32)
    s = make_sampler(SamplingParams(temperature=1.1, top_k=200, seed=99))
    head = [s(x) for _ in range(50)]
    saved = json.loads(json.dumps(s.get_state()))  # survives a JSON file
    tail = [s(x) for _ in range(50)]
    other = make_sampler(SamplingParams(temperature=1.1, top_k=200, seed=7))
    other.set_state(saved)
    assert [other(x) for _ in range(50)] == tail
    assert head != tail
    for bad in ({}, {**saved, "bit_generator": "MT19937"}, {**saved, "state": "zz"}):
        with pytest.raises(GenerationError, match="sampler state"):
            other.set_state(bad)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 1e-300),  # underflows to 0 in float32 logits
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.01),
        ("penalty_last_n", -1),
        ("seed", -5),
        ("seed", "abc"),
    ],
)
def test_validate_rejects_each_bad_value_naming_it(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(GenerationError, match=field):
        params.validate()
    with pytest.raises(GenerationError, match=field):
        make_sampler(params)
    with pytest.raises(GenerationError, match=field):
        make_logits_processors(params)


def test_validate_accepts_the_edges():
    SamplingParams().validate()
    SamplingParams(
        temperature=0.0, top_k=0, top_p=1.0, min_p=1.0, repetition_penalty=0.01,
        presence_penalty=-2.0, frequency_penalty=2.0, penalty_last_n=0, seed=0,
    ).validate()
    SamplingParams(temperature=5, top_p=1e-6, min_p=0.0, seed=2**70).validate()


# --------------------------------------------------------------------------- purity


def test_nothing_writes_into_its_input():
    x = np.array([0.5, -1.0, 2.0, 2.0, -np.inf, 0.0], dtype=np.float32)
    frozen = x.copy()
    frozen.flags.writeable = False  # any in-place write raises
    hist = [0, 2, 2, 4]
    outputs = [
        apply_temperature(frozen, 0.7),
        top_k_filter(frozen, 2),
        top_k_filter(frozen, 0),
        top_p_filter(frozen, 0.5),
        top_p_filter(frozen, 1.0),
        min_p_filter(frozen, 0.3),
        min_p_filter(frozen, 0.0),
        softmax(frozen),
        repetition_penalty(frozen, hist, 1.5),
        repetition_penalty(frozen, hist, 1.0),
        presence_frequency_penalty(frozen, hist, 0.5, 0.5),
        apply_processors(
            frozen, History.of([0, 1], [2, 2]),
            make_logits_processors(SamplingParams(repetition_penalty=1.2, presence_penalty=0.4)),
        ),
    ]
    for out in outputs:
        assert out is not frozen and not np.shares_memory(out, frozen)
    s = make_sampler(SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1, seed=1))
    s(frozen)
    s.distribution(frozen)
    make_sampler(SamplingParams())(frozen)
    np.testing.assert_array_equal(frozen, x)
