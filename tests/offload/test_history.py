"""Usage history: decay, the sidecar file (exact, atomic, bound to its model), pinning, re-pinning."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.offload import history as history_module
from engine.offload.history import Repinner, UsageHistory


def _history(seed: int = 0, tokens: int = 50) -> UsageHistory:
    rng = np.random.default_rng(seed)
    h = UsageHistory(3, 8, "abc123", half_life_tokens=10.0)
    for _ in range(tokens):
        for layer in range(3):
            h.record(layer, rng.choice(8, size=(2, 2), p=np.arange(1, 9) / 36))  # [T, k]
        h.end_token()
    return h


def test_counts_halve_after_a_half_life():
    h = UsageHistory(2, 4, "m", half_life_tokens=8.0)
    h.record(1, np.array([[0, 3], [3, 2]]))                   # each occurrence counts 1
    assert h.counts.tolist() == [[0, 0, 0, 0], [1, 0, 1, 2]]
    h.end_token(8)
    np.testing.assert_allclose(h.counts, [[0, 0, 0, 0], [0.5, 0, 0.5, 1]], rtol=1e-15)
    for _ in range(8):                                       # one token at a time decays the same
        h.end_token()
    h.record(0, np.array([1]))                               # a fresh count is worth 1, not decayed
    np.testing.assert_allclose(h.counts, [[0, 1, 0, 0], [0.25, 0, 0.25, 0.5]], rtol=1e-14)
    assert h.tokens == 16


def test_lazy_decay_survives_long_runs():
    h = UsageHistory(1, 2, "m", half_life_tokens=2.0)
    h.record(0, np.array([0]))
    for _ in range(1000):                                    # far past the renormalization point
        h.end_token()
        h.record(0, np.array([1]))
    c = h.counts
    np.testing.assert_allclose(c[0, 0], 0.5 ** 500, rtol=1e-9)             # 1000 tokens = 500 half-lives
    np.testing.assert_allclose(c[0, 1], 1 / (1 - 0.5 ** 0.5), rtol=1e-9)  # geometric sum


def test_record_rejects_ids_outside_the_model():
    h = UsageHistory(2, 4, "m")
    with pytest.raises(ValueError, match="expert ids"):
        h.record(0, np.array([4]))
    with pytest.raises(ValueError, match="layer"):
        h.record(2, np.array([0]))


def test_record_steps_counts_as_record_does_step_by_step():
    rng = np.random.default_rng(5)
    one, many = (UsageHistory(4, 16, "m", half_life_tokens=3.0) for _ in range(2))
    for _ in range(20):
        layers = [int(layer) for layer in rng.permutation(4)[:3]]
        steps = [sorted(int(e) for e in rng.choice(16, size=4, replace=False)) for _ in layers]
        for layer, ids in zip(layers, steps):
            one.record(layer, np.asarray(ids))
        many.record_steps(layers, steps)
        one.end_token()
        many.end_token()
    np.testing.assert_array_equal(one.counts, many.counts)
    assert one.counts.sum() > 0
    with pytest.raises(ValueError, match="expert ids"):
        many.record_steps([0, 1], [[0], [16]])
    with pytest.raises(ValueError, match="layers"):
        many.record_steps([0, 4], [[0], [1]])
    many.record_steps([], [])                                # a token with no streamed step
    np.testing.assert_array_equal(one.counts, many.counts)
    one.record(2, np.array([3]))
    one.record(2, np.array([3]))
    many.record_steps([2, 2], [[3], [3]])                    # each occurrence counts, as in `record`
    np.testing.assert_array_equal(one.counts, many.counts)


def test_save_load_roundtrip_is_exact(tmp_path):
    h = _history()
    path = tmp_path / "usage.npz"
    h.save(path)
    back = UsageHistory.load(path, "abc123", 3, 8)
    assert np.array_equal(back.counts, h.counts)
    assert (back.tokens, back.half_life_tokens, back.model_hash) == (50, 10.0, "abc123")
    back.save(path)                                          # and again, bit for bit
    assert np.array_equal(UsageHistory.load(path, "abc123", 3, 8).counts, h.counts)


def test_the_learned_half_life_is_kept_and_older_files_load_without_it(tmp_path):
    h = _history()
    path = tmp_path / "usage.npz"
    h.save(path)
    assert UsageHistory.load(path, "abc123", 3, 8).policy_half_life is None
    h.policy_half_life = 2.0
    h.save(path)
    assert UsageHistory.load(path, "abc123", 3, 8).policy_half_life == 2.0
    with np.load(path) as z:                                 # a file written before the field existed
        fields = {k: z[k] for k in z.files if k != "policy_half_life_tokens"}
    np.savez(path, **fields)
    old = UsageHistory.load(path, "abc123", 3, 8)
    assert old.policy_half_life is None and np.array_equal(old.counts, h.counts)


def test_another_model_is_refused_by_name(tmp_path):
    path = tmp_path / "usage.npz"
    _history().save(path)
    with pytest.raises(ModelFormatError) as e:
        UsageHistory.load_or_new(path, "fff999", 3, 8)
    assert str(e.value) == (f"usage history {path} belongs to model abc123, not fff999: "
                            "delete it or pass the right model")


def test_another_shape_is_refused(tmp_path):
    path = tmp_path / "usage.npz"
    _history().save(path)
    with pytest.raises(ModelFormatError, match="3 layers x 9 experts"):
        UsageHistory.load(path, "abc123", 3, 9)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_files_are_refused(tmp_path, damage):
    path = tmp_path / "usage.npz"
    _history().save(path)
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":                                   # the last count's byte: the CRC fails
        info = zipfile.ZipFile(path).getinfo("counts.npy")
        i = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size - 1
        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
    elif damage == "garbage":
        data = b"not a history at all"
    else:
        data = b""
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match=f"usage history {path} is corrupt"):
        UsageHistory.load_or_new(path, "abc123", 3, 8)


def test_newer_version_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "usage.npz"
    monkeypatch.setattr(history_module, "VERSION", 2)
    _history().save(path)
    monkeypatch.setattr(history_module, "VERSION", 1)
    with pytest.raises(ModelFormatError, match="version 2, newer .* upgrade colibri"):
        UsageHistory.load(path, "abc123", 3, 8)


def test_load_or_new_starts_fresh_without_a_file(tmp_path):
    h = UsageHistory.load_or_new(tmp_path / "none.npz", "abc123", 3, 8)
    assert h.tokens == 0 and h.counts.shape == (3, 8) and not h.counts.any()
    with pytest.raises(ModelFormatError, match="not found"):
        UsageHistory.load(tmp_path / "none.npz", "abc123", 3, 8)


def test_failed_save_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "usage.npz"
    old = _history(seed=1)
    old.save(path)
    before = path.read_bytes()
    assert os.listdir(tmp_path) == ["usage.npz"]             # a good save leaves no temp file

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(history_module.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        _history(seed=2).save(path)
    assert os.listdir(tmp_path) == ["usage.npz"]
    assert path.read_bytes() == before


def test_pinned_picks_the_top_keys():
    h = UsageHistory(2, 4, "m")
    h.record(0, np.array([2, 2, 2, 1]))
    h.record(1, np.array([3, 3, 0]))
    assert h.pinned(2) == {(0, 2), (1, 3)}
    assert h.pinned(3) == {(0, 2), (1, 3), (0, 1)}           # ties go to the lower key
    assert h.pinned(2, exclude=[(0, 2)]) == {(1, 3), (0, 1)}
    assert h.pinned(100) == {(0, 2), (1, 3), (0, 1), (1, 0)}  # never-used keys are not pinned
    assert h.pinned(0) == frozenset()


def _shift(h: UsageHistory, hot: list[int], tokens: int) -> None:
    """`tokens` tokens that each route layer 0 to the experts in `hot`."""
    for _ in range(tokens):
        h.record(0, np.array(hot))
        h.end_token()


def test_repinner_swaps_only_beyond_the_margin():
    h = UsageHistory(1, 4, "m")
    h.record(0, np.array([0] * 10 + [1] * 8 + [2] * 9))     # 2 beats pinned 1, but 9 <= 1.25 * 8
    r = Repinner(capacity=2, margin=1.25, every_tokens=1)
    pinned = frozenset({(0, 0), (0, 1)})
    assert r.update(h, pinned, 0) == (frozenset(), frozenset())
    h.record(0, np.array([2, 2]))                            # 11 > 10: now it is worth the move
    assert r.update(h, pinned, 1) == ({(0, 2)}, {(0, 1)})


def test_repinner_follows_a_shifted_workload_and_waits_between_periods():
    h = UsageHistory(1, 6, "m", half_life_tokens=20.0)
    _shift(h, [0, 1], 100)
    r = Repinner(capacity=2, margin=1.25, every_tokens=16)
    assert r.update(h, frozenset(), 100) == ({(0, 0), (0, 1)}, frozenset())  # free slots fill
    pinned = frozenset({(0, 0), (0, 1)})
    _shift(h, [1, 4], 60)                                    # 4 replaces 0 in the workload
    assert r.update(h, pinned, 110) == (frozenset(), frozenset())  # 10 < 16 tokens since the last
    assert r.update(h, pinned, 116) == ({(0, 4)}, {(0, 0)})
    pinned = frozenset({(0, 1), (0, 4)})
    _shift(h, [5, 3], 60)
    assert r.update(h, pinned, 131) == (frozenset(), frozenset())
    assert r.update(h, pinned, 132) == ({(0, 3), (0, 5)}, {(0, 1), (0, 4)})


def test_repinner_never_pins_more_than_capacity():
    h = UsageHistory(2, 4, "m")
    h.record(0, np.array([0, 1, 2, 3]))
    h.record(1, np.array([0, 0, 0]))
    r = Repinner(capacity=2)
    pinned = frozenset({(0, 0), (0, 1), (0, 2), (9, 9)})      # too many, one stale
    to_pin, to_unpin = r.update(h, pinned, 0)
    after = (pinned - to_unpin) | to_pin
    assert len(after) == 2 and (1, 0) in after and (9, 9) not in after
