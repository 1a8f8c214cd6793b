"""GLM-5 (`glm_moe_dsa`) against transformers on tiny random checkpoints read from disk.

Latent attention with DeepSeek sparse attention: the indexer's `index_topk` is below the prompt length in
most cases, so the keys it selects change the answer (checked against the reference with the selection
lifted), in the prompt's prefill, in a prefill that continues a cache, and in cached decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.kv import KVCache
from engine.loader import load_model
from engine.models import spec_from_config
from support.families import MLA
from support.reference import (
    assert_matches_reference,
    build_checkpoint,
    load_reference,
    reference_logits,
    relative_error,
)

pytestmark = pytest.mark.parity   # this module checks GLM-5 against transformers

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
GLM5 = dict(MLA, q_lora_rank=32, index_head_dim=16, index_n_heads=8)
CASES = {
    "glm5-topk4-groups": dict(GLM5, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                              first_k_dense_replace=1, index_topk=4),
    "glm5-topk-above-context-mixed-mlp": dict(GLM5, n_routed_experts=6, num_experts_per_tok=3, index_topk=64,
                                              index_head_dim=8, mlp_layer_types=["sparse", "dense", "sparse"],
                                              n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    "glm5-shared-indexer-bias-yarn": dict(GLM5, num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2,
                                          index_topk=6, indexer_types=["full", "shared", "shared", "full"],
                                          mlp_layer_types=["dense", "sparse", "dense", "sparse"],
                                          attention_bias=True, rope_parameters=YARN, rms_norm_eps=1e-3,
                                          tie_word_embeddings=True),
    "glm5-all-sparse-wide-indexer": dict(MLA, kv_lora_rank=32, v_head_dim=24, q_lora_rank=16, n_routed_experts=16,
                                         num_experts_per_tok=4, n_group=2, topk_group=2, index_topk=8,
                                         index_head_dim=24, index_n_heads=16, first_k_dense_replace=0,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # 4 indexer heads: relu zeroes whole score rows, so exact ties straddle the top-k boundary (kept as torch.topk does)
    "glm5-few-index-heads-ties": dict(GLM5, n_routed_experts=8, num_experts_per_tok=2, index_topk=4, index_n_heads=4),
}


def _dense_reference(folder):
    """The same checkpoint as transformers runs it with every key selected (index_topk past any context)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                index_topk=1 << 20).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_glm5_matches_transformers(case, tmp_path):
    folder = build_checkpoint(tmp_path / case, "glm_moe_dsa", **CASES[case])
    _, _, expected = assert_matches_reference(folder, PROMPT, N_GREEDY, architecture="GlmMoeDsaForCausalLM")
    if CASES[case]["index_topk"] < len(PROMPT):      # the selection is exercised: lifting it changes the answer
        assert relative_error(reference_logits(_dense_reference(folder), PROMPT), expected) > 1e-3


def test_a_prefill_continuing_a_cache_selects_among_the_cached_keys(tmp_path):
    """Queries of a second chunk score the first chunk's cached indexer keys as the reference recomputes them."""
    folder = build_checkpoint(tmp_path / "chunks", "glm_moe_dsa", **CASES["glm5-shared-indexer-bias-yarn"])
    loaded = load_model(folder)
    cache = KVCache(loaded.spec, 64)
    loaded.model.forward(PROMPT[:7], cache)
    second = loaded.model.forward(PROMPT[7:], cache, all_logits=True)
    expected = reference_logits(load_reference(folder), PROMPT)[7:]
    assert relative_error(second, expected) < 1e-4


def test_the_indexer_keys_are_cached_per_token(tmp_path):
    """Layers with an indexer keep its keys in the KV pool (and count them in the KV budget); shared layers do not."""
    from engine.offload.budget import kv_bytes

    folder = build_checkpoint(tmp_path / "kv", "glm_moe_dsa", **CASES["glm5-shared-indexer-bias-yarn"])
    spec = load_model(folder).spec
    cache = KVCache(spec, 64)
    assert ["ik" in layer for layer in cache.pool.layers] == [True, False, False, True]
    latent = (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 4 + 8
    assert kv_bytes(spec, 10) == 10 * (4 * latent + 2 * (GLM5["index_head_dim"] * 4 + 4))


def _config(**overrides) -> dict:
    data = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": 6,
            "hidden_size": 64, "vocab_size": 160, "num_attention_heads": 4, "num_key_value_heads": 4}
    return {**data, **overrides}


@pytest.mark.parametrize("schedule", [dict(), dict(index_topk_freq=3, index_skip_topk_offset=1),
                                      dict(index_topk_freq=2), dict(index_topk_pattern="FSSFSF")])
def test_indexer_types_derive_as_the_reference_derives_them(schedule):
    from transformers import GlmMoeDsaConfig

    want = GlmMoeDsaConfig(num_hidden_layers=6, **schedule).indexer_types
    spec = spec_from_config(_config(**schedule))
    assert ["shared" if layer.attn.indexer.shared else "full" for layer in spec.layers] == want


def test_defaults_are_glm5s():
    """A config.json saved without a key means the reference's default: GLM-5's sizes."""
    spec = spec_from_config({"architectures": ["GlmMoeDsaForCausalLM"]})
    assert spec.n_layers == 78 and spec.hidden_size == 6144 and spec.rms_eps == 1e-5
    assert sum(layer.ffn.__class__.__name__ == "MoESpec" for layer in spec.layers) == 75
    attn, moe = spec.layers[3].attn, spec.layers[3].ffn
    assert attn.kv_lora_rank + attn.qk_rope_dim == 576 and attn.indexer.topk == 2048
    assert (moe.n_experts, moe.top_k, moe.routed_scaling_factor, moe.shared_ffn) == (256, 8, 2.5, 2048)


@pytest.mark.parametrize("bad, key", [
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(indexer_types=["shared"] + ["full"] * 5), "indexer_types"),
    (dict(indexer_types=["full"] * 5), "indexer_types"),
    (dict(mlp_layer_types=["dense"] * 5 + ["moe"]), "mlp_layer_types"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(indexer_rope_interleave=False), "indexer_rope_interleave"),
    (dict(n_shared_experts=0), "n_shared_experts"),
    (dict(n_routed_experts=8, n_group=8), "n_group"),
    (dict(index_head_dim=32, qk_rope_head_dim=64), "index_head_dim"),
])
def test_configs_it_cannot_run_are_refused(bad, key):
    with pytest.raises(ModelFormatError, match=key):
        spec_from_config(_config(**bad))


def test_mtp_layers_are_ignored():
    """The MTP layers (model.layers.N.*) are allowed unread; the decoder layers are not."""
    from engine.models import ignored_tensors

    pattern = ignored_tensors(_config(num_nextn_predict_layers=1))
    assert pattern.fullmatch("model.layers.6.eh_proj.weight")
    assert not pattern.fullmatch("model.layers.5.self_attn.indexer.wk.weight")


@pytest.mark.parametrize("n", [3, 10, 40, 300])
def test_tied_scores_are_kept_as_torch_topk_keeps_them(n):
    """Among exactly equal scores the reference keeps what libstdc++'s selection leaves in front."""
    import torch

    from engine.kernels.topk import reference_topk

    rng = np.random.default_rng(n)
    for trial in range(40):
        x = np.where(rng.random(n) < 0.5, 0.0, rng.standard_normal(n)).astype(np.float32)
        if trial % 4 == 0:
            x[: n // 2] = -np.inf                         # a causal row's masked tail (here in front)
        for k in sorted({1, 2, min(4, n), min(8, n)}):
            want = torch.from_numpy(x).topk(k).indices.sort().values.tolist()
            assert reference_topk(x, k) == want, (trial, k)
