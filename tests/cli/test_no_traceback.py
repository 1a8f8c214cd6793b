"""A user mistake never shows a traceback (issue 29): every command, run in-process through the CLI's main,
with mutated inputs: missing paths, a folder where a file is expected and the reverse, garbage and empty
files, a 300-character name, negative, zero and huge numbers, bytes that are not UTF-8.

A mistake must end with exit code 2 and exactly one `colibri: error:` line (argparse's own refusals say
`colibri COMMAND: error:`); an input that is legitimately fine ends with 0. Any other exception escapes
`main` and fails the case with its traceback, which is the bug the case found.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from app import cli
from support.tiny_chat import tiny_models

ERROR_LINE = re.compile(r"^colibri(?: [a-z]+)?: error: ")
NOT_UTF8 = b"bad \xff\xfe name".decode("utf-8", "surrogateescape")   # what Python makes of such argv bytes
HUGE = str(10**30)


@dataclass(frozen=True)
class Case:
    """One command line; `ok` when the input is legitimately fine (exit 0)."""

    argv: tuple[str, ...]
    ok: bool = False


@dataclass(frozen=True)
class Inputs:
    """The files and folders the mutations point at, made once under a temporary folder."""

    root: Path
    model: Path         # a valid tiny chat model (Hugging Face folder)
    container: Path     # the same converted, whose experts stream under --max-memory
    gguf: Path          # a valid GGUF file (SmolLM2)

    @property
    def bad_paths(self) -> dict[str, str]:
        """Paths that are not a usable model or input file, by what is wrong with them."""
        r = self.root
        return {
            "missing": str(r / "missing"),
            "empty-dir": str(r / "empty-dir"),
            "garbage": str(r / "garbage.bin"),
            "garbage-gguf": str(r / "garbage.gguf"),
            "empty-gguf": str(r / "empty.gguf"),
            "garbage-config": str(r / "garbage-config"),
            "long-name": str(r / ("x" * 300)),
            "not-utf8": str(r / NOT_UTF8),
        }


def make_inputs(root: Path, model: Path, container: Path, gguf: Path) -> Inputs:
    (root / "empty-dir").mkdir()
    (root / "garbage.bin").write_bytes(os.urandom(4096))
    (root / "garbage.gguf").write_bytes(b"GGUF" + os.urandom(4092))
    (root / "empty.gguf").write_bytes(b"")
    (root / "garbage-config").mkdir()
    (root / "garbage-config" / "config.json").write_bytes(b"\xff{garbage")
    (root / "text.txt").write_text("Some text to score, long enough for a few tokens of evaluation.\n" * 4)
    (root / "empty.txt").write_text("")
    # the model with damage others of issue 29 refuse: no attention heads, a safetensors header that is a list
    shutil.copytree(model, root / "zero-heads")
    config = json.loads((model / "config.json").read_text())
    (root / "zero-heads" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    shutil.copytree(model, root / "list-header")
    header = b"[]"
    (root / "list-header" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (root / "resumed.partial").mkdir()
    (root / "resumed.partial" / "resume_key.json").write_bytes(b"\x00garbage{")
    return Inputs(root, model, container, gguf)


def _cases(inputs: Inputs) -> dict[str, Case]:
    """The table: a name per case, for its pytest id."""
    bad = inputs.bad_paths
    model, container, root = str(inputs.model), str(inputs.container), inputs.root
    file_ = bad["garbage"]
    cases: dict[str, Case] = {}

    # ---- MODEL arguments and input paths that are not what they should be
    for kind, path in bad.items():
        cases[f"run-model-{kind}"] = Case(("run", path, "--prompt", "hi", "--max-tokens", "2"))
        cases[f"chat-model-{kind}"] = Case(("chat", path))
        cases[f"info-{kind}"] = Case(("info", path))
        cases[f"eval-model-{kind}"] = Case(("eval", path, "--text", str(root / "text.txt")))
        cases[f"plan-model-{kind}"] = Case(("plan", path, "--max-memory", "1G"))
        cases[f"bench-model-{kind}"] = Case(("bench", path, "--gen", "2", "--runs", "1"))
        cases[f"atlas-model-{kind}"] = Case(("atlas", path, "--out", str(root / f"atlas-{kind}")))
        cases[f"moefy-src-{kind}"] = Case(("moefy", path, str(root / f"moefy-{kind}")))
        cases[f"convert-src-{kind}"] = Case(("convert", path, str(root / f"convert-{kind}")))
        cases[f"serve-model-{kind}"] = Case(("serve", path))
        # text that is not UTF-8 is read with U+FFFD (the text policy): scoring it is fine
        cases[f"eval-text-{kind}"] = Case(("eval", model, "--text", path), ok=kind in ("garbage", "garbage-gguf"))
        # a model that is not there has no settings of its own to show; a name the system cannot take is refused
        cases[f"config-show-{kind}"] = Case(("config", "show", "run", path), ok=kind != "long-name")
    cases["info-gguf-file"] = Case(("info", str(inputs.gguf)), ok=True)
    cases["chat-session-dir"] = Case(("chat", model, "--session", bad["empty-dir"]))
    generate = ("--prompt", "hi", "--max-tokens", "2")
    cases["run-zero-attention-heads"] = Case(("run", str(root / "zero-heads"), *generate))
    cases["run-safetensors-header-list"] = Case(("run", str(root / "list-header"), *generate))
    cases["convert-resume-key-garbage"] = Case(("convert", model, str(root / "resumed")))
    cases["chat-session-garbage"] = Case(("chat", model, "--session", file_))
    cases["run-logits-out-dir"] = Case(("run", model, "--prompt", "hi", "--max-tokens", "1",
                                        "--logits-out", bad["empty-dir"]))
    cases["run-logits-out-missing-folder"] = Case(("run", model, "--prompt", "hi", "--max-tokens", "1",
                                                   "--logits-out", str(root / "missing" / "x.npy")))
    cases["run-config-garbage"] = Case(("run", model, "--prompt", "hi", "--config", file_))
    cases["run-config-dir"] = Case(("run", model, "--prompt", "hi", "--config", bad["empty-dir"]))
    cases["run-config-missing"] = Case(("run", model, "--prompt", "hi", "--config", bad["missing"]))
    cases["convert-out-is-a-file"] = Case(("convert", model, file_))
    cases["convert-calib-dir"] = Case(("convert", model, str(root / "conv-calib"), "--calib", bad["empty-dir"]))
    cases["moefy-out-is-a-file"] = Case(("moefy", model, file_))
    cases["moefy-calib-missing"] = Case(("moefy", model, str(root / "moefy-calib"), "--calib", bad["missing"]))
    cases["bench-trace-dir"] = Case(("bench", model, "--replay", bad["empty-dir"]))
    cases["plan-config-only-garbage"] = Case(("plan", "--config-only", file_, "--max-memory", "1G"))
    cases["synth-out-is-a-file"] = Case(("synth", "llama-tiny", file_))
    cases["synth-unknown-shape"] = Case(("synth", NOT_UTF8, str(root / "synth-x")))

    # ---- names
    long = "x" * 300
    cases["pull-long-name"] = Case(("pull", long, "--models-dir", str(root / "models")))
    cases["pull-long-repo-id"] = Case(("pull", "org/" + long, "--models-dir", str(root / "models")))
    cases["pull-long-org"] = Case(("pull", long + "/name", "--models-dir", str(root / "models")))
    cases["pull-not-utf8"] = Case(("pull", NOT_UTF8, "--models-dir", str(root / "models")))
    cases["pull-empty"] = Case(("pull", "", "--models-dir", str(root / "models")))
    cases["pull-models-dir-is-a-file"] = Case(("pull", "org/name", "--models-dir", file_))
    cases["pull-models-dir-long"] = Case(("pull", "org/name", "--models-dir", str(root / long / "m")))
    cases["run-model-long-repo-id"] = Case(("run", "org/" + long, "--prompt", "hi"))
    cases["run-model-not-utf8-name"] = Case(("run", NOT_UTF8, "--prompt", "hi"))

    # ---- numbers: negative, zero and huge, where each is refused
    generate = ("--prompt", "hi", "--max-tokens", "2")
    for flag, values in {"--max-tokens": ("-1", "0"), "--ctx": ("-1", "0", HUGE), "--temperature": ("-1",),
                         "--top-p": ("-1", "0", HUGE), "--top-k": ("-1",), "--min-p": ("-1", HUGE),
                         "--repetition-penalty": ("-1", "0"), "--kv-block-size": ("-1", "0", HUGE),
                         "--max-memory": ("-1", "0", "lots"), "--threads": ("-1", "0"), "--seed": ("-1", HUGE)}.items():
        for value in values:
            argv = ("run", model, *generate, flag, value) if flag != "--max-tokens" else \
                ("run", model, "--prompt", "hi", flag, value)
            cases[f"run{flag}={value[:4]}"] = Case(argv, ok=(flag, value) == ("--seed", HUGE))
    # the offload flags count where the weights stream: under --max-memory
    for flag, values in {"--io-threads": ("-1", "0", HUGE), "--prefetch-depth": ("-1", HUGE),
                         "--resident-layers": ("-1", HUGE)}.items():
        for value in values:
            # more resident layers than the model has keeps them all
            cases[f"run-offload{flag}={value[:4]}"] = Case(("run", container, *generate, "--max-memory", "1G",
                                                            flag, value), ok=(flag, value) == ("--resident-layers", HUGE))
    for value in ("-1", "0", HUGE):
        cases[f"run--draft={value[:4]}"] = Case(("run", model, *generate, "--speculative", "--draft", value))
        cases[f"run--tokens={value[:4]}"] = Case(("run", model, "--tokens", value, "--max-tokens", "1"),
                                                 ok=value == "0")
        cases[f"chat--max-tokens={value[:4]}"] = Case(("chat", model, "--max-tokens", value),
                                                      ok=value == HUGE)  # stdin is empty: the chat ends at once
        # serve: a missing model, so that a value it accepts ends in an error too, never in serving
        cases[f"serve--port={value[:4]}"] = Case(("serve", bad["missing"], "--port", value))
        cases[f"serve--max-batch={value[:4]}"] = Case(("serve", bad["missing"], "--max-batch", value))
        cases[f"serve--max-body={value[:4]}"] = Case(("serve", bad["missing"], "--max-body", value))
        cases[f"convert--bits={value[:4]}"] = Case(("convert", model, str(root / "c-bits"), "--bits", value))
        cases[f"convert--group-size={value[:4]}"] = Case(("convert", model, str(root / "c-g"), "--group-size", value))
        cases[f"moefy--experts={value[:4]}"] = Case(("moefy", model, str(root / "m-e"), "--experts", value))
        cases[f"moefy--top-k={value[:4]}"] = Case(("moefy", model, str(root / "m-k"), "--top-k", value))
        cases[f"bench--runs={value[:4]}"] = Case(("bench", model, "--runs", value, "--gen", "1"))
        cases[f"bench--gen={value[:4]}"] = Case(("bench", model, "--gen", value, "--runs", "1"))
        cases[f"eval--max-tokens={value[:4]}"] = Case(("eval", model, "--text", str(root / "text.txt"),
                                                       "--max-tokens", value), ok=value == HUGE)
        cases[f"plan--ctx={value[:4]}"] = Case(("plan", model, "--max-memory", "1G", "--ctx", value))
        cases[f"synth--seed={value[:4]}"] = Case(("synth", "llama-tiny", str(root / f"synth-{value[:4]}"),
                                                  "--seed", value), ok=value != "-1")
    cases["eval-text-empty"] = Case(("eval", model, "--text", str(root / "empty.txt")))
    cases["run--tokens-not-numbers"] = Case(("run", model, "--tokens", "1,x", "--max-tokens", "1"))
    cases["run--max-tokens-not-a-number"] = Case(("run", model, "--prompt", "hi", "--max-tokens", "many"))

    # ---- text that is not UTF-8 is fine wherever it is text
    cases["run-prompt-not-utf8"] = Case(("run", model, "--prompt", NOT_UTF8, "--max-tokens", "2"), ok=True)
    cases["run-stop-not-utf8"] = Case(("run", model, *generate, "--stop", NOT_UTF8), ok=True)
    cases["run-system-not-utf8"] = Case(("run", model, *generate, "--chat", "--system", NOT_UTF8), ok=True)
    cases["chat-system-not-utf8"] = Case(("chat", model, "--system", NOT_UTF8), ok=True)
    cases["serve-api-key-not-utf8"] = Case(("serve", bad["missing"], "--api-key", NOT_UTF8))
    # convert needs a size (--bits): without one argparse would refuse every case before the mutation counts
    return {name: Case((*case.argv, "--bits", "4"), case.ok)
            if case.argv[0] == "convert" and "--bits" not in case.argv else case for name, case in cases.items()}


# The table needs paths before pytest collects it: names and argv templates with placeholders filled per run
_TEMPLATE = _cases(Inputs(Path("/ROOT"), Path("/MODEL"), Path("/CONTAINER"), Path("/GGUF")))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, smollm2_gguf) -> Inputs:
    model, container = tiny_models(tmp_path_factory.getbasetemp())
    return make_inputs(tmp_path_factory.mktemp("mutations"), model, container, smollm2_gguf)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_TEMPLATE))
def test_a_user_mistake_never_shows_a_traceback(inputs, name, monkeypatch):
    case = _cases(inputs)[name]
    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(inputs.root / "models"))
    monkeypatch.chdir(inputs.root)
    # stdin ends at once (chat returns); stdout is as strict as a UTF-8 terminal, stderr as Python's own
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    try:
        code = cli.main(list(case.argv))
    except SystemExit as exc:           # argparse refuses a flag's value
        code = exc.code
    stderr = err.buffer.getvalue().decode("utf-8")
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    assert "Traceback" not in stderr, stderr
    if case.ok:
        assert (code, errors) == (0, []), stderr
    else:
        assert code == 2, stderr
        assert len(errors) == 1, stderr


# ---- how main reports an OSError ---------------------------------------------------------------


def _pull_raises(monkeypatch, exc: BaseException) -> None:
    import app.hub.pull

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(app.hub.pull, "pull", fail)


@pytest.mark.parametrize("exc, line", [
    (FileNotFoundError(2, "No such file or directory", "/x/model"), "cannot read /x/model: No such file or directory"),
    (OSError(36, "File name too long", "/x/" + "y" * 8), "cannot read /x/yyyyyyyy: File name too long"),
    (OSError(28, "No space left on device", "/x/out"), "cannot write /x/out: No space left on device"),
    (OSError(18, "Invalid cross-device link", "/a", None, "/b"), "cannot read /a -> /b: Invalid cross-device link"),
])
def test_an_os_error_naming_a_file_is_one_error_line(monkeypatch, capsys, exc, line):
    _pull_raises(monkeypatch, exc)
    assert cli.main(["pull", "org/name"]) == 2
    assert capsys.readouterr().err == f"colibri: error: {line}\n"


def test_an_os_error_naming_no_file_keeps_its_traceback(monkeypatch):
    _pull_raises(monkeypatch, OSError(12, "Cannot allocate memory"))
    with pytest.raises(OSError, match="Cannot allocate memory"):
        cli.main(["pull", "org/name"])


def test_a_reader_that_leaves_is_not_an_error(monkeypatch, capsys):
    _pull_raises(monkeypatch, BrokenPipeError(32, "Broken pipe"))
    monkeypatch.setattr(sys, "stdout", sys.stdout)       # main swaps in os.devnull: restored after the test
    assert cli.main(["pull", "org/name"]) == 0
    sys.stdout.close()
    assert capsys.readouterr().err == ""


# ---- `colibri pull` of an impossible id: refused before the disk or the hub is touched ----------


@pytest.mark.parametrize("name, words", [
    ("org/" + "x" * 300, "the repo id's name has 300 characters"),
    ("o" * 97 + "/name", "the repo id's organisation has 97 characters"),
    ("x" * 300, "(300 characters) is too long to be a model name"),
    ("not a model", "neither a known model name"),
    (NOT_UTF8, "neither a known model name"),
])
def test_pull_names_what_is_wrong_with_an_impossible_id(tmp_path, capsys, name, words):
    models = tmp_path / "models"
    assert cli.main(["pull", name, "--models-dir", str(models)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colibri: error: ") and err.count("\n") == 1 and words in err, err
    assert len(err) < 400                                # the id is shortened in the message
    assert not models.exists()                           # nothing written for it
