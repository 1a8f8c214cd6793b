"""`colibri tune`: the noise rule, the search's refusal of any output change, and a real tune of a tiny streamed
model whose winner lands in colibri.toml and is read back by `run`."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import numba
import pytest

from app import cli
from app.bench.synth import corpus_lines, write_checkpoint
from app.bench.tune import Axis, Trial, judge, spread, tune
from app.bench.tune_model import ModelBench, start_settings
from app.commands.tune import run_settings
from app.config import settings
from app.hub.convert import ConvertSettings, convert
from engine.errors import ColibriError

# ---- the noise rule ------------------------------------------------------------------------------


def test_a_clear_gain_beyond_the_spread_is_accepted() -> None:
    v = judge([1.00, 1.02, 0.98, 1.01, 0.99], [0.80, 0.81, 0.79, 0.82, 0.80])
    assert v.accepted and v.gain == pytest.approx(0.2)
    assert v.spread == pytest.approx(((spread([1.00, 1.02, 0.98, 1.01, 0.99]) ** 2
                                       + spread([0.80, 0.81, 0.79, 0.82, 0.80]) ** 2) / 2) ** 0.5)


def test_a_gain_inside_the_noise_is_refused() -> None:
    # medians 1.00 and 0.90, but each side wanders by about 0.15: not beyond two spreads
    v = judge([1.00, 1.20, 0.85, 1.15, 0.90], [0.90, 0.75, 1.05, 0.70, 1.10])
    assert not v.accepted and "within" in v.reason


def test_a_tiny_gain_beyond_a_tight_spread_is_still_refused() -> None:
    v = judge([1.000, 1.000, 1.001, 0.999, 1.000], [0.990, 0.990, 0.991, 0.989, 0.990])   # 1% faster, no noise
    assert not v.accepted and "under 3%" in v.reason


def test_slower_is_refused_and_the_rule_needs_two_runs_a_side() -> None:
    slower = judge([1.0, 1.1, 0.9], [1.5, 1.6, 1.4])
    assert not slower.accepted and "slower by 50.0%" in slower.reason
    with pytest.raises(ColibriError, match="two timed runs"):
        judge([1.0], [0.5])


# ---- the search, on a scripted measure ---------------------------------------------------------


class Scripted:
    """A Measure whose times and outputs follow the settings: `fast` values are faster, `wrong` ones change the
    answer (as an engine bug would), and the clock advances by each run's time."""

    def __init__(self, fast: dict[str, object], wrong: dict[str, object] | None = None) -> None:
        self.fast, self.wrong, self.now, self.calls = fast, wrong or {}, 0.0, 0

    def clock(self) -> float:
        return self.now

    def __call__(self, s) -> Trial:
        self.calls += 1
        seconds = 1.0 + 0.001 * (self.calls % 3)                      # a little noise
        seconds *= 0.5 ** sum(s.get(k) == v for k, v in self.fast.items())
        tokens = (1, 2, 3, 4)
        if any(s.get(k) == v for k, v in self.wrong.items()):
            seconds *= 0.1                                             # much faster, and wrong
            tokens = (1, 2, 9, 4)
        self.now += seconds
        return Trial(tokens, seconds)


def test_a_faster_candidate_with_another_output_is_rejected() -> None:
    m = Scripted(fast={"io_threads": 4}, wrong={"prefetch_depth": 3})
    start = {"prefetch_depth": 1, "io_threads": 2}
    result = tune(m, start, [Axis("prefetch_depth", (0, 3)), Axis("io_threads", (1, 4))], repeats=3,
                  budget_seconds=1e6, clock=m.clock)
    by = {(o.key, o.value): o for o in result.outcomes}
    assert by[("prefetch_depth", 3)].status == "output differs"
    assert "token 2" in by[("prefetch_depth", 3)].detail
    assert [o.value for o in result.rejected] == [3]
    assert by[("io_threads", 4)].status == "accepted" and by[("io_threads", 1)].status == "not faster"
    assert result.chosen == {"prefetch_depth": 1, "io_threads": 4}
    assert result.final is not None and result.final.accepted and result.tokens == (1, 2, 3, 4)


def test_a_changed_reference_output_stops_the_tune() -> None:
    class Flaky(Scripted):
        def __call__(self, s) -> Trial:
            t = super().__call__(s)
            return Trial((7,) if self.calls == 4 else t.tokens, t.seconds)     # the baseline's third run

    m = Flaky(fast={})
    with pytest.raises(ColibriError, match="not deterministic"):
        tune(m, {"threads": 2}, [Axis("threads", (1,))], repeats=2, budget_seconds=1e6, clock=m.clock)


def test_the_budget_skips_what_would_pass_it_and_keeps_room_for_the_final_check() -> None:
    m = Scripted(fast={"threads": 1, "draft": 8})
    # warm-up and cost runs 2 s; a comparison is 2 x 2 runs, at most 4 s: the first fits with room for the final
    # check (10 s), after it (5 s spent) the next would not
    result = tune(m, {"threads": 2, "draft": 4}, [Axis("threads", (1,)), Axis("draft", (8, 2))], repeats=2,
                  budget_seconds=11.0, clock=m.clock)
    assert [o.status for o in result.outcomes] == ["accepted", "skipped", "skipped"]
    assert result.chosen == {"threads": 1, "draft": 4} and result.seconds <= 11.0


def test_an_axis_applies_only_where_its_condition_holds() -> None:
    m = Scripted(fast={"draft": 8})
    result = tune(m, {"speculative": False, "draft": 4},
                  [Axis("draft", (8,), applies=lambda s: s.get("speculative") is True)], repeats=2,
                  budget_seconds=1e6, clock=m.clock)
    assert result.outcomes == () and result.chosen == {"speculative": False, "draft": 4}


# ---- a real model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("tune") / "mixtral-tiny"
    write_checkpoint("mixtral-tiny", src, dtype="f32", corpus=corpus_lines(20_000))
    return convert(src, tmp_path_factory.mktemp("tune") / "q4", ConvertSettings(bits=4), log=lambda m: None)


@pytest.fixture()
def no_user_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


class Reversed:
    """A test hook on the real bench: the candidate `inject = True` answers the question with its tokens reversed,
    a real run of the model whose output differs, as an engine bug's would."""

    def __init__(self, bench: ModelBench) -> None:
        self.bench = bench

    def __call__(self, s) -> Trial:
        if not s.get("inject"):
            return self.bench(s)
        saved = self.bench.prompt
        self.bench.prompt = list(reversed(saved or []))
        try:
            return self.bench(s)
        finally:
            self.bench.prompt = saved


def test_a_real_run_whose_answer_differs_is_rejected(container: Path, no_user_settings) -> None:
    import argparse

    args = argparse.Namespace(max_memory="2MB", ctx=64, kv_bits=None, config=None, profile=None)
    start = start_settings({k: s.value for k, s in run_settings(args, container).settings.items()})
    start["inject"] = False
    bench = ModelBench(container, gen=6)
    measure = Reversed(bench)
    try:
        assert measure(start).tokens != measure({**start, "inject": True}).tokens     # the hook changes the answer
        result = tune(measure, start, [Axis("inject", (True,)), Axis("prefetch_depth", (0,))], repeats=2,
                      budget_seconds=1e6)
    finally:
        bench.close()
    statuses = {o.key: o.status for o in result.outcomes}
    assert statuses["inject"] == "output differs"
    assert statuses["prefetch_depth"] in ("accepted", "not faster")       # same answer: judged on speed only
    assert result.chosen["inject"] is False


@pytest.mark.slow
def test_tune_writes_its_winner_with_a_fingerprint_and_run_reads_it(container: Path, no_user_settings,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    toml = container / "colibri.toml"
    toml.write_text("# mine\ntop_p = 0.5\n\n[chat]\nmax_tokens = 7\n", encoding="utf-8")
    argv = ["tune", str(container), "--max-memory", "2MB", "--ctx", "64", "--gen", "4", "--repeats", "2", "--json"]
    assert cli.main(argv + ["--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == {}
    assert "tuned" not in toml.read_text()
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rejected"] == 0 and report["written"]
    data = tomllib.loads(toml.read_text(encoding="utf-8"))
    assert toml.read_text().startswith("# mine\ntop_p = 0.5\n\n[chat]\nmax_tokens = 7\n")    # the user's lines kept
    assert data["tuned"]["fingerprint"]["budget"] == 2_000_000
    assert {k: v for k, v in data["tuned"].items() if k != "fingerprint"} == report["written"]

    def run_with(*flags: str) -> settings.Resolved:
        argv = ["run", str(container), "--prompt", "x", *flags]
        parser = cli.build_parser()
        parsers = settings.command_parsers(parser)
        return settings.resolve("run", parsers, parser.parse_args(argv),
                                settings.explicit_dests(parser, argv, parsers["run"]), env={})

    same = run_with("--max-memory", "2MB")
    for key, value in report["written"].items():
        assert same.settings[key].value == value and same.settings[key].source.endswith("[tuned]")
    assert same.settings["top_p"].value == 0.5 and same.notices == ()
    other = run_with("--max-memory", "3MB")                          # another budget: another fingerprint
    assert all(not s.source.endswith("[tuned]") for s in other.settings.values())
    assert len(other.notices) == 1 and "budget" in other.notices[0] and "colibri tune" in other.notices[0]
    os.utime(container / "manifest.json", ns=(1, 1))                 # the model changed
    notices = run_with("--max-memory", "2MB").notices
    assert len(notices) == 1 and "model" in notices[0]
