"""The bit planner's allocation and the calibration statistics, on hand-built inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.errors import ColibriError
from engine.plan.calibration import ActivationStats
from engine.plan.planner import (
    Option,
    _lower_hull,
    allocate,
    forced_bits,
    formats_for,
    group_for,
    measure_options,
    parse_keep_bits,
)


def _opts(*pairs):
    return [Option(bits, nbytes, err) for bits, (nbytes, err) in zip((2, 3, 4, 5, 6, 8), pairs)]


def _best_by_search(options, budget):
    """Exhaustive search over every combination: the optimum the greedy must approach."""
    names = list(options)
    best = None
    for combo in itertools.product(*(options[n] for n in names)):
        size = sum(o.nbytes for o in combo)
        if size <= budget:
            err = sum(o.error for o in combo)
            if best is None or err < best[0]:
                best = (err, combo)
    return best[0]


def test_allocation_spends_where_error_falls_fastest():
    options = {
        "sensitive": _opts((10, 100.0), (15, 40.0), (20, 10.0), (25, 5.0), (30, 3.0), (40, 1.0)),
        "robust": _opts((10, 2.0), (15, 1.5), (20, 1.0), (25, 0.8), (30, 0.7), (40, 0.5)),
    }
    chosen = allocate(options, budget=45)
    assert sum(o.nbytes for o in chosen.values()) <= 45
    assert chosen["sensitive"].bits > chosen["robust"].bits
    assert chosen["sensitive"].bits == 6 and chosen["robust"].bits == 3  # 30 + 15 bytes


@pytest.mark.parametrize("seed", range(20))
def test_allocation_is_near_the_exhaustive_optimum(seed):
    """On convex curves the greedy hull walk is within one step of the exhaustive optimum."""
    rng = np.random.default_rng(seed)
    options = {}
    for name in "abc":
        sizes = np.cumsum(rng.integers(3, 12, 6))
        errors = np.cumsum(rng.uniform(0.1, 5, 6))[::-1] * rng.uniform(0.5, 20)
        options[name] = [Option(b, int(s), float(e)) for b, s, e in zip((2, 3, 4, 5, 6, 8), sizes, errors)]
    lowest = sum(o[0].nbytes for o in options.values())
    highest = sum(o[-1].nbytes for o in options.values())
    budget = int(rng.integers(lowest, highest + 1))
    chosen = allocate(options, budget)
    got = sum(o.error for o in chosen.values())
    assert sum(o.nbytes for o in chosen.values()) <= budget
    assert got <= 1.5 * _best_by_search(options, budget) + 1e-9


def test_budget_below_the_minimum_is_a_clear_error():
    with pytest.raises(ColibriError, match="below the .* MB the matrices need at 2 bits"):
        allocate({"a": _opts((10, 1), (20, 0.5), (30, 0.2), (40, 0.1), (50, 0.05), (60, 0.01))}, budget=5)


def test_lower_hull_drops_dominated_and_concave_points():
    pts = [Option(2, 10, 10.0), Option(3, 20, 9.5), Option(4, 30, 2.0), Option(5, 40, 3.0), Option(6, 50, 1.0)]
    hull = _lower_hull(pts)
    assert [o.bits for o in hull] == [2, 4, 6]  # 3 is above the 2->4 chord, 5 costs more and is worse than 4


def test_keep_bits_patterns():
    keep = parse_keep_bits(["*lm_head*=8", "model.layers.*.self_attn.*=6", "model.layers.0.*=32"])
    assert forced_bits("lm_head.weight", keep) == 8
    assert forced_bits("model.layers.3.self_attn.q_proj.weight", keep) == 6
    assert forced_bits("model.layers.0.self_attn.q_proj.weight", keep) == 32  # the last match wins
    assert forced_bits("model.layers.3.mlp.up_proj.weight", keep) is None
    for bad in ("noequals", "x=7", "x=abc", "=4"):
        with pytest.raises(ColibriError, match="--keep-bits"):
            parse_keep_bits([bad])


def test_group_falls_back_to_a_divisor():
    assert group_for(1024, 128) == 128
    assert group_for(576, 128) == 64   # SmolLM2's hidden size: 576 = 9 x 64
    assert group_for(96, 64) == 32
    with pytest.raises(ColibriError):
        group_for(100, 32)


def test_formats_offer_groups_and_zero_points_priced_with_their_scales():
    fmts = formats_for(576)                        # SmolLM2's hidden size: groups 32 and 64 divide it, 128 does not
    assert {f.group for f in fmts} == {32, 64}
    assert {(f.bits, f.asymmetric) for f in fmts} == {(2, True), (3, False), (3, True), (4, False), (4, True),
                                                      (5, False), (6, False), (8, False)}

    w = np.random.default_rng(0).standard_normal((64, 576)).astype(np.float32)
    opts = {(o.bits, o.group, o.asymmetric): o for o in measure_options(w, None, 1.0, fmts)}
    weights = w.size
    assert opts[(4, 64, False)].nbytes * 8 / weights == pytest.approx(4.25)   # 4 bits + an fp16 scale per 64
    assert opts[(4, 64, True)].nbytes * 8 / weights == pytest.approx(4.5)     # + an fp16 zero point per 64
    assert opts[(4, 32, False)].error < opts[(4, 64, False)].error            # smaller groups fit better
    assert opts[(32, 0, False)].error == 0.0                                  # float32 is always offered


def test_activation_stats_energy_usage_and_roundtrip(tmp_path):
    stats = ActivationStats()
    x = np.array([[1.0, 2.0], [3.0, 0.0]], np.float32)
    stats("a", x)
    stats("b", x[:1])
    stats.tokens = 2
    assert np.allclose(stats.importance("a"), [5.0, 2.0])  # mean of squares per channel
    assert stats.usage("a") == 1.0 and stats.usage("b") == 0.5
    assert stats.importance("never") is None
    stats.save(str(tmp_path / "s.npz"))
    again = ActivationStats.load(str(tmp_path / "s.npz"))
    assert again.tokens == 2 and again.rows == stats.rows
    assert np.array_equal(again.importance("a"), stats.importance("a"))

