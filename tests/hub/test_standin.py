"""The stand-in that compiles a derived model's kernels while the model is made (app.hub.standin)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import app.hub.pull as pull_mod
from app.hub.convert import ConvertSettings, convert
from app.hub.pull import pull
from app.hub.standin import INTERMEDIATE, LAYERS, PREFIX, StandIn, write_standin
from app.moefy.upcycle import MoefyOptions, moefy
from engine.formats.container import Container
from support.moefy import add_char_tokenizer, tiny_probes
from support.reference import build_checkpoint

MOE = pull_mod.DERIVED[pull_mod.DEFAULT_MODEL]          # the container
UPCYCLED = pull_mod.DERIVED[MOE.source]                 # the upcycling it is made from


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """A random Llama with a character tokenizer: the dense model to upcycle."""
    return add_char_tokenizer(build_checkpoint(tmp_path_factory.mktemp("dense") / "llama", "llama", seed=0))


def _formats(container: Container) -> dict[str, tuple]:
    """Each tensor's format (kind and quantization, not its size), by its name without layer or expert numbers."""
    formats: dict[str, set] = {}
    for name, e in container.entries.items():
        quant = {k: v for k, v in (e.quant or {}).items() if k not in ("shape", "rows", "cols")}
        role = re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", name))
        formats.setdefault(role, set()).add((e.kind, len(e.shape), json.dumps(quant, sort_keys=True)))
    return {role: tuple(sorted(f)) for role, f in formats.items()}


def test_the_standin_is_the_upcycled_container_cut_small(tmp_path: Path, dense: Path) -> None:
    options = MoefyOptions(experts=4, top_k=1, calib_prompts=2, answer_tokens=4, evaluate=False,
                           probes=tiny_probes(tmp_path / "probes"))
    moefy(dense, tmp_path / "moe", options)
    real = Container.open(convert(tmp_path / "moe", tmp_path / "moe-q4", ConvertSettings(bits=4), log=lambda s: None))
    stand = Container.open(write_standin(dense, tmp_path / "standin", options.experts, options.top_k, 4))

    want = dict(real.config, num_hidden_layers=LAYERS, intermediate_size=INTERMEDIATE)
    assert stand.config == want
    # the same kinds and quantizations for every role: Numba compiles the same kernels for both
    assert _formats(stand) == _formats(real)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "standin" / "container" / name).read_bytes() == (tmp_path / "moe-q4" / name).read_bytes()
    assert not (tmp_path / "standin" / "checkpoint").exists()       # the float checkpoint is removed once converted


def test_a_stopped_standin_is_killed_and_removed(tmp_path: Path, dense: Path) -> None:
    root = tmp_path / "models"
    standin = StandIn.start(dense, root, 4, 1, 4)
    standin.stop()
    assert standin.process.returncode is not None and list(root.iterdir()) == []


def test_a_failing_standin_is_said_and_the_pull_goes_on(tmp_path: Path) -> None:
    # its success is tested in tests/cli/test_warm.py: the real model's first answer compiles nothing after it
    root = tmp_path / "models"
    (root / f"{PREFIX}1-dead").mkdir(parents=True)        # left by a killed run
    notes: list = []
    standin = StandIn.start(tmp_path / "no-such-model.gguf", root, 4, 1, 4)
    assert not (root / f"{PREFIX}1-dead").exists()
    assert not standin.finish(notes.append)
    assert "stand-in failed" in notes[-1].message and "no model folder or .gguf file there" in notes[-1].message
    assert list(root.iterdir()) == []


def test_a_pull_that_upcycles_starts_a_standin_and_waits_for_it(tmp_path: Path, dense: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models"
    gguf_path = pull_mod.alias_gguf(UPCYCLED.source, models)   # the pulled source: moefy and convert are faked
    gguf_path.parent.mkdir(parents=True)
    gguf_path.write_bytes(b"GGUF")
    events: list[str] = []
    interrupt = [True]

    class FakeStandIn:
        @classmethod
        def start(cls, source, root, experts, top_k, bits):
            events.append(f"start {Path(source).name} {experts} {top_k} {bits}")
            return cls()

        def finish(self, report, tick=None):
            events.append("finish")
            return True

        def stop(self):
            events.append("stop")

    def fake_moefy(src, out, options, progress):
        events.append("moefy")
        shutil.copytree(dense, out)
        return {}

    def fake_convert(name, derived, source, root, report):
        events.append("convert")
        if interrupt:
            interrupt.pop()
            raise KeyboardInterrupt
        (root / derived.folder).mkdir()
        (root / derived.folder / "config.json").write_text("{}")    # what marks a finished folder
        return root / derived.folder

    monkeypatch.setattr("app.hub.standin.StandIn", FakeStandIn)
    monkeypatch.setattr("app.moefy.upcycle.moefy", fake_moefy)
    monkeypatch.setattr(pull_mod, "_convert", fake_convert)
    with pytest.raises(KeyboardInterrupt):              # a stopped preparation stops its stand-in
        pull(pull_mod.DEFAULT_MODEL, models_dir=models, log=lambda s: None, warm_ahead=True)
    assert events == [f"start {gguf_path.name} {UPCYCLED.experts} {MoefyOptions().top_k} {MOE.bits}", "moefy",
                          "convert", "stop"]
    events.clear()
    shutil.rmtree(models / UPCYCLED.folder)
    pull(pull_mod.DEFAULT_MODEL, models_dir=models, log=lambda s: None, warm_ahead=True)
    assert events == [f"start {gguf_path.name} {UPCYCLED.experts} {MoefyOptions().top_k} {MOE.bits}", "moefy",
                      "convert", "finish"]
    # prepared: no stand-in again; nor without warm_ahead (a plain `colibri pull`)
    events.clear()
    pull(pull_mod.DEFAULT_MODEL, models_dir=models, log=lambda s: None, warm_ahead=True)
    shutil.rmtree(models / MOE.folder)
    pull(pull_mod.DEFAULT_MODEL, models_dir=models, log=lambda s: None)
    assert events == ["convert"]
