"""Loop detection against hand-made sequences: loops of periods 1, 7 and 40 are found where they start,
near misses are not, and the per-token detector agrees with the whole-sequence search at every step."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generation.loops import Loop, LoopDetector, find_loop, trim_loop


def prose(n: int, seed: int = 0) -> list[int]:
    """n ids with no repeated stretch (each distinct), like text that goes somewhere."""
    return list(1000 + np.random.default_rng(seed).permutation(5000)[:n])


def detector_trace(tokens: list[int], **kw) -> list[Loop | None]:
    det = LoopDetector(**kw)
    return [det.push(t) for t in tokens]


def test_a_run_of_one_token_is_a_loop_of_period_one_once_long_enough():
    head = prose(30)
    tokens = head + [7] * 48
    assert find_loop(tokens) == Loop(period=1, start=30, length=48)
    assert find_loop(tokens[:-1]) is None       # 47 of them: not yet (a `----` rule is no loop)
    assert trim_loop(tokens, find_loop(tokens)) == head + [7]


def test_a_sentence_of_seven_tokens_repeating_is_found_where_it_starts():
    head, sentence = prose(25), [11, 12, 13, 14, 15, 16, 17]
    tokens = head + sentence * 7            # 49 tokens: 7 copies
    loop = find_loop(tokens)
    assert loop == Loop(period=7, start=25, length=49) and loop.repeats == 7
    assert trim_loop(tokens, loop) == head + sentence
    assert trim_loop(tokens, loop, keep=2) == head + sentence * 2
    assert find_loop(tokens[:-2]) is None        # 47 periodic tokens: below the least length


def test_a_long_period_needs_three_copies():
    head, paragraph = prose(10, seed=1), prose(40, seed=2)
    assert find_loop(head + paragraph * 2 + paragraph[:39]) is None
    loop = find_loop(head + paragraph * 3)
    assert loop == Loop(period=40, start=10, length=120)
    loop = find_loop(head + paragraph * 3 + paragraph[:5])     # a partial fourth copy is part of it
    assert loop == Loop(period=40, start=10, length=125) and loop.repeats == 3


def test_near_misses_are_no_loops():
    sentence = [21, 22, 23, 24, 25, 26, 27]
    broken = sentence * 4 + [21, 22, 23, 99, 25, 26, 27] + sentence * 2   # one token off in the middle
    assert find_loop(broken) is None
    assert find_loop(prose(500)) is None
    drift = [t for i in range(12) for t in (31, 32, 33, 34, 35, 36, 40 + i)]   # each copy ends differently
    assert find_loop(drift) is None
    assert find_loop(prose(20) + [5] * 20 + prose(20, seed=3) + [5] * 20) is None   # two short runs apart


def test_the_shortest_period_is_reported():
    assert find_loop([3, 4] * 40).period == 2       # also periodic at 4, 6, ...
    assert find_loop([9] * 200).period == 1


def test_the_detector_agrees_with_the_search_at_every_token():
    rng = np.random.default_rng(4)
    sentence = prose(7, seed=5)
    paragraph = prose(40, seed=6)
    tokens = (prose(30) + sentence * 3 + [1, 2] + [8] * 50 + prose(20, seed=7) + paragraph * 3
              + list(rng.integers(0, 3, 200)) + sentence * 8)
    trace = detector_trace(tokens)
    assert trace == [find_loop(tokens[: i + 1]) for i in range(len(tokens))]
    assert {loop.period for loop in trace if loop is not None} >= {1, 7, 40}


def test_the_detector_sees_periods_up_to_its_longest_only():
    paragraph = prose(50, seed=8)
    assert find_loop(paragraph * 3, max_period=49) is None
    assert detector_trace(paragraph * 3, max_period=49)[-1] is None
    assert detector_trace(paragraph * 3, max_period=50)[-1] == Loop(50, 0, 150)


def test_reset_forgets_the_tokens_seen():
    det = LoopDetector()
    for t in [4] * 47:
        assert det.push(t) is None
    det.reset()
    assert all(det.push(t) is None for t in [4] * 47)
    assert det.push(4) == Loop(1, 0, 48)


@pytest.mark.parametrize("kw", [{"max_period": 0}, {"min_repeats": 1}, {"min_tokens": 1}])
def test_settings_that_cannot_find_a_loop_are_refused(kw):
    with pytest.raises(ValueError, match="loop detection needs"):
        find_loop([1, 2, 3], **kw)
    with pytest.raises(ValueError, match="loop detection needs"):
        LoopDetector(**kw)
