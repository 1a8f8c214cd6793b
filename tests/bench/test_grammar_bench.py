"""`colibri bench --grammar`: on the tiny random model (whose own choices are no JSON), the counts of each mode hold
together, every constrained answer parses (and validates against the schema in the schema mode), and the
constraint's cost is measured on every constrained token."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.bench.grammar import MODES, SCHEMA, prompts, run_grammar_bench
from app.cli import main
from app.hub.convert import ConvertSettings, convert
from engine.loader import load_model
from support.tiny_chat import tiny_moe

N = 6
GEN = 320     # the tiny model's tokenizer spells a character a token; SCHEMA's answers close within about 300


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    src = tiny_moe(tmp_path_factory.mktemp("moe"))
    return convert(src, tmp_path_factory.mktemp("c") / "tiny", ConvertSettings(bits=4), log=lambda m: None)


@pytest.mark.slow
def test_each_mode_reports_consistent_counts_and_constrained_answers_parse(container):
    loaded = load_model(container)
    lines: list[str] = []
    try:
        results = run_grammar_bench(loaded, n_prompts=N, gen=GEN, batch=4, log=lines.append)
    finally:
        loaded.close()
    assert list(results) == list(MODES) and len(lines) == 2 + len(MODES)
    for mode, r in results.items():
        assert len(r.answers) == len(r.finish) == N
        assert 0 <= r.valid <= r.parsed <= r.parsed_unfenced <= N
        assert r.tokens >= N and r.decode_s > 0 and 0 < r.decode_tokens < r.tokens
        parsed = sum(1 for a in r.answers if _parses(a))
        assert parsed == r.parsed, mode
    for mode in ("json_object", "json_schema"):
        r = results[mode]
        assert r.parsed == N, r.answers      # the constraint: every answer parses, even one cut by the budget
        # one timing per sampled token: the tokens kept plus the end-of-sequence id of those that stopped
        assert len(r.mask_us) == r.tokens and all(us > 0 for us in r.mask_us)
        median, p95, share = r.cost()
        assert 0 < median <= p95 and share > 0
    assert all(isinstance(json.loads(a), dict) for a in results["json_object"].answers)
    for answer in results["json_schema"].answers:
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert results["json_schema"].valid == N
    assert results["free"].mask_us == []


def _parses(text: str) -> bool:
    try:
        json.loads(text.strip())
    except ValueError:
        return False
    return True


def test_prompts_are_distinct_and_bounded():
    assert len(set(prompts(50))) == 50
    with pytest.raises(Exception, match="--prompts 51: give 1 to 50"):
        prompts(51)


def test_a_bad_prompt_count_is_refused_before_loading(capsys):
    assert main(["bench", "no-such-model", "--grammar", "--prompts", "0"]) != 0
    assert "--prompts 0: give 1 to 50" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_prints_each_modes_figures_as_json(container, capsys):
    assert main(["bench", str(container), "--grammar", "--prompts", "2", "--gen", "40", "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == list(MODES)
    for mode, r in out.items():
        assert r["mode"] == mode and r["answers"] == 2 and 0 <= r["valid"] <= r["parsed"] <= r["parsed_unfenced"] <= 2
        assert r["tokens"] >= 2 and r["decode_s"] > 0 and 0 < r["decode_tokens"] < r["tokens"]
    assert "mask_us_median" not in out["free"]
    for mode in ("json_object", "json_schema"):
        assert 0 < out[mode]["mask_us_median"] <= out[mode]["mask_us_p95"] and out[mode]["mask_share"] > 0
