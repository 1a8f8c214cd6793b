"""`colibri plan`: the verdict first (fits / streams / does not fit and what would), KV cache, predicted speeds;
from config.json alone (a local file, or a hub name whose config is fetched) and from the weights with calibration."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from app.config.sizes import format_size, parse_size
from app.plan import plan
from app.plan.plan import BudgetTooSmall, flag_size
from app.plan.speed_model import Rates
from engine.errors import ColibriError
from engine.offload.budget import kv_bytes

BASELINE = 100 * 10**6
# Fixed constants instead of measuring (app.plan.speed_probe, tested in test_speed_model.py): no call measured,
# so every kernel call costs its weights at decode_wps.
RATES = Rates(threads=2, chunk=256, token_s=1e-4, layer_s=2e-4, chunk_s=1e-3, chunk_layer_s=1e-3, key_s=1e-7,
              pair_s=1e-7, fused=False, call_s={}, decode_wps={4: 10e9}, prompt_wps={4: 40e9}, expert_wps={4: 20e9}, ram_gbs=20.0,
              disk_gbs=1.0, seconds=0.0)
# A Mixtral-shaped config (hub layout, transformers 5 RoPE keys): experts are 90% of its weights.
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "cfg" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MIXTRAL))
    return path


@pytest.fixture(autouse=True)
def quick_machine(monkeypatch, tmp_path: Path):
    """Fixed speeds and interpreter footprint: the verdicts are then exact, and nothing is measured."""
    monkeypatch.setattr(plan, "measure_rates", lambda work, ctx, threads, folder: RATES)
    monkeypatch.setattr("app.plan.budget.process_rss", lambda: BASELINE)
    monkeypatch.setenv("COLIBRI_MODELS_DIR", str(tmp_path / "models"))


def _run(argv: list[str], capsys) -> tuple[int, str]:
    from app.commands import plan as command

    parser = argparse.ArgumentParser(prog="colibri")
    command.register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def _totals(config: Path, ctx: int) -> tuple[int, int, int]:
    """(bytes besides the weights, dense weight bytes with float32 tensors, routed expert bytes) at 4 bits."""
    ckpt = plan.config_checkpoint(config)
    split = plan.split_for(ckpt.spec, 10**12, ctx, BASELINE)
    layout = plan.config_layout(ckpt, split, 4, 4)
    experts = sum(layout.plan.tensors[n].nbytes for n in layout.experts)
    return split.total - split.weights, layout.plan.total_bytes - experts, experts


def test_config_only_plan_that_fits(config: Path, capsys) -> None:
    code, out = _run(["--config-only", str(config), "--max-memory", "1GB", "--ctx", "512"], capsys)
    lines = out.splitlines()
    assert code == 0
    assert lines[0].startswith("fits in memory")
    spec = plan.config_checkpoint(config).spec
    assert f"KV cache for 512 tokens: {format_size(kv_bytes(spec, 512))}" in out
    assert f"`--kv-bits 8` at run time takes about a quarter of that, {format_size(kv_bytes(spec, 512, 8))}" in out
    assert "nothing streams" in out
    assert "predicted prompt" in out and "predicted decode" in out
    assert "measured now" in out and "assumed: " in out                # the prediction says what it rests on
    assert "from disk" not in out
    assert "layers.*.experts.w1" in out and "4.50 (    4)" in out      # 4-bit, group 32: 4.5 bits with scales


def test_config_only_plan_that_streams(config: Path, capsys) -> None:
    other, dense, experts = _totals(config, 512)
    budget = other + dense + experts // 2
    code, out = _run(["--config-only", str(config), "--max-memory", f"{budget}B", "--ctx", "512"], capsys)
    assert code == 0
    streamed = experts - (budget - other - dense)
    assert out.splitlines()[0] == f"fits with {format_size(streamed)} of experts streaming from disk"
    assert "of experts from disk (hit rate 50%)" in out                # half the experts held, routing uniform
    assert "disk 1.00 GB/s cold reads" in out and "routing uniform" in out


def test_config_only_plan_that_does_not_fit_says_what_would(config: Path, capsys) -> None:
    code, out = _run(["--config-only", str(config.parent), "--max-memory", "50MB", "--ctx", "4096"], capsys)
    assert code == 1
    assert out.startswith("does not fit: needs at least ")
    assert f"KV cache for 4096 tokens {format_size(kv_bytes(plan.config_checkpoint(config).spec, 4096))}" in out
    enough = out.split("raise --max-memory to ")[1].split()[0]
    code, out = _run(["--config-only", str(config), "--max-memory", enough, "--ctx", "4096"], capsys)
    assert code == 0 and out.startswith("fits with ")                  # the advice, taken, is enough


def test_the_interpreter_comes_on_top_of_the_budget_as_run_counts_it(config: Path) -> None:
    # `run --max-memory` gives the budget to weights, KV cache and buffers, the interpreter's footprint apart:
    # a plan for the same budget must leave the weights the same share
    from engine.offload.budget import working_bytes

    spec = plan.config_checkpoint(config).spec
    split = plan.split_for(spec, 10**9, 512, BASELINE)
    assert split.weights == 10**9 - kv_bytes(spec, 512) - working_bytes(spec, 512)
    assert f"interpreter and libraries ({format_size(BASELINE)}, measured) come on top" in split.describe()


def test_flag_size_rounds_up() -> None:
    for n in (1, 999_999, 1_234_567_891, 10**9, 605_321_001):
        assert parse_size(flag_size(n)) >= n


def test_streaming_slows_prompt_and_decode(config: Path) -> None:
    ckpt = plan.config_checkpoint(config)
    other, dense, experts = _totals(config, 256)
    full = plan.split_for(ckpt.spec, other + dense + experts, 256, BASELINE)
    tight = plan.split_for(ckpt.spec, other + dense + experts // 4, 256, BASELINE)
    slow_disk = dataclasses.replace(RATES, disk_gbs=0.01)          # reads outlast the compute they overlap
    resident = plan.predict(ckpt.spec, full, plan.config_layout(ckpt, full, 4, 4), lambda work: slow_disk)
    streamed = plan.predict(ckpt.spec, tight, plan.config_layout(ckpt, tight, 4, 4), lambda work: slow_disk)
    assert resident.streamed_bytes == 0 and streamed.streamed_bytes > 0
    assert streamed.tok_s < resident.tok_s and streamed.prompt_tok_s < resident.prompt_tok_s
    hidden = plan.predict(ckpt.spec, tight, plan.config_layout(ckpt, tight, 4, 4), lambda work: RATES)
    assert streamed.tok_s < hidden.tok_s <= resident.tok_s             # a fast disk hides behind the layers
    every_expert = sum(t.shape[0] * t.shape[1] for n, t in resident.plan.tensors.items() if ".experts." in n)
    assert resident.speeds.work.experts[4] == pytest.approx(every_expert / 4)   # a token runs top_k = 2 of 8 experts
    with pytest.raises(BudgetTooSmall) as err:
        plan.config_layout(ckpt, plan.split_for(ckpt.spec, other, 256, BASELINE), 4, 4)   # nothing for weights
    assert err.value.minimum > other


def test_speeds_are_measured_for_the_planned_work(config: Path, monkeypatch, capsys) -> None:
    seen = []

    def measure(work, ctx, threads, folder):
        seen.append((work, ctx, threads, folder))
        return RATES

    monkeypatch.setattr(plan, "measure_rates", measure)
    code, out = _run(["--config-only", str(config), "--max-memory", "1GB", "--ctx", "512", "--threads", "1"], capsys)
    assert code == 0
    work, ctx, threads, folder = seen[0]
    assert (ctx, threads, folder) == (512, 1, plan_models_dir())
    assert work.spec.n_layers == 4 and not work.streams


def plan_models_dir() -> Path:
    from app.config.paths import models_dir

    return models_dir()


def test_hub_name_plans_from_its_fetched_config(config: Path, monkeypatch, capsys) -> None:
    import huggingface_hub as hub

    monkeypatch.setattr(hub, "try_to_load_from_cache", lambda repo, name: None)
    monkeypatch.setattr(hub, "get_hf_file_metadata", lambda url: None)
    monkeypatch.setattr(hub, "hf_hub_download", lambda repo, name: str(config))
    code, out = _run(["some-org/some-moe", "--max-memory", "1GB", "--ctx", "512"], capsys)
    assert code == 0 and out.startswith("fits in memory")


def test_unreachable_hub_suggests_config_only(monkeypatch, capsys) -> None:
    import huggingface_hub as hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(hub, "try_to_load_from_cache", lambda repo, name: None)
    monkeypatch.setattr(hub, "get_hf_file_metadata", unreachable)
    monkeypatch.setattr(hub, "hf_hub_download", unreachable)
    monkeypatch.setattr(hub.constants, "is_offline_mode", lambda: False)
    with pytest.raises(ColibriError) as err:
        _run(["some-org/some-moe", "--max-memory", "16GB"], capsys)
    message = str(err.value)
    assert "cannot reach the Hugging Face hub for some-org/some-moe" in message
    assert "--config-only PATH/config.json" in message


def test_missing_config_and_missing_model_are_explained(tmp_path: Path, capsys) -> None:
    with pytest.raises(ColibriError, match="no config.json there"):
        _run(["--config-only", str(tmp_path / "nowhere"), "--max-memory", "1GB"], capsys)
    with pytest.raises(ColibriError, match="--config-only"):
        _run(["--max-memory", "1GB"], capsys)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from app.bench.synth import write_checkpoint

    out = tmp_path_factory.mktemp("plan") / "mixtral-tiny"
    write_checkpoint("mixtral-tiny", out)
    return out


def test_calibrated_plan_puts_the_verdict_first(tiny_model: Path, capsys) -> None:
    code, out = _run([str(tiny_model), "--max-memory", "300MB", "--ctx", "256", "--calib-tokens", "128"], capsys)
    assert code == 0
    assert out.splitlines()[0].startswith("fits in memory")
    assert "KV cache for 256 tokens" in out and "predicted prompt" in out and "predicted decode" in out


def test_calibrated_plan_refuses_a_hopeless_budget_before_calibrating(tiny_model: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("app.hub.calibrate.calibration_sequences", lambda *a, **k: pytest.fail("calibrated anyway"))
    code, out = _run([str(tiny_model), "--max-memory", "1MB", "--ctx", "256"], capsys)
    assert code == 1 and out.startswith("does not fit: needs at least")


def test_a_container_is_planned_at_its_own_widths(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """A container is quantized already: `plan` shows its widths against the budget (no calibration), and the
    experts that the budget leaves out stream."""
    from app.hub.convert import ConvertSettings, convert

    monkeypatch.setattr("app.hub.calibrate.calibration_sequences", lambda *a, **k: pytest.fail("calibrated a container"))
    out_dir = convert(tiny_model, tmp_path / "c", ConvertSettings(bits=4), log=lambda m: None)
    code, out = _run([str(out_dir), "--max-memory", "300MB", "--ctx", "256"], capsys)
    assert code == 0 and out.startswith("fits in memory")
    assert "4.50 (    4)" in out                                  # the container's 4-bit matrices, group 32
    from engine.loader import open_checkpoint

    ckpt = open_checkpoint(out_dir, verify=False)
    split = plan.split_for(ckpt.spec, 10**12, 256, BASELINE)
    layout = plan.container_layout(ckpt, split)
    experts = sum(layout.plan.tensors[n].nbytes for n in layout.experts)
    dense = layout.plan.total_bytes - experts
    budget = split.total - split.weights + dense + experts // 2     # room for half of the experts
    code, out = _run([str(out_dir), "--max-memory", f"{budget / 1e6:.6f}MB", "--ctx", "256"], capsys)
    assert code == 0 and out.startswith("fits with") and "streamed from disk" in out
    code, out = _run([str(out_dir), "--max-memory", "1MB", "--ctx", "256"], capsys)
    assert code == 1 and out.startswith("does not fit: needs at least")
