"""Typed progress of `pull` and `convert` (app.hub.progress): the events, the lines the CLI prints for them,
and cancelling by raising from the callback."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.hub import pull as pull_mod
from app.hub.convert import ConvertSettings, convert
from app.hub.progress import Note, Progress, render
from support.reference import build_checkpoint


class Stop(Exception):
    """Raised from a progress callback, as the GUI's Cancel does."""


def test_render_indents_a_pull_step_under_its_model_with_its_share():
    assert render(Note("plan: 4.50 bits per weight")) == "plan: 4.50 bits per weight"
    assert render(Progress("write", 64, 256, "written 64/256 tensors (1 s)")) == "written 64/256 tensors (1 s)"
    step = Progress("write", 64, 256, "written 64/256 tensors (1 s)", model="smollm2-moe")
    assert render(step) == "  smollm2-moe:  25% written 64/256 tensors (1 s)" and step.fraction == 0.25
    assert render(Note("resuming: 3 tensors/experts already written", model="m")) == (
        "  m: resuming: 3 tensors/experts already written")
    assert render(Progress("upcycle", 0.5, 1.0, "halfway", model="m")) == "  m:  50% halfway"
    assert Progress("write", 0, 0, "nothing").fraction == 0.0


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=4, num_experts_per_tok=2)


def test_convert_reports_tensors_written_as_progress_and_text_alike(src: Path, tmp_path: Path):
    events: list[Note | Progress] = []
    convert(src, tmp_path / "q", ConvertSettings(bits=4), progress=events.append)
    written = [e for e in events if isinstance(e, Progress)]
    assert written and all(e.stage == "write" for e in written)
    assert [e.done for e in written] == sorted(e.done for e in written) and written[-1].done == written[-1].total
    assert any(isinstance(e, Note) and e.message.startswith("plan: ") for e in events)
    lines: list[str] = []
    convert(src, tmp_path / "again", ConvertSettings(bits=4), log=lines.append)   # the same events, as lines
    assert [line.split(" (")[0] for line in lines] == [render(e).split(" (")[0] for e in events]


def test_raising_from_the_callback_stops_a_conversion(src: Path, tmp_path: Path):
    def stop_at_first_write(event: Note | Progress) -> None:
        if isinstance(event, Progress):
            raise Stop

    with pytest.raises(Stop):
        convert(src, tmp_path / "q", ConvertSettings(bits=4), progress=stop_at_first_write)
    assert not (tmp_path / "q").exists()


def test_a_derived_pull_reports_its_upcycling_as_progress_of_that_model(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    models = tmp_path / "models"
    source = pull_mod.alias_gguf("smollm2-135m", models)
    source.parent.mkdir(parents=True)
    source.write_bytes(b"GGUF")

    def fake_moefy(src, out, options, progress):
        for fraction in (0.0, 0.05, 0.5, 0.55, 1.0):   # reported once per tenth
            progress(fraction, f"at {fraction}")
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")
        return {"perplexity": {"heldout_text": {"change": 0.001}}}

    monkeypatch.setattr("app.moefy.upcycle.moefy", fake_moefy)
    events: list[Note | Progress] = []
    pull_mod.pull("smollm2-moe-bf16", models_dir=models, progress=events.append)
    steps = [e for e in events if isinstance(e, Progress)]
    assert [(e.stage, e.model, e.fraction, e.message) for e in steps] == [
        ("upcycle", "smollm2-moe-bf16", f, f"at {f}") for f in (0.0, 0.5, 1.0)]
    assert isinstance(events[-1], Note) and "is ready" in events[-1].message
