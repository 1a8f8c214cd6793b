"""Every architecture against transformers on tiny random checkpoints read from disk.

Prompt logits must agree within 1e-4 of the logits' largest magnitude, and 32 greedy tokens
(ours with the KV cache, the reference recomputing the whole sequence) must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.blocks.ffn import Routing
from engine.kv import KVCache
from engine.loader import load_model
from support.families import MLA
from support.reference import (
    assert_matches_reference,
    build_checkpoint,
    load_reference,
    reference_logits,
    relative_error,
)

pytestmark = pytest.mark.parity   # this module checks each architecture against transformers

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    # dense
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-mha-untied-bias": ("llama", dict(num_key_value_heads=4, attention_bias=True)),
    "llama-mqa-llama3-rope": ("llama", dict(num_key_value_heads=1, rope_scaling=LLAMA3, rope_theta=500000.0)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("qwen2", dict()),
    "qwen2-sliding-window": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3-head-dim": ("qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-mqa": ("qwen3", dict(num_key_value_heads=1, head_dim=16)),
    # MoE
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-top1-mha": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=1, num_key_value_heads=4)),
    "qwen2moe-shared-norm": ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                               num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen2moe-sparse-step": ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=40,
                                               num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                                               decoder_sparse_step=2, mlp_only_layers=[2])),
    "qwen3moe-norm": ("qwen3_moe", dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                        head_dim=16, norm_topk_prob=True)),
    "qwen3moe-mlp-only": ("qwen3_moe", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                            norm_topk_prob=False, mlp_only_layers=[0])),
    "olmoe": ("olmoe", dict(num_experts=6, num_experts_per_tok=2)),
    "olmoe-clip-norm": ("olmoe", dict(num_experts=8, num_experts_per_tok=3, clip_qkv=0.8, norm_topk_prob=True)),
    "deepseek3-qlora-groups": ("deepseek_v3", dict(MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
                                                   n_group=4, topk_group=2, first_k_dense_replace=1,
                                                   routed_scaling_factor=2.5, n_shared_experts=1)),
    "deepseek3-no-qlora-plain-rope": ("deepseek_v3", dict(MLA, q_lora_rank=None, n_routed_experts=6,
                                                          num_experts_per_tok=3, n_group=1, topk_group=1,
                                                          first_k_dense_replace=0, rope_interleave=False,
                                                          norm_topk_prob=False, n_shared_experts=2)),
    "deepseek3-yarn": ("deepseek_v3", dict(MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                           n_group=2, topk_group=1, first_k_dense_replace=2,
                                           rope_scaling=YARN, max_position_embeddings=512)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_architecture_matches_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    folder = build_checkpoint(tmp_path / case, model_type, **overrides)
    assert_matches_reference(folder, PROMPT, N_GREEDY)


def test_bf16_and_fp16_checkpoints_load_exactly(tmp_path):
    """Half-precision files are widened to float32 exactly as torch widens them."""
    for dtype in ("bfloat16", "float16"):
        folder = build_checkpoint(tmp_path / dtype, "qwen3", dtype=dtype, head_dim=16)
        loaded = load_model(folder)
        ours = loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), all_logits=True)
        assert relative_error(ours, reference_logits(load_reference(folder), PROMPT)) < 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    folder = build_checkpoint(tmp_path / "sharded", "mixtral", shard_size="100KB", num_local_experts=4,
                              num_experts_per_tok=2)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    loaded = load_model(folder)
    ours = loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), all_logits=True)
    assert relative_error(ours, reference_logits(load_reference(folder), PROMPT)) < 1e-4


def test_float32_weights_are_memory_mapped(tmp_path):
    folder = build_checkpoint(tmp_path / "mapped", "llama")
    loaded = load_model(folder)
    wq = loaded.model.layers[0].attn.wq
    assert not wq.flags.owndata and not wq.flags.writeable  # a read-only view of the file's map


def test_routing_is_reported_as_the_reference_routes(tmp_path):
    """The MoE block exposes per-token, per-layer expert choices: they are the reference router's top-k."""
    import torch

    folder = build_checkpoint(tmp_path / "route", "mixtral", num_local_experts=8, num_experts_per_tok=2)
    ref = load_reference(folder)
    with torch.no_grad():
        out = ref(torch.tensor([PROMPT]), output_router_logits=True)
    loaded = load_model(folder)
    routing: list[Routing] = []
    loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), routing=routing)
    assert [r.layer for r in routing] == list(range(loaded.spec.n_layers))
    for r, logits in zip(routing, out.router_logits):
        expected = torch.topk(logits.float().softmax(-1), 2, dim=-1).indices.numpy()
        assert np.array_equal(np.sort(r.experts, axis=1), np.sort(expected, axis=1))
        assert np.allclose(r.weights.sum(axis=1), 1.0, atol=1e-6)  # Mixtral renormalises the top-k
