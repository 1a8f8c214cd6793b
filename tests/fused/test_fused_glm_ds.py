"""The fused decode step on GLM-4.5 layers: partial RoPE, per-head q/k norms and q/k/v biases give the same
bits as the blocks run one at a time; GLM's shared experts and groups, and DeepSeek-V2's latent attention,
decode through the blocks."""

from __future__ import annotations

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.families import MLA
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9]
STEPS = 12
GLM = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=0)

FUSED = {
    "glm-half-rope-qk-norm-bias": ("glm4_moe", dict(GLM, use_qk_norm=True, attention_bias=True)),
    "glm-quarter-rope-head-dim": ("glm4_moe", dict(GLM, head_dim=32, partial_rotary_factor=0.25,
                                                   first_k_dense_replace=0, routed_scaling_factor=2.0)),
}
BLOCKS_ONLY = {
    "glm-shared-groups": ("glm4_moe", dict(GLM, n_shared_experts=1, n_group=2, topk_group=1)),
    "deepseek-v2-lite": ("deepseek_v2", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2)),
}


def _model(tmp_path_factory, model_type: str, overrides: dict):
    src = build_checkpoint(tmp_path_factory.mktemp(model_type), model_type, **overrides)
    return load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None))


def _greedy(model, fused: bool, pool: KVPool | None = None):
    model.context.fused_decode = fused
    cache = KVCache(model.spec, 64, pool=pool)
    logits = model.forward(PROMPT, cache)[-1]
    out, routes = [], []
    for _ in range(STEPS):
        token = int(logits.argmax())
        routing = []
        logits = model.forward([token], cache, routing=routing)[-1]
        out.append(logits)
        routes.append([(r.layer, r.experts.tolist(), r.weights.tobytes()) for r in routing])
    cache.release()
    return np.stack(out), routes


@pytest.mark.parametrize("name", list(FUSED))
def test_glm_fused_steps_equal_the_blocks(tmp_path_factory, name):
    model = _model(tmp_path_factory, *FUSED[name]).model
    want_logits, want_routes = _greedy(model, fused=False)
    logits, routes = _greedy(model, fused=True, pool=KVPool(model.spec, 32, block_size=4))
    assert model.context.fused not in (None, False)               # built, and it ran the steps
    assert np.array_equal(logits, want_logits)
    assert routes == want_routes


@pytest.mark.parametrize("name", list(BLOCKS_ONLY))
def test_layers_the_kernel_does_not_run_take_the_blocks(tmp_path_factory, name):
    model = _model(tmp_path_factory, *BLOCKS_ONLY[name]).model
    want_logits, _ = _greedy(model, fused=False)
    logits, _ = _greedy(model, fused=True)
    assert model.context.fused is None                            # looked at once, and declined
    assert np.array_equal(logits, want_logits)
