"""Peak memory does not grow with the model: the same command on a checkpoint and on one four times larger
(the same family, four times the layers) differs in peak RSS by far less than the two differ in size."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.rss import child_env, colibri_argv, mixtral_config, peak_rss_kib, write_bf16_checkpoint

pytestmark = pytest.mark.slow

SMALL, LARGE = 2, 8          # layers: the larger checkpoint is four times the smaller's experts
EXPERTS, FFN = 8, 1024
BUDGET = "24MB"           # the smaller container's experts do not fit either: both stream
# the share of the size difference the peaks may differ by (before pages were released: all of it)
MAX_SHARE = 0.25


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, tuple[Path, int]]:
    """layers -> (a bfloat16 Mixtral folder, its weight bytes)."""
    root = tmp_path_factory.mktemp("rss")
    return {n: (root / f"bf16-{n}", write_bf16_checkpoint(root / f"bf16-{n}", mixtral_config(n, EXPERTS, ffn=FFN)))
            for n in (SMALL, LARGE)}


@pytest.fixture(scope="module")
def containers(models, tmp_path_factory) -> dict[int, tuple[Path, int]]:
    """layers -> (the 4-bit container of `models`' checkpoint, its bytes), and the peak RSS of converting it."""
    root = tmp_path_factory.mktemp("rss-out")
    env = child_env()
    out = {}
    for n, (src, _) in models.items():
        dst = root / f"q4-{n}"
        peak = peak_rss_kib(colibri_argv("convert", str(src), str(dst), "--bits", "4"), root, env)
        out[n] = (dst, sum(f.stat().st_size for f in dst.iterdir()), peak * 1024)
    return out


def test_convert_peak_rss_does_not_grow_with_the_model(models, containers):
    grew = containers[LARGE][2] - containers[SMALL][2]
    size = models[LARGE][1] - models[SMALL][1]
    assert size > 60e6
    assert grew < MAX_SHARE * size, (f"peak RSS grew {grew / 1e6:.1f} MB for a checkpoint {size / 1e6:.1f} MB larger "
                                     "(source pages kept mapped?)")


def test_streamed_run_peak_rss_does_not_grow_with_the_model(containers, tmp_path):
    env = child_env()
    peaks = {}
    for n, (folder, _, _) in containers.items():
        argv = colibri_argv("run", str(folder), "--tokens", "1,2,3,4", "--max-tokens", "8", "--max-memory", BUDGET,
                            "--json")
        peaks[n] = peak_rss_kib(argv, tmp_path, env) * 1024
    grew = peaks[LARGE] - peaks[SMALL]
    size = containers[LARGE][1] - containers[SMALL][1]
    assert size > 15e6
    assert grew < MAX_SHARE * size, (f"peak RSS grew {grew / 1e6:.1f} MB for a container {size / 1e6:.1f} MB larger "
                                     "under the same --max-memory")
