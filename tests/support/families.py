"""Model-family configurations the parity, tenet, KV and batching tests share (tiny, 32-divisible widths)."""

# multi-head latent attention's extra sizes, on top of a tiny DeepSeek config
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           moe_intermediate_size=32)

# one of each MoE family (the parity cases' shapes, with widths the 32-wide quantization groups divide)
FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                                    num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_moe": ("qwen3_moe", dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
                                    norm_topk_prob=True, mlp_only_layers=[0])),
    "olmoe": ("olmoe", dict(num_experts=8, num_experts_per_tok=3, clip_qkv=0.8, norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", dict(MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                        n_shared_experts=1)),
    # fused experts in the checkpoint; sinks, biases, a clamp that bites and a window shorter than the prompts
    "gpt_oss": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=4,
                                swiglu_limit=0.5)),
    "granitemoe": ("granitemoe", dict(num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=4.0,
                                      residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)),
    # no shared expert and one group, so that the fused step runs GLM's partial RoPE, q/k norms and biases
    "glm4_moe": ("glm4_moe", dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, use_qk_norm=True,
                                  attention_bias=True, n_shared_experts=0, first_k_dense_replace=1)),
    "deepseek_v2": ("deepseek_v2", dict(MLA, q_lora_rank=None, n_routed_experts=16, num_experts_per_tok=3,
                                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                        routed_scaling_factor=2.0, first_k_dense_replace=1, n_shared_experts=1)),
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=4, head_dim=16, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                      linear_value_head_dim=16, mlp_only_layers=[1])),
    # GLM-5: latent attention with the sparse-attention indexer (top-4 keys: the selection matters past 4 tokens)
    "glm_moe_dsa": ("glm_moe_dsa", dict(MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                        topk_group=1, mlp_layer_types=["dense", "sparse", "sparse"],
                                        index_topk=4, index_head_dim=32, index_n_heads=8)),
    "minimax_m2": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, rotary_dim=8)),
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                                          moe_num_shared_experts=0)),       # fused: interleaved RoPE, biased router
    "phimoe": ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                              router_jitter_noise=0.3)),
    # Qwen3.5-MoE's text model: split DeltaNet projections, every layer sparse with a gated shared expert
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(num_hidden_layers=4, head_dim=16, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=64, num_experts=8,
                                                  num_experts_per_tok=2, linear_num_key_heads=2,
                                                  linear_num_value_heads=4, linear_key_head_dim=16,
                                                  linear_value_head_dim=16)),
    # Kimi Linear: KDA layers around a NoPE latent attention layer, DeepSeek-V3 routing with a shared expert (KDA's
    # gate up-projections take head_dim inputs: 32, so that 4-bit groups divide them)
    "kimi_linear": ("kimi_linear", dict(MLA, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                        num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2, n_group=2,
                                        topk_group=1, linear_num_heads=2, linear_head_dim=32,
                                        layer_types=["linear_attention", "full_attention", "linear_attention"])),
}
