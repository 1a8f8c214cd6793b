"""`colibri bench`: fields and figures of the report, bytes per token by hand, bandwidth, bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app import cli
from app.bench.decode import (
    BenchResult,
    bench_model,
    decode_bytes_per_token,
    measure_bandwidth,
    random_prompt,
    thread_limits,
)
from app.bench.synth import corpus_lines, write_checkpoint
from engine.loader import load_model
from engine.spec import MoESpec

FAST = ["--prompt", "16", "--gen", "4", "--runs", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 mixtral-tiny checkpoint."""
    out = tmp_path_factory.mktemp("bench") / "mixtral-tiny"
    write_checkpoint("mixtral-tiny", out, dtype="f32", corpus=corpus_lines(20_000))
    return out


def hand_bytes_per_token(spec) -> int:
    """Float32 bytes one decode step reads, from the spec's numbers alone."""
    h, f32 = spec.hidden_size, 4
    total = h + spec.vocab_size * h + h            # final norm, lm_head, one embedding row
    for layer in spec.layers:
        a = layer.attn
        total += 2 * h                             # the two norms
        total += 2 * h * a.n_heads * a.head_dim + 2 * h * a.n_kv_heads * a.head_dim  # q, o, k, v
        ffn = layer.ffn
        assert isinstance(ffn, MoESpec)
        total += ffn.n_experts * h + ffn.top_k * 3 * h * ffn.expert_ffn              # router, chosen experts
    return total * f32


@pytest.mark.slow
def test_json_report_has_every_field(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", str(tiny), "--json", *FAST]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == set(BenchResult.__dataclass_fields__) | {"baseline_rss"}
    assert 0 < report["baseline_rss"] < report["rss"]
    assert (report["prompt_tokens"], report["gen_tokens"], report["runs"], report["threads"]) == (16, 4, 2, 2)
    assert report["architecture"] == "MixtralForCausalLM" and report["model"] == "mixtral-tiny"
    for key in ("prompt_tok_s", "decode_tok_s", "weight_bytes", "bytes_per_token", "achieved_gb_s",
                "ram_gb_s", "roofline_fraction", "roofline_decode_tok_s", "model_bytes"):
        assert report[key] > 0, key
    assert len(report["prompt_tok_s_runs"]) == len(report["decode_tok_s_runs"]) == 2
    assert report["bytes_per_token"] == hand_bytes_per_token(load_model(tiny).spec)
    assert report["achieved_gb_s"] == pytest.approx(report["bytes_per_token"] * report["decode_tok_s"] / 1e9)
    assert report["roofline_fraction"] == pytest.approx(report["achieved_gb_s"] / report["ram_gb_s"])
    assert report["roofline_decode_tok_s"] == pytest.approx(report["ram_gb_s"] * 1e9 / report["bytes_per_token"])


def test_table_report(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", str(tiny), *FAST, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for word in ("prompt", "decode", "MB read per decoded token", "GB/s RAM read measured", "roofline", "1 thread,",
                 "MB resident after the runs", "MB before loading"):
        assert word in out


def test_bench_model_reuses_a_given_bandwidth(tiny: Path) -> None:
    from app.plan.budget import process_rss

    loaded = load_model(tiny)
    seen: list[tuple[int, int]] = []
    result = bench_model(loaded, prompt=8, gen=2, runs=2, ram_gb_s=10.0, on_run=lambda d, t: seen.append((d, t)))
    assert seen == [(0, 2), (1, 2), (2, 2)]
    assert result.ram_gb_s == 10.0
    assert result.bytes_per_token == decode_bytes_per_token(loaded.model)
    assert result.weight_bytes == 4 * load_plan_params()
    assert result.rss > 100e6 and abs(result.rss - process_rss()) < 50e6      # bytes, as the process holds now
    assert result.model_bytes == sum(f.stat().st_size for f in tiny.rglob("*") if f.is_file()) > 0


def load_plan_params() -> int:
    from app.bench.synth import plan_checkpoint

    return plan_checkpoint("mixtral-tiny", "f32").total_params


def test_random_prompt_is_seeded_and_skips_special_ids(tiny: Path) -> None:
    loaded = load_model(tiny)
    ids = random_prompt(loaded, 2000, seed=1)
    assert ids == random_prompt(loaded, 2000, seed=1) != random_prompt(loaded, 2000, seed=2)
    assert not {0, 1, 2} & set(ids)                 # <unk>, <s>, </s>
    assert 0 <= min(ids) and max(ids) < loaded.spec.vocab_size


def test_measure_bandwidth_is_positive() -> None:
    assert measure_bandwidth(32 << 20, repeats=2, threads=1) > 0


def test_thread_limits_restore_numba_threads() -> None:
    import numba

    before = numba.get_num_threads()
    with thread_limits(1):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == before


@pytest.mark.parametrize("args, message", [
    (["--prompt", "0"], "--prompt 0: must be at least 1"),
    (["--gen", "-1"], "--gen -1: must be at least 1"),
    (["--runs", "0"], "--runs 0: must be at least 1"),
    (["--threads", "0"], "--threads 0: must be at least 1"),
    (["--threads", "999"], "--threads 999: numba was started with at most"),
    (["--prompt", "500", "--gen", "100"], "--prompt 500 plus --gen 100 is 600 tokens but the model's context holds 512"),
])
def test_bad_arguments(tiny: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", str(tiny), *args]) == 2
    err = capsys.readouterr().err
    assert f"colibri: error: {message}" in err


def test_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", str(tmp_path / "nothing")]) == 2
    assert "colibri: error:" in capsys.readouterr().err
