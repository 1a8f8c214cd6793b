"""The [tuned] table of a model's colibri.toml: written beside the user's lines, read back under the model file's
own keys while its fingerprint matches, ignored with a notice once it does not."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from app import cli
from app.config import settings, tuned
from engine.errors import ColibriError

USER = '# my settings\ntop_p = 0.5  # keep\n\n[chat]\nmax_tokens = 7\n'


@pytest.fixture(autouse=True)
def no_user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def model(tmp_path: Path) -> Path:
    gguf = tmp_path / "models" / "m.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(b"GGUF" + bytes(60))
    return gguf


def resolved(argv: list[str]) -> settings.Resolved:
    parser = cli.build_parser()
    parsers = settings.command_parsers(parser)
    return settings.resolve(argv[0], parsers, parser.parse_args(argv),
                            settings.explicit_dests(parser, argv, parsers[argv[0]]), env={})


def test_writing_keeps_the_users_lines_and_replaces_an_old_section(tmp_path: Path) -> None:
    toml = tmp_path / "colibri.toml"
    toml.write_text(USER, encoding="utf-8")
    tuned.write(toml, {"io_threads": 4}, {"cpu": "x", "budget": "none"})
    tuned.write(toml, {"prefetch_depth": 2, "speculative": True}, {"cpu": "y", "budget": 9})
    text = toml.read_text(encoding="utf-8")
    assert text.startswith(USER) and text.count("[tuned]") == 1
    data = tomllib.loads(text)
    assert data["top_p"] == 0.5 and data["chat"] == {"max_tokens": 7}
    assert data["tuned"] == {"prefetch_depth": 2, "speculative": True, "fingerprint": {"cpu": "y", "budget": 9}}
    assert not [p for p in tmp_path.iterdir() if p.name != "colibri.toml"]          # no temporary file left


def test_a_section_after_the_tuned_one_is_kept(tmp_path: Path) -> None:
    toml = tmp_path / "colibri.toml"
    toml.write_text('[tuned]\nio_threads = 1\n[tuned.fingerprint]\ncpu = "x"\n\n[run]\nseed = 3\n', encoding="utf-8")
    tuned.write(toml, {"io_threads": 8}, {"cpu": "z"})
    data = tomllib.loads(toml.read_text(encoding="utf-8"))
    assert data["run"] == {"seed": 3} and data["tuned"]["io_threads"] == 8


def test_a_file_that_is_not_toml_is_refused_and_left_alone(tmp_path: Path) -> None:
    toml = tmp_path / "colibri.toml"
    toml.write_text("top_p = = 1\n", encoding="utf-8")
    with pytest.raises(ColibriError, match="not valid TOML"):
        tuned.write(toml, {"io_threads": 4}, {})
    assert toml.read_text() == "top_p = = 1\n"


def test_tuned_values_apply_under_the_model_files_own_keys(tmp_path: Path) -> None:
    gguf = model(tmp_path)
    toml = gguf.parent / "colibri.toml"
    toml.write_text("threads = 1\n", encoding="utf-8")
    tuned.write(toml, {"threads": 2, "kv_block_size": 64, "speculative": True, "draft": 8},
                tuned.fingerprint(gguf, None))
    run = resolved(["run", str(gguf), "--prompt", "x"])
    assert run.notices == ()
    assert run.settings["kv_block_size"].value == 64 and run.settings["kv_block_size"].source.endswith("[tuned]")
    assert run.settings["speculative"].value is True and run.settings["draft"].value == 8
    assert run.settings["threads"].value == 1                        # the user's own key in the same file wins
    assert resolved(["run", str(gguf), "--prompt", "x", "--kv-block-size", "16"]).settings["kv_block_size"].value == 16
    chat = resolved(["chat", str(gguf)])
    assert chat.settings["kv_block_size"].value == 64 and "draft" not in chat.settings   # keys chat lacks: skipped


def test_another_fingerprint_is_ignored_with_one_notice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = model(tmp_path)
    toml = gguf.parent / "colibri.toml"
    fp = tuned.fingerprint(gguf, None)
    tuned.write(toml, {"kv_block_size": 64}, {**fp, "cpu": "another CPU", "cores": 64})
    run = resolved(["run", str(gguf), "--prompt", "x"])
    assert run.settings["kv_block_size"].source == "default"
    assert len(run.notices) == 1 and "cores, cpu" in run.notices[0] and "colibri tune" in run.notices[0]
    tuned.write(toml, {"kv_block_size": 64}, fp)
    assert resolved(["run", str(gguf), "--prompt", "x"]).settings["kv_block_size"].value == 64
    assert "budget" in resolved(["run", str(gguf), "--prompt", "x", "--max-memory", "1GB"]).notices[0]
    os.utime(gguf, ns=(5, 5))                                        # the model file changed
    run = resolved(["run", str(gguf), "--prompt", "x"])
    assert run.settings["kv_block_size"].source == "default" and "model" in run.notices[0]
    # a command prints the notice on its way (the model is no GGUF, so it fails after)
    cli.main(["run", str(gguf), "--prompt", "x"])
    assert capsys.readouterr().err.count("tuned settings ignored") == 1


def test_the_fingerprint_names_machine_versions_model_and_budget(tmp_path: Path) -> None:
    gguf = model(tmp_path)
    fp = tuned.fingerprint(gguf, 2_000_000)
    assert set(fp) == {"cpu", "cores", "ram", "numba", "engine", "model", "budget"}
    assert fp["budget"] == 2_000_000 and fp["cores"] >= 1 and fp["ram"] > 0
    folder = tmp_path / "container"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    before = tuned.model_stamp(folder)
    (folder / "colibri.toml").write_text("top_p = 1\n")              # its own settings file is not the model
    assert tuned.model_stamp(folder) == before
    (folder / "experts-00001.bin").write_bytes(b"x")
    assert tuned.model_stamp(folder) != before
