"""`colibri warm`: after the warm-up, a new process's first answer loads every kernel from Numba's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_first_answer_after_warm_up_compiles_nothing(tmp_path_factory, tmp_path):
    _, container = tiny_models(tmp_path_factory.getbasetemp() / "tiny-chat")     # streamed 4-bit MoE, as the demo
    cache = tmp_path / "numba"                                                   # empty: this install's first run
    warm = subprocess.run([sys.executable, "-m", "app.cli", "warm", str(container)], cwd=REPO, env=_env(cache),
                          capture_output=True, text=True, timeout=3600)
    assert warm.returncode == 0, warm.stderr
    assert "warm-up: kernels ready in" in warm.stderr
    assert any(cache.rglob("*.nbi")), "the warm-up wrote nothing into Numba's cache"

    first = subprocess.run([sys.executable, "-c", FIRST_ANSWER, str(container)], cwd=REPO, env=_env(cache),
                           capture_output=True, text=True, timeout=3600)
    assert first.returncode == 0, first.stderr
    counts = json.loads(first.stdout.strip().splitlines()[-1])
    assert counts["misses"] == [], f"compiled at the first answer despite the warm-up: {counts['misses']}"
    assert counts["hits"] > 0


def test_warm_names_a_missing_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "warm", str(tmp_path / "nowhere")], cwd=REPO,
                          env=_env(tmp_path / "numba"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "nowhere" in proc.stderr and "Traceback" not in proc.stderr
