"""`colibri warm` and the stand-in a pull warms meanwhile (app.hub.standin): after them, a new process's first answer
loads every kernel from Numba's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.hub.convert import ConvertSettings, convert
from app.moefy.upcycle import MoefyOptions, moefy
from support.moefy import add_char_tokenizer, tiny_probes
from support.reference import build_checkpoint
from support.tiny_chat import tiny_models

REPO = Path(__file__).resolve().parents[2]

# Runs a module as `python -m` does (or a script), then writes to $SIGNATURES what Numba did for the engine's
# modules: the signatures of kernels with an on-disk cache that the run asked for (loaded from the cache or compiled),
# and the kernels without one that it compiled from Python rather than inside another kernel's compile. numba counts
# a signature as a cache hit or miss each time it asks for it by argument types.
RUN_AND_RECORD = r"""
import atexit, json, os, runpy, sys
from numba.core import event
from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher

depth, uncached = [0], []

class Compiles(event.Listener):
    def on_start(self, ev):
        dispatcher = ev.data["dispatcher"]
        if depth[0] == 0 and isinstance(dispatcher._cache, NullCache):
            uncached.append(f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__qualname__}")
        depth[0] += 1

    def on_end(self, ev):
        depth[0] -= 1

event.register("numba:compile", Compiles())

def record():
    asked = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("engine."):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, Dispatcher) and value.__module__ == name and not isinstance(value._cache, NullCache):
                sigs = set(value.stats.cache_hits) | set(value.stats.cache_misses)
                asked += [f"{name}.{attr}{sig}" for sig in sigs]
    with open(os.environ["SIGNATURES"], "w") as f:
        json.dump({"asked": sorted(asked), "uncached": sorted(set(uncached))}, f)

atexit.register(record)
sys.argv = sys.argv[1:]
if sys.argv[0].endswith(".py"):
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

# The app's first answer: EngineService, a chat question sampled at the chat window's defaults.
FIRST_ANSWER = r"""
import sys
from app.service.local import EngineService
from app.service.warm import SAMPLED, _answer

with EngineService() as service:
    info = service.load_and_wait(sys.argv[1])
    _answer(service, info, SAMPLED, "Hello, who are you?", 600)
"""


def _recorded(tmp_path: Path, argv: list[str]) -> tuple[set[str], str]:
    """Run `python -m argv[0] argv[1:]` (or the script argv[0]) with this session's Numba cache -> the signatures it
    asked for, and its stderr."""
    out = tmp_path / f"signatures-{len(list(tmp_path.glob('signatures-*')))}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SIGNATURES": str(out)}
    proc = subprocess.run([sys.executable, "-c", RUN_AND_RECORD, *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr
    recorded = json.loads(out.read_text())
    assert recorded["asked"] and recorded["uncached"] == [], recorded["uncached"]
    return set(recorded["asked"]), proc.stderr


def _first_answer(tmp_path: Path, model: Path) -> set[str]:
    script = tmp_path / "first_answer.py"
    script.write_text(FIRST_ANSWER)
    return _recorded(tmp_path, [str(script), str(model)])[0]


@pytest.mark.slow
def test_after_the_standin_and_the_warm_up_a_first_answer_compiles_nothing(tmp_path_factory, tmp_path):
    """Every signature of a cached kernel that the real model's first answer asks for, the stand-in asked for too,
    and no run compiles an uncached kernel from Python: on a first run, whose empty cache the stand-in fills, the first
    answer compiles nothing. (Checked by signature in this session's shared Numba cache rather than by compiling into
    an empty one, which took minutes of CI's two cores.)"""
    dense = add_char_tokenizer(build_checkpoint(tmp_path / "dense", "llama", seed=0))
    options = MoefyOptions(experts=4, top_k=1, calib_prompts=2, answer_tokens=4, evaluate=False,
                           probes=tiny_probes(tmp_path / "probes"))
    moefy(dense, tmp_path / "moe", options)
    container = convert(tmp_path / "moe", tmp_path / "moe-q4", ConvertSettings(bits=4), log=lambda s: None)
    standin, _ = _recorded(tmp_path, ["app.hub.standin", str(dense), str(tmp_path / "standin"),
                                      str(options.experts), str(options.top_k), "4"])
    extra = _first_answer(tmp_path, container) - standin
    assert extra == set(), sorted(extra)

    # `colibri warm` on a chat model (a template, the chat window's sampling): its first answer asks for nothing
    # the warm-up did not
    _, chat = tiny_models(tmp_path_factory.getbasetemp() / "tiny-chat")
    warm, log = _recorded(tmp_path, ["app.cli", "warm", str(chat)])
    assert "warm-up: kernels ready in" in log
    assert _first_answer(tmp_path, chat) - warm == set()


def test_warm_names_a_missing_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "warm", str(tmp_path / "nowhere")], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "nowhere" in proc.stderr and "Traceback" not in proc.stderr


def test_events_go_through_a_line_and_come_back_equal():
    from app.hub.progress import Note, Progress
    from app.service.warm import event_line, read_event

    for event in (Note("warm-up: kernels ready in 3.2 s"), Progress("warm", 1, 3, "a greedy answer", model="m"),
                  Progress("upcycle", 0.05, 1.0, "calibration chats: code (40 s so far)", model="m", waiting=True)):
        assert read_event(event_line(event)) == event
    assert read_event("numba says hello") is None and read_event('{"kind": "Other"}') is None


# a child that says two events between other output, then fails or succeeds as argv[1] says
FAKE_WARM = r"""
import sys
from app.hub.progress import Note, Progress
from app.service.warm import event_line
print("a library's own line")
print(event_line(Progress("warm", 1, 3, "a greedy answer")), flush=True)
print(event_line(Note("warm-up: kernels ready in 0.1 s")), flush=True)
print("half of the story\nthe reason it failed", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_warm_up_apart_passes_the_childs_events_on_and_its_failure_with_its_last_lines():
    from app.hub.progress import Note, Progress
    from app.service.warm import warm_up_apart
    from engine.errors import ColibriError

    events = []
    warm_up_apart("unused", events.append, [sys.executable, "-c", FAKE_WARM, "0"])
    assert events == [Progress("warm", 1, 3, "a greedy answer"), Note("warm-up: kernels ready in 0.1 s")]
    with pytest.raises(ColibriError, match="half of the story; the reason it failed"):
        warm_up_apart("unused", events.append, [sys.executable, "-c", FAKE_WARM, "3"])


def test_stopping_a_warm_up_apart_kills_the_child(tmp_path):
    from app.service.warm import warm_up_apart

    endless = "import time\nfrom app.hub.progress import Note\nfrom app.service.warm import event_line\n" \
              "while True:\n    print(event_line(Note('compiling')), flush=True)\n    time.sleep(0.05)\n"

    class Stop(Exception):
        pass

    def cancel(event):
        raise Stop                      # as the first-run dialog's Cancel does at the next event

    with pytest.raises(Stop):
        warm_up_apart("unused", cancel, [sys.executable, "-c", endless])


def test_a_warm_up_apart_of_a_hub_name_pulls_it_first_and_says_why_it_cannot(tmp_path):
    # the first run's "pull by name": the child pulls into the models folder it is given, then warms up
    from app.hub.progress import Note
    from app.service.warm import warm_up_apart
    from engine.errors import ColibriError

    events = []
    with pytest.raises(ColibriError, match="^preparing org/model stopped: cannot reach the Hugging Face hub for org/"):
        warm_up_apart("org/model", events.append, models_dir=tmp_path / "models")
    assert events == [Note("asking the Hugging Face hub for org/model ...")]
