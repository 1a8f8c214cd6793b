"""`colibri bench --kv`: each part runs and reports figures that hold together."""

from __future__ import annotations

import pytest

from app.bench.kv import KVReport, batching, block_sizes, int8_error, prefix_ttft
from app.cli import main
from engine.loader import load_model
from support.reference import build_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=512))


def test_parts_report_consistent_figures(tiny):
    report, lines = KVReport(), []
    prefix_ttft(tiny, report, system=64, question=8, trials=2, block=16, log=lines.append)
    assert report.ideal_fraction == pytest.approx(8 / 72)
    assert 0 < report.ttft_cached_s and 0 < report.ttft_uncached_s
    batching(tiny, report, counts=(1, 2), prompt=8, gen=4, log=lines.append)
    assert set(report.batch) == {1, 2} and all(a > 0 and b > 0 for a, b in report.batch.values())
    block_sizes(tiny, report, sizes=(4, 16), context=64, chunk=8, log=lines.append)
    assert set(report.blocks) == {4, 16}
    int8_error(tiny, report, "", tokens=32, log=lines.append)
    assert report.int8_kl >= 0 and 0 <= report.int8_top1 <= 1 and report.int8_bytes_ratio < 0.6
    assert len(lines) == 6 and "of the ideal" in lines[0] and "x" in lines[1]


def test_unknown_parts_are_refused(capsys):
    assert main(["bench", "whatever", "--kv", "prefix,nonsense"]) != 0
    assert "--kv prefix,nonsense: use all or any of prefix,batch,blocks,int8,retention" in capsys.readouterr().err
