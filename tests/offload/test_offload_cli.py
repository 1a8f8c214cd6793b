"""`--max-memory` and the streaming flags on the command line: same tokens as resident, clear refusals."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from app.hub.convert import ConvertSettings, convert
from engine.formats.container import Container
from engine.loader import open_checkpoint
from engine.offload.budget import plan_memory
from support.reference import build_checkpoint

ARGS = ["--tokens", "3,17,5,99,42,8,23,61", "--max-tokens", "12", "--json"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    src = build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=8, num_experts_per_tok=2)
    return convert(src, tmp_path_factory.mktemp("c") / "moe", ConvertSettings(bits=4), log=lambda m: None)


@pytest.fixture(autouse=True)
def _user_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "models"))


def _run(capsys, *argv) -> dict:
    assert main(["run", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


def _minimum(model, ctx: int = 64) -> int:
    ckpt = open_checkpoint(model, verify_experts=False)
    plan = plan_memory(ckpt.source, ckpt.spec, 1 << 40, ctx)
    return plan.minimum


def test_streamed_run_gives_the_resident_tokens(moe, capsys, tmp_path):
    resident = _run(capsys, moe, *ARGS)
    least = _minimum(moe)
    for budget, extra in ((least, ["--cache-policy", "lru", "--prefetch-depth", "0"]),
                          (least * 2, []),
                          (least, ["--io", "mmap"])):
        streamed = _run(capsys, moe, *ARGS, "--ctx", "64", "--max-memory", f"{budget}B", *extra)
        assert streamed["tokens"] == resident["tokens"], extra
    assert list((tmp_path / "usage").glob("*.npz")), "the usage history was saved"


def test_too_small_a_budget_names_the_minimum(moe, capsys):
    least = _minimum(moe)
    assert main(["run", str(moe), *ARGS, "--ctx", "64", "--max-memory", f"{least - 4096}B"]) != 0
    err = capsys.readouterr().err
    assert "too small for this model" in err and "needs at least" in err and "Traceback" not in err


def test_streaming_asks_for_a_container(tmp_path, capsys):
    src = build_checkpoint(tmp_path / "hf", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert main(["run", str(src), *ARGS, "--max-memory", "1GB"]) != 0
    assert "colibri convert" in capsys.readouterr().err


def test_plan_divides_the_budget(moe):
    ckpt = open_checkpoint(moe, verify_experts=False)
    c: Container = ckpt.source
    plan = plan_memory(c, ckpt.spec, 10 ** 9, 128)
    assert plan.cache == len(c.extents) * -(-max(x.length for x in c.extents.values()) // 4096) * 4096  # all fit
    assert plan.resident + plan.kv + plan.working + plan.cache <= plan.total
    tight = plan_memory(c, ckpt.spec, plan.minimum, 128)
    assert tight.cache == tight.cache_minimum


def test_a_dense_model_streams_its_layers(tmp_path, capsys):
    src = build_checkpoint(tmp_path / "hf", "llama", num_hidden_layers=4)
    dense = convert(src, tmp_path / "dense", ConvertSettings(bits=4), log=lambda m: None)
    resident = _run(capsys, dense, *ARGS)
    ckpt = open_checkpoint(dense, verify=False)
    for held, depth in ((0, 1), (2, 0), (None, 2)):
        plan = plan_memory(ckpt.source, ckpt.spec, 1 << 40, 64, depth, held if held is not None else 0)
        budget = plan.resident + plan.kv + plan.working + plan.cache
        extra = ["--resident-layers", str(held)] if held is not None else []
        streamed = _run(capsys, dense, *ARGS, "--ctx", "64", "--max-memory", f"{budget}B", "--prefetch-depth",
                        str(depth), *extra)
        assert streamed["tokens"] == resident["tokens"], (held, depth)
