"""`colibri convert` / `colibri info`: containers that load like any model, planned or uniform, resumable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.formats.container import Container
from engine.kv import KVCache
from engine.loader import load_model, open_checkpoint
from engine.models.transformer import Transformer
from engine.plan.planner import parse_keep_bits
from support.reference import build_checkpoint

PROMPT = list(range(5, 29))
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", **MIXTRAL)


class DequantizedSource:
    """A container's tensors with every quantized one dequantized: the float32 model it stands for."""

    def __init__(self, container: Container):
        self.c, self.path = container, container.path

    def names(self):
        return self.c.names()

    def shape(self, name):
        return self.c.shape(name)

    def location(self, name):
        return self.c.location(name)

    def load(self, name):
        t = self.c.load(name)
        return t if isinstance(t, np.ndarray) else t.dequantize()


def _logits(model, ids=PROMPT):
    return model.forward(ids, KVCache(model.spec, 64), all_logits=True)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_container_runs_its_quantized_weights(src, tmp_path, bits):
    out = convert(src, tmp_path / "q", ConvertSettings(bits=bits), log=lambda m: None)
    loaded = load_model(out)
    c = Container.open(out)
    reference = Transformer(loaded.spec, DequantizedSource(c))
    ours, expected = _logits(loaded.model), _logits(reference)
    q = c.load("model.layers.0.block_sparse_moe.experts.1.w2.weight")
    assert q.bits == bits and not isinstance(q, np.ndarray)
    if bits in (4, 8):
        # 4- and 8-bit matrices take the rows16 layout, whose kernels round activations to 8 bits per 32-block
        # (tests/kernels/test_rows16.py checks them bit for bit): close to the float weights' logits, not equal
        assert q.layout == "rows16"
        assert np.abs(ours - expected).max() <= 5e-2 * np.abs(expected).max()
    else:
        assert np.abs(ours - expected).max() <= 1e-4 * np.abs(expected).max()  # the kernels, not the rounding
    assert c.manifest["plan"]["bits_per_weight"] == pytest.approx(bits + 16 / 32 + (16 / 32 if bits <= 3 else 0), abs=0.6)


def test_keep_bits_and_float32_tensors(src, tmp_path):
    keep = tuple(parse_keep_bits(["*self_attn*=8", "lm_head.weight=32"]))
    out = convert(src, tmp_path / "q", ConvertSettings(bits=4, keep=keep), log=lambda m: None)
    c = Container.open(out)
    assert c.entries["model.layers.1.self_attn.q_proj.weight"].quant["bits"] == 8
    assert c.entries["model.layers.1.block_sparse_moe.experts.0.w1.weight"].quant["bits"] == 4
    assert c.entries["lm_head.weight"].kind == "f32"
    assert c.entries["model.layers.0.block_sparse_moe.gate.weight"].kind == "f32"   # routers stay float32
    assert c.entries["model.norm.weight"].kind == "f32"


@pytest.fixture(scope="module")
def tok_src(tmp_path_factory, hf_smol):
    """A tiny Llama with SmolLM2's tokenizer, so that calibration text can be read."""
    folder = build_checkpoint(tmp_path_factory.mktemp("tok"), "llama", vocab_size=49152, hidden_size=128,
                              intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    hf_smol.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_budget_plan_fits_and_beats_uniform_on_measured_error(tok_src, tmp_path):
    from app.hub.convert import classify, make_plan
    from engine.plan.calibration import collect_stats
    from engine.plan.planner import Plan

    calib = tmp_path / "calib.txt"
    calib.write_text((Path(__file__).resolve().parents[2] / "assets" / "probes" / "heldout.txt").read_text()[:6000])
    ckpt = open_checkpoint(tok_src)
    mats = classify(ckpt)
    n = sum(s[0] * s[1] for s in mats.planned.values())
    other = sum(int(np.prod(s)) * 4 for s in mats.float32.values())
    budget = int(n * 4.25 / 8) + other
    out = convert(tok_src, tmp_path / "planned", ConvertSettings(budget=budget, calib=calib, calib_tokens=1024),
                  log=lambda m: None)
    plan = Container.open(out).manifest["plan"]
    bits = {t["bits"] for t in plan["tensors"].values()}
    assert len(bits) > 1                                   # a mix, not one width
    assert sum(t["nbytes"] for t in plan["tensors"].values()) + other <= budget
    assert 3.5 < plan["bits_per_weight"] <= 4.3
    # the same measurements, uniform 4 bits at group 64 (4.25 bits per weight): more error
    stats = collect_stats(Transformer(ckpt.spec, ckpt.source), [ckpt.tokenizer.encode(calib.read_text())[:1024]])
    planned: Plan = make_plan(ckpt, mats, ConvertSettings(budget=budget, group=32), stats, lambda m: None)
    uniform = make_plan(ckpt, mats, ConvertSettings(bits=4, group=64), stats, lambda m: None)
    from engine.plan.planner import Format, measure_options

    def error_of(p):
        total = 0.0
        for name, t in p.tensors.items():
            if t.bits == 32:
                continue  # float32: no error
            w = np.asarray(ckpt.source.load(name), np.float32)
            imp, usage = stats.importance(name), stats.usage(name)
            if name == "model.embed_tokens.weight":  # untied: a token reads one row (as make_plan weighs it)
                imp, usage = None, 1 / ckpt.spec.vocab_size
            fmt = Format(t.bits, t.group, bool(t.asymmetric) if t.asymmetric is not None else t.bits == 2)
            opt = measure_options(w, imp, usage, [fmt])[0]
            total += opt.error
        return total

    assert planned.planned_bytes <= uniform.planned_bytes * 1.01
    assert error_of(planned) < error_of(uniform)


def test_interrupted_conversion_resumes_to_the_same_container(src, tmp_path, monkeypatch):
    from engine.formats import container as container_mod

    whole = convert(src, tmp_path / "whole", ConvertSettings(bits=4), log=lambda m: None)
    real = container_mod.ContainerWriter.add_expert
    calls = {"n": 0}

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(container_mod.ContainerWriter, "add_expert", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "again", ConvertSettings(bits=4), log=lambda m: None)
    monkeypatch.setattr(container_mod.ContainerWriter, "add_expert", real)
    log: list[str] = []
    again = convert(src, tmp_path / "again", ConvertSettings(bits=4), log=log.append)
    assert any("resuming" in m for m in log)
    assert Container.open(again).model_hash == Container.open(whole).model_hash


def _colibri(*args):
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_convert_info_and_run(src, tmp_path):
    out = tmp_path / "q8"
    proc = _colibri("convert", str(src), str(out), "--bits", "8")
    assert proc.returncode == 0, proc.stderr
    assert "bits per weight" in proc.stdout
    info = _colibri("info", str(out))
    assert info.returncode == 0 and "model hash" in info.stdout and "int8 g32" in info.stdout
    assert "experts.*.w1" in info.stdout  # experts summarised per layer
    run = _colibri("run", str(out), "--tokens", "1,2,3", "--max-tokens", "4", "--json")
    assert run.returncode == 0, run.stderr and len(json.loads(run.stdout)["tokens"]) == 4


def test_cli_errors(src, tmp_path):
    proc = _colibri("convert", str(src), str(tmp_path / "x"))
    assert proc.returncode == 2  # neither --bits nor --budget
    proc = _colibri("convert", str(src), str(tmp_path / "x"), "--budget", "lots")
    assert proc.returncode == 2 and "write a size such as" in proc.stderr
    proc = _colibri("convert", str(src), str(tmp_path / "x"), "--budget", "1KB", "--calib", str(tmp_path / "nope.txt"))
    assert proc.returncode == 2 and "colibri: error:" in proc.stderr and "Traceback" not in proc.stderr
    proc = _colibri("convert", str(src), str(tmp_path / "x"), "--bits", "4", "--keep-bits", "oops")
    assert proc.returncode == 2 and "PATTERN=BITS" in proc.stderr


def test_corrupt_container_is_refused_by_the_loader(src, tmp_path):
    from engine.errors import ModelFormatError

    out = convert(src, tmp_path / "q", ConvertSettings(bits=4), log=lambda m: None)
    blob = bytearray((out / "dense.bin").read_bytes())
    blob[100] ^= 1
    (out / "dense.bin").write_bytes(bytes(blob))
    with pytest.raises(ModelFormatError, match="checksum mismatch"):
        load_model(out)


def test_a_container_is_not_converted_again(src, tmp_path):
    from engine.errors import ColibriError

    out = convert(src, tmp_path / "q", ConvertSettings(bits=4), log=lambda m: None)
    with pytest.raises(ColibriError, match="already a Colibri container; convert the model it was made from"):
        convert(out, tmp_path / "again", ConvertSettings(bits=8), log=lambda m: None)
    assert not (tmp_path / "again").exists()
