"""`colibri info`: a container's table, a GGUF file's model, `--verify` of every checksum; damage is one
`colibri: error:` line and exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import cli
from support.tiny_checkpoint import edit_manifest, tiny_container, write_tiny

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    src = write_tiny(tmp_path_factory.mktemp("src") / "tiny")
    return tiny_container(src, tmp_path_factory.mktemp("out") / "q4")


@pytest.fixture
def container(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "q4"))


def _info(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["info", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(err: str, pattern: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), err
    assert "Traceback" not in err
    assert re.search(pattern, lines[0]), lines[0]


def test_verify_reports_ok(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _info(capsys, str(container), "--verify")
    assert code == 0 and "verify      ok:" in out and "expert extents" in out


def test_verify_names_the_first_damaged_tensor(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((container / "manifest.json").read_text())
    name, entry = next((n, e) for n, e in sorted(manifest["tensors"].items()) if ".experts.3." in n)
    with open(container / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + 5)
        byte = f.read(1)
        f.seek(entry["offset"] + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    assert _info(capsys, str(container))[0] == 0          # without --verify the table shows: nothing is read
    code, _, err = _info(capsys, str(container), "--verify")
    assert code == 2
    _one_error(err, rf"checksum mismatch in tensor {name.replace('.', '[.]')}; the container is corrupt")


def test_verify_checks_extent_padding_too(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A streaming store checks each extent's CRC on read, padding included: --verify finds what it would."""
    manifest = json.loads((container / "manifest.json").read_text())
    x = manifest["experts"][0]
    last = max(manifest["tensors"][n]["offset"] + manifest["tensors"][n]["length"] for n in x["tensors"])
    assert last < x["offset"] + x["length"], "the tiny extent has padding"
    with open(container / x["file"], "r+b") as f:
        f.seek(x["offset"] + x["length"] - 1)
        f.write(b"\x01")
    code, _, err = _info(capsys, str(container), "--verify")
    assert code == 2
    _one_error(err, rf"checksum mismatch in the extent of layer {x['layer']} expert {x['expert']}")


def test_a_tampered_manifest_is_one_error_line(container: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def edit(m):
        m["config"]["num_experts_per_tok"] = 1
        return m
    edit_manifest(container, edit)
    code, _, err = _info(capsys, str(container))
    assert code == 2
    _one_error(err, "does not match its model hash.*convert the model again")


def test_a_gguf_file_shows_its_model(smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _info(capsys, str(smollm2_gguf))
    assert code == 0
    assert "LlamaForCausalLM: 30 layers, hidden 576, vocabulary 49152" in out and "tensors     272" in out
    assert "blk.*.attn_q.weight" in out and "token_embd.weight" in out
    code, _, err = _info(capsys, str(smollm2_gguf), "--verify")
    assert code == 2
    _one_error(err, "a GGUF file carries no checksums")


def test_other_paths_are_refused_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    code, _, err = _info(capsys, str(tmp_path / "notes.txt"))
    assert code == 2
    _one_error(err, "not a Colibri container nor a .gguf file")
    code, _, err = _info(capsys, str(tmp_path))
    assert code == 2
    _one_error(err, "not a Colibri container")


def test_the_process_exits_2_without_a_traceback(container: Path) -> None:
    (container / "manifest.json").write_text("[1, 2]")
    result = subprocess.run([sys.executable, "-m", "app.cli", "info", str(container), "--verify"], cwd=REPO,
                            capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("colibri: error: ") and "the container is corrupt" in result.stderr
