"""The probe sees the input of every weight matrix, by tensor name, with the matrix's input width."""

from __future__ import annotations

import pytest

from engine.kv import KVCache
from engine.loader import load_model
from engine.models.transformer import expected_shapes
from support.reference import build_checkpoint

PROMPT = list(range(3, 43))


@pytest.mark.parametrize("model_type, extra", [
    ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                       num_experts_per_tok=2, mlp_only_layers=[0])),
    ("deepseek_v3", dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                         v_head_dim=16, moe_intermediate_size=32, q_lora_rank=24, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)),
])
def test_probe_covers_every_matrix(tmp_path, model_type, extra):
    loaded = load_model(build_checkpoint(tmp_path / model_type, model_type, **extra))
    seen: dict[str, int] = {}

    def probe(name, x):
        shape = expected_shapes(loaded.spec).get(name, (None, loaded.spec.hidden_size))  # lm_head may be tied
        assert x.ndim == 2 and x.shape[1] == shape[1], name
        seen[name] = seen.get(name, 0) + x.shape[0]

    loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), probe=probe)
    matrices = {n for n, s in expected_shapes(loaded.spec).items() if len(s) == 2 and "embed_tokens" not in n}
    assert matrices | {"lm_head.weight"} == set(seen)  # 40 tokens over 4 experts: every expert is used
    assert seen["model.layers.0.self_attn.o_proj.weight"] == len(PROMPT)
    # each token goes to top_k experts: the experts' inputs add up to T * K rows per layer
    expert_rows = sum(v for n, v in seen.items() if ".experts." in n and "layers.1." in n and n.endswith(("gate_proj.weight", "w1.weight")))
    assert expert_rows == len(PROMPT) * extra["num_experts_per_tok"]
