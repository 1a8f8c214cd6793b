"""The speed model (app.plan.speed_model) and its measurements (app.plan.speed_probe): terms that scale the right way,
calls that follow the engine's blocks, hit rates from routing, constants measured by the real engine."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from app.plan import plan, speed_probe
from app.plan import speed_model as sm
from app.plan.speed_model import Rates

BASELINE = 100 * 10**6
RATES = Rates(threads=2, chunk=256, token_s=1e-4, layer_s=2e-4, chunk_s=1e-3, chunk_layer_s=1e-3, key_s=1e-7,
              pair_s=1e-7, fused=False, call_s={}, decode_wps={4: 10e9}, prompt_wps={4: 40e9}, expert_wps={4: 20e9}, ram_gbs=20.0,
              disk_gbs=1.0, seconds=0.0)
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "hidden_act": "silu",
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "tie_word_embeddings": False, "hidden_act": "silu",
}


def _work(tmp_path: Path, config: dict, share: float = 1.0, usage=None, name: str = "m") -> sm.Work:
    """The Work of `config` planned at 4 bits with `share` of the experts' bytes cached (usage: per expert index)."""
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    ckpt = plan.config_checkpoint(path)
    split = plan.split_for(ckpt.spec, 10**12, 512, BASELINE)
    layout = plan.config_layout(ckpt, split, 4, 4)
    tensors = layout.plan.tensors
    if usage is not None:
        tensors = {n: dataclasses.replace(t, usage=usage[int(n.split(".experts.")[1].split(".")[0])])
                   if n in layout.experts else t for n, t in tensors.items()}
    return sm.plan_work(ckpt.spec, dataclasses.replace(layout.plan, tensors=tensors), layout.experts, share,
                        usage is not None)


def test_decode_calls_follow_the_engine_blocks(tmp_path: Path) -> None:
    dense = _work(tmp_path, LLAMA, name="llama")
    shapes = sorted((c.shapes, k) for c, k in dense.calls.items())
    assert shapes == sorted([(((256, 256), (128, 256), (128, 256)), 4), (((256, 256),), 4),   # q/k/v, o
                             (((512, 256), (512, 256)), 4), (((256, 512),), 4)])              # gate/up, down
    assert dense.head_call.shapes == ((1024, 256),)                   # tied: the embedding is the head
    moe = _work(tmp_path, MIXTRAL, name="mixtral")
    experts = [c for c in moe.calls if len(c.shapes) in (2, 4) and c.shapes[0] == (512, 256)]
    assert [len(c.shapes) for c in experts] == [4]                     # gate and up of top_k = 2 experts: one call
    assert moe.calls[experts[0]] == 4                                  # once per layer


def test_every_term_is_positive_and_more_layers_are_slower(tmp_path: Path) -> None:
    short = _work(tmp_path, LLAMA, name="four")
    deep = _work(tmp_path, dict(LLAMA, num_hidden_layers=8), name="eight")
    a, b = sm.decode_step(short, RATES, 100), sm.decode_step(deep, RATES, 100)
    assert min(a.fixed, a.attention, a.kernels) > 0 and a.disk == 0
    assert b.fixed > a.fixed and b.attention > a.attention and b.kernels > a.kernels
    assert b.tok_s < a.tok_s
    assert sm.chunk_step(deep, RATES, 0, 256).tok_s < sm.chunk_step(short, RATES, 0, 256).tok_s


def test_longer_context_is_slower(tmp_path: Path) -> None:
    work = _work(tmp_path, LLAMA)
    assert sm.decode_step(work, RATES, 4000).attention > sm.decode_step(work, RATES, 10).attention
    speeds = sm.predict_speeds(work, RATES, 4096)
    assert speeds.full_decode_tok_s < speeds.decode_tok_s and speeds.full_prompt_tok_s < speeds.prompt_tok_s
    assert sm.prompt_seconds(work, RATES, 600) == pytest.approx(sum(sm.chunk_step(work, RATES, s, t).seconds
                                                                    for s, t in ((0, 256), (256, 256), (512, 88))))


def test_a_bigger_budget_is_never_slower(tmp_path: Path) -> None:
    slow_disk = dataclasses.replace(RATES, disk_gbs=0.05)
    speeds = []
    for share in (0.1, 0.25, 0.5, 0.75, 1.0):
        work = _work(tmp_path, MIXTRAL, share)
        assert work.hit_rate == pytest.approx(share, abs=1 / 32)       # uniform routing: hits follow the cache
        speeds.append((sm.decode_step(work, slow_disk, 100).tok_s, sm.chunk_step(work, slow_disk, 0, 256).tok_s))
    for (d0, p0), (d1, p1) in zip(speeds, speeds[1:]):
        assert d1 >= d0 and p1 >= p0
    assert speeds[-1][0] > speeds[0][0]


def test_reads_overlap_the_layers(tmp_path: Path) -> None:
    work = _work(tmp_path, MIXTRAL, 0.5)
    step = sm.decode_step(work, RATES, 100)
    assert step.disk > 0
    assert step.seconds == pytest.approx(step.fixed + step.attention + step.kernels - step.layers
                                         + max(step.layers, step.disk))
    assert step.seconds < step.fixed + step.attention + step.kernels + step.disk


def test_measured_routing_finds_more_experts_in_the_cache_than_uniform(tmp_path: Path) -> None:
    skewed = [0.9, 0.5, 0.3, 0.1, 0.1, 0.05, 0.03, 0.02]              # share of tokens each expert saw
    uniform = _work(tmp_path, MIXTRAL, 0.25)
    measured = _work(tmp_path, MIXTRAL, 0.25, usage=skewed)
    assert measured.routing != "uniform" and uniform.routing == "uniform"
    assert measured.hit_rate == pytest.approx((0.9 + 0.5) / sum(skewed))  # the two most used of 8 are cached
    assert measured.miss_bytes() < uniform.miss_bytes()
    assert sum(measured.experts.values()) == pytest.approx(sum(uniform.experts.values()))   # still top_k per token


def test_a_step_reads_each_missing_expert_once(tmp_path: Path) -> None:
    work = _work(tmp_path, MIXTRAL, 0.25)
    one, chunk, huge = work.miss_bytes(1), work.miss_bytes(256), work.miss_bytes(10**6)
    assert 0 < one < chunk <= huge == pytest.approx(work.cold_bytes.sum())
    assert one == pytest.approx(float(work.cold_usage @ work.cold_bytes))


def test_the_report_says_what_was_measured_and_what_assumed(tmp_path: Path) -> None:
    lines = sm.describe_speeds(sm.predict_speeds(_work(tmp_path, MIXTRAL, 0.25), RATES, 1024))
    text = "\n".join(lines)
    assert lines[0].startswith("predicted prompt") and lines[1].startswith("predicted decode")
    assert "measured now" in text and "assumed: " in text and "disk 1.00 GB/s" in text
    assert "routing uniform" in text and "hit rate 25%" in text
    skewed = _work(tmp_path, MIXTRAL, 0.25, usage=[0.9, 0.5, 0.3, 0.1, 0.1, 0.05, 0.03, 0.02])
    assert "as on the calibration text" in "\n".join(sm.describe_speeds(sm.predict_speeds(skewed, RATES, 1024)))
    resident = "\n".join(sm.describe_speeds(sm.predict_speeds(_work(tmp_path, LLAMA, name="d"), RATES, 1024)))
    assert "from disk" not in resident and "routing" not in resident


def test_tiny_models_keep_the_structure(tmp_path: Path) -> None:
    work = _work(tmp_path, MIXTRAL)
    codes = speed_probe.CodePool(1 << 20, np.random.default_rng(0))
    one, kinds, mats = speed_probe.tiny_model(work.spec, 3, work, codes)
    heads, _, _ = speed_probe.tiny_model(work.spec, 1, work, codes, heads=True)
    assert kinds == 1 and one.spec.n_layers == 3 and heads.spec.n_layers == 1
    moe, real = one.spec.layers[0].ffn, work.spec.layers[0].ffn
    assert (moe.n_experts, moe.top_k) == (real.n_experts, real.top_k)
    assert one.spec.layers[0].attn.n_heads == 1 and heads.spec.layers[0].attn == work.spec.layers[0].attn
    assert all(bits == 4 for _, bits in mats.values())
    from engine.kv import KVCache

    logits = one.forward([1, 2, 3], KVCache(one.spec, 8))
    assert np.isfinite(logits).all()


def test_the_engine_decides_which_models_decode_in_one_fused_step(tmp_path: Path) -> None:
    codes = speed_probe.CodePool(1 << 20, np.random.default_rng(0))
    resident = _work(tmp_path, MIXTRAL)
    assert resident.quantized and speed_probe.fuses(resident, speed_probe.tiny_model(resident.spec, 1, resident, codes)[0])
    streamed = _work(tmp_path, MIXTRAL, 0.5)                         # the fused step needs every expert in memory
    assert not speed_probe.fuses(streamed, speed_probe.tiny_model(streamed.spec, 1, streamed, codes)[0])
    olmoe = dict(MIXTRAL, architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=8,
                 clip_qkv=8.0)                                       # q/k/v clipping: one block at a time
    work = _work(tmp_path, olmoe, name="olmoe")
    assert not speed_probe.fuses(work, speed_probe.tiny_model(work.spec, 1, work, codes)[0])


def test_fused_and_per_call_decode_both_count_the_weights(tmp_path: Path) -> None:
    work = _work(tmp_path, LLAMA)
    per_call, fused = sm.decode_step(work, RATES, 100), sm.decode_step(work, dataclasses.replace(RATES, fused=True), 100)
    assert per_call.kernels == pytest.approx(fused.kernels)          # no call measured: both at the large-call rate
    measured = dataclasses.replace(RATES, call_s={c: 1e-3 for c in work.calls} | {work.head_call: 1e-3})
    assert sm.decode_step(work, measured, 100).kernels == pytest.approx(
        1e-3 * (sum(work.calls.values()) + 1) + work.float_bytes / 20e9)


@pytest.mark.parametrize("share", [1.0, 0.5])                       # decoded in one fused step, and block by block
def test_measured_constants_are_positive_and_cover_every_call(tmp_path: Path, share: float) -> None:
    work = _work(tmp_path, MIXTRAL, share)
    rates = speed_probe.measure_rates(work, 256, 1, None)
    assert rates.chunk == 256 and rates.threads == 1 and rates.disk_gbs is None    # no folder given: no disk read
    assert rates.fused == (share == 1.0)
    assert rates.fused == speed_probe.fuses(work, speed_probe.tiny_model(
        work.spec, 1, work, speed_probe.CodePool(1 << 20, np.random.default_rng(0)))[0])
    assert set(rates.call_s) == (set() if rates.fused else set(work.calls) | {work.head_call})
    assert all(v > 0 and math.isfinite(v) for v in rates.call_s.values())
    for rate in (rates.decode_wps, rates.prompt_wps, rates.expert_wps):
        assert rate.keys() == {4} and rate[4] > 0
    for name in ("token_s", "layer_s", "chunk_s", "chunk_layer_s", "key_s", "pair_s"):
        assert getattr(rates, name) >= 0 and math.isfinite(getattr(rates, name))
    assert rates.ram_gbs > 0 and rates.seconds > 0
    assert sm.predict_speeds(work, rates, 256).decode_tok_s > 0


def _family_config(model_type: str, **overrides) -> dict:
    """A tiny config.json of a family (tests/support/families.py's shapes), as transformers writes it."""
    from transformers import AutoConfig

    from support.families import FAMILIES
    from support.reference import BASE

    cfg = AutoConfig.for_model(model_type, **{**BASE, **FAMILIES[model_type][1], **overrides}).to_dict()
    cfg["architectures"] = [{"qwen3_next": "Qwen3NextForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[model_type]]
    return cfg


def _decode_weights(work: sm.Work) -> int:
    """Weights the layers' decode calls multiply, each call as often as a token makes it."""
    return sum(k * c.weights for c, k in work.calls.items())


def test_deltanet_layers_count_their_projections_and_no_keys(tmp_path: Path) -> None:
    work = _work(tmp_path, _family_config("qwen3_next"), name="next")
    spec = work.spec
    recurrent = [i for i, layer in enumerate(spec.layers) if isinstance(layer.attn, sm.GatedDeltaNetSpec)]
    attention = [i for i in range(spec.n_layers) if i not in recurrent]
    assert recurrent and attention
    a = spec.layers[recurrent[0]].attn
    key, value = a.n_k_heads * a.k_head_dim, a.n_v_heads * a.v_head_dim
    h = spec.hidden_size
    shapes = {c.shapes for c in work.layer_calls[recurrent[0]]}
    assert {((2 * key + 2 * value, h),), ((2 * a.n_v_heads, h),), ((h, value),)} <= shapes
    # every quantized matrix outside the routed experts and the head is in some call, as the fused count has it
    assert _decode_weights(work) - sum(int(w) for w in work.experts.values()) == sum(work.dense.values())
    # attention: only the attention layers see keys, each every one before it
    assert sm._window_keys(spec, 99, 1) == 100 * len(attention)
    assert sm._window_keys(spec, 0, 10) == 55 * len(attention)


def test_the_sparse_attention_indexer_is_counted(tmp_path: Path) -> None:
    work = _work(tmp_path, _family_config("glm_moe_dsa"), name="glm5")
    spec = work.spec
    a = spec.layers[0].attn
    assert isinstance(a, sm.MLASpec) and a.indexer is not None and not a.indexer.shared
    ix, h = a.indexer, spec.hidden_size
    shapes = {c.shapes for c in work.layer_calls[0]}
    assert {((ix.head_dim, h),), ((ix.n_heads * ix.head_dim, a.q_lora_rank),)} <= shapes
    assert ((ix.n_heads, h),) not in shapes           # its head weights stay float32: read at the RAM rate
    assert _decode_weights(work) - sum(int(w) for w in work.experts.values()) == sum(work.dense.values())
    # the main attention reads the top-k keys only; the indexer scores all of them at its share of a key
    share = sm.index_share(a)
    assert share == ix.n_heads * ix.head_dim / (a.n_heads * (2 * a.kv_lora_rank + a.qk_rope_dim))
    keys = sm._window_keys(spec, 999, 1)
    assert keys == pytest.approx(spec.n_layers * (ix.topk + 1000 * share))
    assert sm._window_keys(spec, 1, 1) == pytest.approx(spec.n_layers * 2 * (1 + share))    # fewer than top-k seen
    dense = dataclasses.replace(spec, layers=tuple(dataclasses.replace(layer, attn=dataclasses.replace(
        layer.attn, indexer=None)) for layer in spec.layers))
    assert sm._window_keys(dense, 999, 1) == 1000 * spec.n_layers         # without it: every key


# widths a quantization group divides, as in real models (the parity shapes' 16-wide heads are not)
WIDE = {"qwen3_next": dict(head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32),
        "glm_moe_dsa": dict(kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32)}


@pytest.mark.parametrize("model_type", sorted(WIDE))
def test_tiny_models_of_recurrent_and_latent_layers_run(tmp_path: Path, model_type: str) -> None:
    """The probe's tiny models keep each layer kind, with one head (of each kind) unless asked for all."""
    from engine.kv import KVCache

    work = _work(tmp_path, _family_config(model_type, **WIDE[model_type]), name=model_type)
    codes = speed_probe.CodePool(1 << 20, np.random.default_rng(0))
    one, _, _ = speed_probe.tiny_model(work.spec, 1, work, codes)
    heads, _, _ = speed_probe.tiny_model(work.spec, 1, work, codes, heads=True)
    assert {type(layer.attn) for layer in one.spec.layers} == {type(layer.attn) for layer in work.spec.layers}
    for tiny, real in zip(heads.spec.layers, one.spec.layers):
        if isinstance(tiny.attn, sm.GatedDeltaNetSpec):
            assert (real.attn.n_k_heads, real.attn.n_v_heads // real.attn.n_k_heads) == (
                1, tiny.attn.n_v_heads // tiny.attn.n_k_heads)
    for model in (one, heads):
        assert np.isfinite(model.forward([1, 2, 3], KVCache(model.spec, 8))).all()
