"""Kills at seeded points of `colibri convert` and of session saves: a rerun ends byte-identical to an
uninterrupted run, and what a killed save leaves always loads.

The kill points are file-system steps (tests/support/faults.py): every write is split in two and each
half is a step, as is each rename, unlink and truncate, so kills fall inside data files, journal lines,
atomic writes and the final rename. A seeded RNG draws one point in each stretch of a run. `colibri pull
smollm2-moe` makes its container with this same `convert` (app/hub/pull.py); the model it upcycles first
takes minutes, so the kills run on a tiny Mixtral instead.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from support.faults import REPO, kill_points, kill_when, line_count, run_with_kills, tree_bytes
from support.reference import build_checkpoint

SEED = 29


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=4, num_experts_per_tok=2)


def _convert_argv(src: Path, out: Path) -> list[str]:
    return ["convert", str(src), str(out), "--bits", "4"]


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory) -> tuple[dict[str, bytes], int]:
    """(the container's files, the steps an uninterrupted conversion takes)."""
    work = tmp_path_factory.mktemp("reference")
    [run] = run_with_kills([(_convert_argv(src, work / "out"), 0)], work)
    assert run.returncode == 0, run.stderr
    return tree_bytes(work / "out"), run.steps


def _killed_then_resumed(src: Path, work: Path, points: list[int], reference: dict[str, bytes]) -> None:
    """Per point, a fresh OUT: one run killed there, one that resumes; each OUT equals the reference."""
    runs = []
    for i, point in enumerate(points):
        argv = _convert_argv(src, work / f"out{i}")
        runs += [(argv, point), (argv, 0)]
    results = run_with_kills(runs, work)
    for i, point in enumerate(points):
        killed, resumed = results[2 * i], results[2 * i + 1]
        assert killed.killed, f"step {point}: the run ended ({killed.returncode}) before it: {killed.stderr}"
        assert resumed.returncode == 0, f"killed at step {point}, the rerun failed: {resumed.stderr}"
        assert "Traceback" not in resumed.stderr
        assert tree_bytes(work / f"out{i}") == reference, f"killed at step {point}: the container differs"
        assert not (work / f"out{i}.partial").exists()


def test_convert_killed_at_seeded_points_resumes_byte_identical(src, reference, tmp_path):
    files, steps = reference
    _killed_then_resumed(src, tmp_path, kill_points(random.Random(SEED), steps, 3), files)


@pytest.mark.slow
def test_convert_killed_anywhere_resumes_byte_identical(src, reference, tmp_path):
    files, steps = reference
    # spread over the run, and each of the last steps: the manifest, the journal's removal, the rename
    points = kill_points(random.Random(SEED + 1), steps, 6) + [steps - 3, steps - 2, steps - 1, steps]
    _killed_then_resumed(src, tmp_path, points, files)


@pytest.mark.slow
def test_convert_killed_again_while_resuming_still_ends_byte_identical(src, reference, tmp_path):
    files, steps = reference
    rng = random.Random(SEED + 2)
    argv = _convert_argv(src, tmp_path / "out")
    # the first kill is a point of the whole run; the later ones fall early in each (shorter) resumed run
    runs = run_with_kills([(argv, rng.randrange(steps // 4, steps // 2)), (argv, rng.randrange(2, 40)),
                           (argv, rng.randrange(2, 40)), (argv, 0)], tmp_path)
    assert [r.killed for r in runs] == [True, True, True, False], [r.stderr for r in runs]
    assert runs[-1].returncode == 0, runs[-1].stderr
    assert tree_bytes(tmp_path / "out") == files


def test_convert_killed_from_outside_resumes_byte_identical(src, reference, tmp_path):
    """The outside view: SIGKILL once the journal holds a seeded number of finished tensors."""
    out = tmp_path / "out"
    journal = tmp_path / "out.partial" / "journal.jsonl"
    lines = random.Random(SEED + 3).randrange(5, 60)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *_convert_argv(src, out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert kill_when(proc, lambda: line_count(journal) >= lines), "the conversion ended before the kill"
    again = subprocess.run([sys.executable, "-m", "app.cli", *_convert_argv(src, out)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    assert tree_bytes(out) == reference[0]


# --- session saves ---

# Loads what the session file holds (reporting it), then saves three times from scratch: a rewrite and two appends.
SESSION_SCRIPT = r"""
import json, sys
from pathlib import Path
from engine.errors import ColibriError
from engine.generation.session import KVSettings, SessionError, SessionFile, SessionState, session_lock
from engine.kv import KVCache, KVPool
from engine.loader import load_model

model, path, report = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
loaded = load_model(model)
lock = session_lock(path)
cache = KVCache(loaded.spec, 256, pool=KVPool(loaded.spec, 80, block_size=4))
settings = KVSettings.of(cache)
found = "absent"
if path.exists():
    try:
        old, state = SessionFile(path, "tiny", settings).load(KVPool(loaded.spec, 80, block_size=4))
        found = {"save": state.extra["save"], "tokens": list(old.tokens)}
    except SessionError as exc:
        found = {"error": str(exc)}
report.write_text(json.dumps(found))
session = SessionFile(path, "tiny", settings)
loaded.model.forward([3, 17, 5, 99, 42, 8, 23, 61, 7], cache)
for save in (1, 2, 3):
    session.save(cache, SessionState(tuple(cache.tokens), 9, 11, extra={"save": save}))
    for t in range(6):
        loaded.model.forward([(len(cache.tokens) * 7 + t) % 150 + 1], cache)
"""

# the tokens each save holds (the prompt, then six more per save)
SAVED_LENGTHS = {1: 9, 2: 15, 3: 21}


def _session_runs(src: Path, work: Path, points: list[int]) -> list:
    runs = []
    for i, point in enumerate(points):
        argv = [str(src), str(work / f"s{i}" / "chat.session"), str(work / f"s{i}" / "found.json")]
        (work / f"s{i}").mkdir()
        runs += [(argv, point), (argv, 0)]
    return run_with_kills(runs, work, script=SESSION_SCRIPT)


@pytest.mark.parametrize("n_points", [pytest.param(2, id="two"), pytest.param(8, id="eight", marks=pytest.mark.slow)])
def test_session_save_killed_at_seeded_points_loads_an_earlier_save_and_saves_byte_identical(src, tmp_path,
                                                                                            n_points):
    import json

    (tmp_path / "ref").mkdir()
    [ref] = run_with_kills([([str(src), str(tmp_path / "ref" / "chat.session"), str(tmp_path / "ref" / "f.json")],
                             0)], tmp_path, script=SESSION_SCRIPT)
    assert ref.returncode == 0, ref.stderr
    expected = (tmp_path / "ref" / "chat.session").read_bytes()
    points = kill_points(random.Random(SEED + n_points), ref.steps, n_points)
    results = _session_runs(src, tmp_path, points)
    for i, point in enumerate(points):
        killed, rerun = results[2 * i], results[2 * i + 1]
        assert killed.killed, f"step {point}: the run ended first: {killed.stderr}"
        assert rerun.returncode == 0, f"killed at step {point}, the rerun failed: {rerun.stderr}"
        found = json.loads((tmp_path / f"s{i}" / "found.json").read_text())
        # what the kill left is a complete earlier save (or, killed inside the first save, nothing)
        if found != "absent":
            assert "error" not in found, f"killed at step {point}: {found}"
            assert len(found["tokens"]) == SAVED_LENGTHS[found["save"]]
        folder = tmp_path / f"s{i}"
        assert (folder / "chat.session").read_bytes() == expected, f"killed at step {point}"
        assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
