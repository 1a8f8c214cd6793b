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

# The app's first answer (EngineService, a chat question sampled at the chat window's defaults), then every
# Numba dispatcher of the engine's modules: the signatures it compiled, and those it loaded from the cache.
FIRST_ANSWER = r"""
import json, sys
from app.service.local import EngineService
from app.service.warm import SAMPLED, _answer
from numba.core.dispatcher import Dispatcher

with EngineService() as service:
    info = service.load_and_wait(sys.argv[1])
    _answer(service, info, SAMPLED, "Hello, who are you?", 600)
hits, misses = 0, []
for name, module in list(sys.modules.items()):
    if not name.startswith("engine."):
        continue
    for attr, value in vars(module).items():
        if isinstance(value, Dispatcher) and value.__module__ == name:
            hits += sum(value.stats.cache_hits.values())
            misses += [f"{name}.{attr}{sig}" for sig in value.stats.cache_misses]
print(json.dumps({"hits": hits, "misses": misses}))
"""


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}


def _first_answer_misses(container: Path, cache: Path) -> list[str]:
    first = subprocess.run([sys.executable, "-c", FIRST_ANSWER, str(container)], cwd=REPO, env=_env(cache),
                           capture_output=True, text=True, timeout=3600)
    assert first.returncode == 0, first.stderr
    counts = json.loads(first.stdout.strip().splitlines()[-1])
    assert counts["hits"] > 0
    return counts["misses"]


@pytest.mark.slow
def test_after_the_standin_and_the_warm_up_a_first_answer_compiles_nothing(tmp_path_factory, tmp_path):
    dense = add_char_tokenizer(build_checkpoint(tmp_path / "dense", "llama", seed=0))
    options = MoefyOptions(experts=4, top_k=1, calib_prompts=2, answer_tokens=4, evaluate=False,
                           probes=tiny_probes(tmp_path / "probes"))
    moefy(dense, tmp_path / "moe", options)
    container = convert(tmp_path / "moe", tmp_path / "moe-q4", ConvertSettings(bits=4), log=lambda s: None)
    cache = tmp_path / "numba"                                      # empty: this install's first run
    standin = subprocess.run([sys.executable, "-m", "app.hub.standin", str(dense), str(tmp_path / "standin"),
                              str(options.experts), str(options.top_k), "4"], cwd=REPO, env=_env(cache),
                             capture_output=True, text=True, timeout=3600)
    assert standin.returncode == 0, standin.stderr
    assert any(cache.rglob("*.nbi")), "the stand-in wrote nothing into Numba's cache"
    assert _first_answer_misses(container, cache) == []             # nothing left for the real model to compile

    # `colibri warm` on a chat model (a template, the chat window's sampling): its first answer compiles nothing
    # either (one test, so that CI compiles into an empty cache once)
    _, chat = tiny_models(tmp_path_factory.getbasetemp() / "tiny-chat")
    warm = subprocess.run([sys.executable, "-m", "app.cli", "warm", str(chat)], cwd=REPO, env=_env(cache),
                          capture_output=True, text=True, timeout=3600)
    assert warm.returncode == 0, warm.stderr
    assert "warm-up: kernels ready in" in warm.stderr
    assert _first_answer_misses(chat, cache) == []


def test_warm_names_a_missing_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "warm", str(tmp_path / "nowhere")], cwd=REPO,
                          env=_env(tmp_path / "numba"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "nowhere" in proc.stderr and "Traceback" not in proc.stderr
