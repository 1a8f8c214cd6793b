"""`colibri bench --kv`: each part runs and reports figures that hold together."""

from __future__ import annotations

import pytest

from app.bench.kv import KVReport, batching, block_sizes, int8_error, prefix_ttft, retention_perplexity
from app.cli import main
from engine.loader import load_model
from support.families import FAMILIES
from support.reference import build_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=512))


def test_parts_report_consistent_figures(tiny):
    report, lines = KVReport(), []
    prefix_ttft(tiny, report, system=64, question=8, trials=2, block=16, log=lines.append)
    assert report.ideal_fraction == pytest.approx(8 / 72)
    assert 0 < report.ttft_cached_s and 0 < report.ttft_uncached_s
    assert len(report.ttft_runs) == 2 and report.ttft_uncached_s == pytest.approx(
        sum(fresh for fresh, _ in report.ttft_runs) / 2)                    # the median of two
    shares = report.ideal_shares
    assert [round(s, 6) for s in shares] == [round(f * 8 / 72 / c, 6) for f, c in report.ttft_runs]
    assert lines[0].endswith("each run " + " ".join(f"{s * 100:.0f}%" for s in shares))
    batching(tiny, report, counts=(1, 2), prompt=8, gen=4, log=lines.append)
    assert set(report.batch) == {1, 2} and all(a > 0 and b > 0 for a, b in report.batch.values())
    block_sizes(tiny, report, sizes=(4, 16), context=64, chunk=8, log=lines.append)
    assert set(report.blocks) == {4, 16}
    int8_error(tiny, report, "", tokens=32, log=lines.append)
    assert report.int8_kl >= 0 and 0 <= report.int8_top1 <= 1 and report.int8_bytes_ratio < 0.6
    assert len(lines) == 6 and "of the ideal" in lines[0] and "x" in lines[1]


def test_prompt_gen_and_runs_reach_the_parts(tiny, monkeypatch, capsys):
    import app.bench.kv as kv
    import app.commands.bench as bench

    seen = {}
    monkeypatch.setattr(bench, "load", lambda *a, **k: tiny)
    monkeypatch.setattr(tiny, "close", lambda: None)
    monkeypatch.setattr(kv, "batching", lambda loaded, report, **k: seen.update(batch=k))
    monkeypatch.setattr(kv, "prefix_ttft", lambda loaded, report, **k: seen.update(prefix=k))
    assert main(["bench", "tiny", "--kv", "batch,prefix", "--prompt", "8", "--gen", "4", "--runs", "2"]) == 0
    assert seen["batch"]["prompt"] == 8 and seen["batch"]["gen"] == 4 and seen["prefix"]["trials"] == 2
    assert main(["bench", "tiny", "--kv", "batch,prefix"]) == 0
    assert seen["batch"]["prompt"] == 32 and seen["batch"]["gen"] == 32 and seen["prefix"]["trials"] == 5
    assert main(["bench", "tiny", "--kv", "batch", "--gen", "0"]) != 0
    assert "--gen 0: must be at least 1" in capsys.readouterr().err


def test_unknown_parts_are_refused(capsys):
    assert main(["bench", "whatever", "--kv", "prefix,nonsense"]) != 0
    assert "--kv prefix,nonsense: use all or any of prefix,batch,blocks,int8,retention" in capsys.readouterr().err


def test_a_recurrent_model_runs_the_parts_that_apply(tmp_path):
    # Qwen3-Next: layer 0 is a DeltaNet layer; block sizes are measured on the first attention layer's shapes
    model_type, overrides = FAMILIES["qwen3_next"]
    loaded = load_model(build_checkpoint(tmp_path, model_type, **overrides))
    assert not hasattr(loaded.spec.layers[0].attn, "n_kv_heads")
    report, lines = KVReport(), []
    prefix_ttft(loaded, report, system=16, question=4, trials=1, block=16, log=lines.append)
    retention_perplexity(loaded, report, "", log=lines.append)
    assert report.ttft_uncached_s == 0 and not report.retention_ppl
    assert "prefix reuse  (skipped: recurrent layers" in lines[0] and "overflow is refused" in lines[1]
    block_sizes(loaded, report, sizes=(4, 16), context=64, chunk=8, log=lines.append)
    assert set(report.blocks) == {4, 16} and all(dec > 0 and pre > 0 for dec, pre in report.blocks.values())
    batching(loaded, report, counts=(2,), prompt=8, gen=4, log=lines.append)
    int8_error(loaded, report, "", tokens=32, log=lines.append)
    assert set(report.batch) == {2} and report.int8_kl >= 0 and report.int8_bytes_ratio < 0.6
    assert len(lines) == 6
