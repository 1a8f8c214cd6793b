"""Settings: colibri.toml files, COLIBRI_* variables, profiles and flags merged in one order and checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numba
import pytest
from threadpoolctl import threadpool_limits

from app import cli
from app.config import settings
from engine.errors import ColibriError


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user file and no COLIBRI_* variable of the machine running the tests; thread counts restored."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in [n for n in os.environ if n.startswith(settings.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    before = numba.get_num_threads()
    with threadpool_limits(limits=None):     # restores the BLAS threads at exit
        yield tmp_path
    numba.set_num_threads(before)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def user_path(tmp_path: Path) -> Path:
    return tmp_path / "xdg" / "colibri" / "colibri.toml"


def merged(argv: list[str], env: dict[str, str] | None = None) -> settings.Resolved:
    """What `colibri ARGV` would run with (without running it)."""
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    parsers = settings.command_parsers(parser)
    given = settings.explicit_dests(parser, argv, parsers[argv[0]])
    return settings.resolve(argv[0], parsers, args, given, env=env or {})


def values(resolved: settings.Resolved) -> dict[str, tuple[object, str]]:
    return {k: (s.value, s.source) for k, s in resolved.settings.items()}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- precedence ---------------------------------------------------------------------------------


def test_precedence_default_user_model_config_env_flag(tmp_path: Path) -> None:
    user = write(user_path(tmp_path), "top_k = 1\ntop_p = 0.5\nmin_p = 0.1\ntemperature = 0.3\nseed = 1\n")
    model = write(tmp_path / "model" / "colibri.toml", "top_p = 0.6\nmin_p = 0.2\ntemperature = 0.4\nseed = 2\n").parent
    config = write(tmp_path / "mine.toml", "min_p = 0.3\ntemperature = 0.5\nseed = 3\n")
    v = values(merged(["run", str(model), "--prompt", "hi", "--config", str(config), "--seed", "5"],
                      env={"COLIBRI_TEMPERATURE": "0.6", "COLIBRI_SEED": "4"}))
    assert v["max_tokens"] == (256, "default")
    assert v["top_k"] == (1, str(user))
    assert v["top_p"] == (0.6, str(model / "colibri.toml"))
    assert v["min_p"] == (0.3, str(config))              # the explicit --config wins over the model's file
    assert v["temperature"] == (0.6, "env COLIBRI_TEMPERATURE")
    assert v["seed"] == (5, "flag")
    assert v["prompt"] == ("hi", "flag")


def test_command_table_wins_over_top_level_for_its_command_only(tmp_path: Path) -> None:
    config = write(tmp_path / "c.toml", "max-tokens = 10\n[chat]\nmax_tokens = 20\n[serve]\nport = 9000\n")
    assert values(merged(["run", "m", "--prompt", "x", "--config", str(config)]))["max_tokens"] == (10, str(config))
    assert values(merged(["chat", "--config", str(config)]))["max_tokens"] == (20, f"{config} [chat]")
    assert values(merged(["serve", "--config", str(config)]))["port"] == (9000, f"{config} [serve]")


def test_a_gguf_file_reads_the_colibri_toml_beside_it(tmp_path: Path) -> None:
    gguf = write(tmp_path / "models" / "tiny.gguf", "")
    write(tmp_path / "models" / "colibri.toml", "kv_bits = 8\n")
    assert values(merged(["chat", str(gguf)]))["kv_bits"] == (8, str(tmp_path / "models" / "colibri.toml"))


def test_the_default_models_file_applies_when_model_is_left_out(tmp_path: Path, monkeypatch) -> None:
    # `colibri chat` with no MODEL runs the default model: its colibri.toml (written by `colibri pull`, with the
    # budget that has its experts stream) counts as when the model is named
    from app.hub.pull import DEFAULT_MODEL, DERIVED

    models = tmp_path / "models"
    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(models))
    folder = models / DERIVED[DEFAULT_MODEL].folder
    write(folder / "config.json", "{}")
    write(folder / "colibri.toml", 'max_memory = "540MB"\n')
    for command in ("chat", "serve", "gui"):
        assert values(merged([command]))["max_memory"] == ("540MB", str(folder / "colibri.toml")), command
        assert values(merged([command, DEFAULT_MODEL]))["max_memory"][0] == "540MB"
    assert values(merged(["chat", "--max-memory", "1GB"]))["max_memory"] == ("1GB", "flag")   # flags still win
    other = write(tmp_path / "other" / "config.json", "{}").parent
    assert values(merged(["chat", str(other)]))["max_memory"][1] == "default"     # another model: not its file


def test_switches_lists_and_unset_variables(tmp_path: Path) -> None:
    config = write(tmp_path / "c.toml", 'no_history = true\nstop = ["</s>", "###"]\n')
    v = values(merged(["run", "m", "--prompt", "x", "--config", str(config)],
                      env={"COLIBRI_SPECULATIVE": "yes", "COLIBRI_CTX": ""}))
    assert v["no_history"] == (True, str(config))
    assert v["stop"] == (["</s>", "###"], str(config))
    assert v["speculative"] == (True, "env COLIBRI_SPECULATIVE")
    assert v["ctx"] == (None, "default")                 # an empty variable counts as unset
    v = values(merged(["run", "m", "--prompt", "x", "--config", str(config), "--stop", "END"],
                      env={"COLIBRI_NO_HISTORY": "false"}))
    assert v["stop"] == (["END"], "flag")                # flags replace a list, they do not extend it
    assert v["no_history"] == (False, "env COLIBRI_NO_HISTORY")


def test_flags_win_in_a_mutually_exclusive_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path / "c.toml", 'prompt = "from the file"\n')
    v = values(merged(["run", "m", "--tokens", "1,2", "--config", str(config)]))
    assert v["tokens"] == ("1,2", "flag") and v["prompt"] == (None, "default")
    both = write(tmp_path / "both.toml", 'prompt = "a"\ntokens = "1"\n')
    code, _, err = run_cli(capsys, "config", "show", "run", "--config", str(both))
    assert code == 2 and "both.toml: prompt and tokens exclude each other; keep one" in err


def test_the_model_file_applies_when_colibri_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from support.reference import build_checkpoint

    folder = build_checkpoint(tmp_path / "tiny", "llama")
    write(folder / "colibri.toml", "[run]\nmax_tokens = 3\n")
    code, out, _ = run_cli(capsys, "run", str(folder), "--tokens", "1,2,3", "--json")
    assert code == 0 and len(json.loads(out)["tokens"]) == 3


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ('max_tokens = "many"\n', "c.toml: max_tokens = 'many': expected a whole number"),
    ("kv_bits = 4\n", "c.toml: kv_bits = 4: expected one of 32, 16, 8"),
    ('[run]\ncache-policy = "fifo"\n', "c.toml [run]: cache-policy = 'fifo': expected one of lru, lfru, learned"),
    ("no_history = 3\n", "no_history = 3: expected true or false"),
    ("temperature = 0.5.1\n", "c.toml: not valid TOML"),
    ("max_memroy = '9GB'\n", "c.toml: unknown key 'max_memroy'; did you mean 'max_memory'?"),
    ("[run]\nhost = 'x'\n", "c.toml [run]: unknown key 'host'"),      # serve's, not run's
    ("[rnu]\nseed = 1\n", "unknown table [rnu]; did you mean 'run'?"),
    ("config = 'other.toml'\n", "a settings file cannot name another one"),
    ("max_tokens = 1\nmax-tokens = 2\n", "'max_tokens' and 'max-tokens' are the same key"),
    ('profile = "fast"\n', "profile = 'fast': expected one of memory-saving, balanced, speed"),
])
def test_bad_files_name_the_file_key_value_and_what_is_allowed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    config = write(tmp_path / "c.toml", text)
    code, out, err = run_cli(capsys, "run", str(tmp_path), "--prompt", "x", "--config", str(config))
    assert code == 2 and out == ""
    assert err.startswith("colibri: error: ") and message in err


def test_bad_variables_and_missing_files_say_which(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_IO", "mmapp")
    code, _, err = run_cli(capsys, "chat", str(tmp_path))
    assert code == 2 and "COLIBRI_IO = 'mmapp': expected one of pread, mmap" in err
    monkeypatch.delenv("COLIBRI_IO")
    monkeypatch.setenv("COLIBRI_CONFIG", str(tmp_path / "nowhere.toml"))
    code, _, err = run_cli(capsys, "gui", "--check-display")
    assert code == 2 and "env COLIBRI_CONFIG" in err and "nowhere.toml" in err and "no such file" in err


# ---- profiles -----------------------------------------------------------------------------------


def test_a_profile_sets_values_and_everything_above_it_wins(tmp_path: Path) -> None:
    v = values(merged(["run", "m", "--prompt", "x", "--profile", "memory-saving", "--kv-bits", "32"]))
    assert v["max_memory"] == ("12GB", "profile:memory-saving")
    assert v["ctx"] == (4096, "profile:memory-saving")
    assert v["kv_bits"] == (32, "flag")
    write(user_path(tmp_path), 'profile = "speed"\nio_threads = 3\n')
    v = values(merged(["run", "m", "--prompt", "x"]))
    assert v["profile"] == ("speed", str(user_path(tmp_path)))
    assert v["speculative"] == (True, "profile:speed")
    assert v["prefetch_depth"] == (2, "profile:speed")
    assert v["io_threads"] == (3, str(user_path(tmp_path)))          # the user's file sits above the profile


@pytest.mark.parametrize("name", list(settings.PROFILES))
def test_every_profile_is_valid_for_every_command(name: str) -> None:
    parsers = settings.command_parsers(cli.build_parser())
    known = {dest for p in parsers.values() for dest in settings.options(p)}
    assert set(settings.PROFILES[name].values) <= known
    for command in parsers:
        argv = [command, "--profile", name] + (["m", "--prompt", "x"] if command == "run" else [])
        assert merged(argv).profile.name == name


# ---- colibri config show ------------------------------------------------------------------------


def test_config_show_lists_every_option_with_its_source(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    model = write(tmp_path / "model" / "colibri.toml", "[run]\nmax_tokens = 7\n").parent
    config = write(tmp_path / "c.toml", "top_k = 5\n")
    monkeypatch.setenv("COLIBRI_KV_BITS", "8")
    code, out, _ = run_cli(capsys, "config", "show", "--profile", "balanced", "run", str(model),
                           "--config", str(config), "--seed", "3")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if not line.startswith("#")}
    parser = settings.command_parsers(cli.build_parser())["run"]
    assert {k.replace("_", "-") for k in settings.options(parser)} <= set(rows)
    assert rows["max-tokens"][1:] == ["7", str(model / "colibri.toml"), "[run]"]
    assert rows["top-k"][1:] == ["5", str(config)]
    assert rows["kv-bits"][1:] == ["8", "env", "COLIBRI_KV_BITS"]
    assert rows["seed"][1:] == ["3", "flag"]
    assert rows["max-memory"][1:] == ["26GB", "profile:balanced"]
    assert rows["top-p"][1:] == ["1.0", "default"]
    assert "# profile balanced: a 32 GB machine" in out
    # the columns line up
    starts = {line.index(line.split()[1]) for line in out.splitlines()[3:] if line.split()[1] != "-"}
    assert len(starts) == 1


def test_config_show_json_and_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_API_KEY", "a-very-secret-key")
    code, out, _ = run_cli(capsys, "config", "show", "--json", "serve", "--threads", "1")
    data = json.loads(out)
    assert code == 0 and data["command"] == "serve" and data["profile"] is None
    assert data["settings"]["threads"] == {"value": 1, "source": "flag", "option": "--threads"}
    assert data["settings"]["api_key"]["value"] == "****" and "a-very-secret" not in out
    code, out, _ = run_cli(capsys, "config", "show", str(tmp_path))        # MODEL without COMMAND: run's settings
    assert code == 0 and out.startswith("# colibri run:")


# ---- threads ------------------------------------------------------------------------------------


def test_physical_cores_counts_cores_not_hyperthreads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [f"processor\t: {i}\nphysical id\t: {i // 4}\ncore id\t\t: {i % 4 // 2}\n" for i in range(8)]
    cpuinfo = write(tmp_path / "cpuinfo", "\n".join(blocks))            # 2 sockets x 2 cores x 2 threads
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert settings.physical_cores(cpuinfo) == 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert settings.physical_cores(cpuinfo) == 3                        # a container granted 3 CPUs
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert settings.physical_cores(write(tmp_path / "arm", "processor : 0\nBogoMIPS : 50\n")) == 6


def test_threads_default_to_the_physical_cores_and_are_applied(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    parsers = settings.command_parsers(cli.build_parser())
    for parser in parsers.values():
        assert parser.get_default("threads") == settings.physical_cores()
    assert cli.build_parser().parse_args(["bench", "x"]).threads == 2        # bench keeps its own --threads
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba runs one thread here")
    code, _, _ = run_cli(capsys, "gui", "--check-display", "--threads", "1")
    assert code in (0, 3) and numba.get_num_threads() == 1
    write(user_path(tmp_path), "threads = 2\n")
    run_cli(capsys, "gui", "--check-display")
    assert numba.get_num_threads() == 2


def test_more_threads_than_numba_started_is_refused_unless_it_is_the_default() -> None:
    most = numba.config.NUMBA_NUM_THREADS
    with pytest.raises(ColibriError, match=f"at most {most} threads.*NUMBA_NUM_THREADS={most + 1}"):
        settings.apply_threads(most + 1, "flag")
    assert settings.apply_threads(most + 1, "default") == most == numba.get_num_threads()


def test_zero_threads_is_refused_by_flag_and_by_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["chat", "--threads", "0"])
    config = write(tmp_path / "c.toml", "threads = 0\n")
    code, _, err = run_cli(capsys, "chat", "--config", str(config))
    assert code == 2 and "threads = 0: expected a whole number >= 1" in err


def test_a_bad_size_in_a_file_names_the_file_key_and_the_form(tmp_path, capsys):
    from app.cli import main

    config = tmp_path / "bad.toml"
    config.write_text('max_memory = "lots"\n')
    assert main(["run", "whatever", "--prompt", "hi", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}: max_memory = 'lots': expected a size such as 9GB" in err


def test_a_model_opened_later_gets_its_own_file_under_the_same_flags(tmp_path: Path) -> None:
    # the app's File > Open: the settings `colibri gui OTHER` would give, whichever model the app started with
    first = write(tmp_path / "first" / "colibri.toml", 'max_memory = "540MB"\nkv_bits = 8\n').parent
    other = write(tmp_path / "other" / "colibri.toml", 'max_memory = "700MB"\n').parent
    parser = cli.build_parser()
    args = settings.for_model(parser, ["gui", str(first)], "gui", str(other))
    assert (args.model, args.max_memory, args.kv_bits) == (str(other), "700MB", 32)   # nothing of the first's file
    args = settings.for_model(parser, ["gui", "--max-memory", "1GB"], "gui", str(first))
    assert (args.max_memory, args.kv_bits) == ("1GB", 8)                               # the flag still wins
