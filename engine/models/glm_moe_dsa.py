"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3's latent attention and sigmoid-routed MoE, plus DeepSeek sparse
attention: an indexer per layer picks the `index_topk` keys each query attends to (layers marked "shared"
in `indexer_types` reuse the previous full layer's pick). Dense or sparse feed-forward per layer from
`mlp_layer_types`.

Defaults are the reference's (transformers' GlmMoeDsaConfig, i.e. GLM-5's own sizes): a config.json saved
without a key means that value.
"""

from __future__ import annotations

import math

from engine.errors import ModelFormatError
from engine.models.config import ROPE_BUFFERS, Config, dense_mlp, model_fields, moe_counts, rope_from_config
from engine.spec import IndexerSpec, LayerSpec, MLASpec, ModelSpec, MoESpec, RopeSpec

ARCHITECTURES = ("GlmMoeDsaForCausalLM",)

# transformers' GlmMoeDsaConfig defaults (GLM-5), for the keys read here
DEFAULTS = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78,
    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256,
    qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=202752, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    attention_bias=False, index_topk=2048, index_head_dim=128, index_n_heads=32, first_k_dense_replace=3,
)
LATENT_NORM_EPS = 1e-6   # q_a_layernorm, kv_a_layernorm: built without the config's rms_norm_eps
INDEXER_NORM_EPS = 1e-6  # the indexer key's LayerNorm


def _softmax_scale(qk_head_dim: int, rope: RopeSpec) -> float:
    """head_dim^-0.5, times mscale^2 when a scaled RoPE sets mscale_all_dim (YaRN's extended context)."""
    scale = qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim and rope.factor > 1:
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


def indexer_types(cfg: Config, n: int) -> list[str]:
    """Per layer "full" (runs its indexer) or "shared" (reuses the previous full layer's selection): the
    `indexer_types` list, else `index_topk_pattern` ("FSSF..."), else the `index_topk_freq` /
    `index_skip_topk_offset` schedule, as the reference derives them."""
    types = cfg.opt("indexer_types", None, list)
    if types is None:
        pattern = cfg.data.get("index_topk_pattern")
        if pattern is not None:
            cfg.require(isinstance(pattern, (str, list)), "index_topk_pattern", pattern, "a string of F and S")
            letters = {"F": "full", "S": "shared"}
            cfg.require(all(c in letters for c in pattern) if isinstance(pattern, str) else True,
                        "index_topk_pattern", pattern, "letters F (full) and S (shared)")
            types = [letters[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(cfg.opt("index_topk_freq", 1, int), 1)
            offset = cfg.opt("index_skip_topk_offset", 2, int)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    cfg.require(len(types) == n and all(t in ("full", "shared") for t in types), "indexer_types", types,
                f"{n} entries, each 'full' or 'shared'")
    cfg.require(types[0] == "full", "indexer_types", types, "a first layer that is 'full' (a shared layer reuses "
                "the selection of a full layer before it)")
    return types


def mlp_layer_types(cfg: Config, n: int) -> list[str]:
    """Per layer "dense" or "sparse": `mlp_layer_types`, else `first_k_dense_replace` dense layers then sparse."""
    types = cfg.opt("mlp_layer_types", None, list)
    if types is None:
        dense = min(cfg.opt("first_k_dense_replace", 3, int), n)
        types = ["dense"] * dense + ["sparse"] * (n - dense)
    cfg.require(len(types) == n and all(t in ("dense", "sparse") for t in types), "mlp_layer_types", types,
                f"{n} entries, each 'dense' or 'sparse'")
    return types


def spec_from_config(cfg: Config, architecture: str) -> ModelSpec:
    """The spec of a GLM-5 (GlmMoeDsa) config.json."""
    if "q_lora_rank" in cfg.data and cfg.data["q_lora_rank"] is None:
        raise ModelFormatError(f"{cfg.source}: 'q_lora_rank' is null, but {architecture} needs a query LoRA (its "
                               "sparse-attention indexer reads the query latent); the config is damaged")
    cfg = Config({**DEFAULTS, **{k: v for k, v in cfg.data.items() if v is not None}}, cfg.source)
    for key in ("rope_interleave", "indexer_rope_interleave"):
        cfg.require(cfg.opt(key, True, bool), key, cfg.data.get(key),
                    f"true: {architecture} rotates interleaved pairs (the reference implements no other layout)")
    scoring = cfg.opt("scoring_func", "sigmoid", str)
    cfg.require(scoring == "sigmoid", "scoring_func", scoring, f"'sigmoid' (the only router {architecture} has)")
    n = cfg.req("num_hidden_layers")
    heads = cfg.req("num_attention_heads")
    kv_heads = cfg.req("num_key_value_heads")
    cfg.require(kv_heads == heads, "num_key_value_heads", kv_heads,
                f"num_attention_heads ({heads}): latent attention expands keys and values for every head")

    rope_dim, nope = cfg.req("qk_rope_head_dim"), cfg.req("qk_nope_head_dim")
    rope = rope_from_config(cfg, rope_dim, interleaved=True)
    cfg.require(rope.dim == rope_dim, "partial_rotary_factor", cfg.data.get("partial_rotary_factor"),
                f"1 ({architecture} rotates the whole qk_rope_head_dim)")
    q_lora = cfg.req("q_lora_rank")
    index_dim, index_topk = cfg.req("index_head_dim"), cfg.req("index_topk")
    cfg.require(index_dim >= rope_dim, "index_head_dim", index_dim, f"at least qk_rope_head_dim ({rope_dim})")
    cfg.require(index_topk >= 1, "index_topk", index_topk, "at least 1 key")
    index_heads = cfg.req("index_n_heads")
    cfg.require(index_heads >= 1, "index_n_heads", index_heads, "at least 1 head")
    shared_from: int | None = None
    attns = []
    for i, kind in enumerate(indexer_types(cfg, n)):
        if kind == "full":
            shared_from = i
        indexer = IndexerSpec(n_heads=index_heads, head_dim=index_dim, topk=index_topk, rope_dim=rope_dim,
                              rope_interleaved=True, norm_eps=INDEXER_NORM_EPS, shared=kind == "shared",
                              source=shared_from if kind == "shared" else None)
        attns.append(MLASpec(
            n_heads=heads, q_lora_rank=q_lora, kv_lora_rank=cfg.req("kv_lora_rank"), qk_nope_dim=nope,
            qk_rope_dim=rope_dim, v_head_dim=cfg.req("v_head_dim"), rope=rope,
            scale=_softmax_scale(nope + rope_dim, rope), bias=cfg.opt("attention_bias", False, bool),
            norm_eps=LATENT_NORM_EPS, indexer=indexer,
        ))

    act = cfg.opt("hidden_act", "silu", str)
    kinds = mlp_layer_types(cfg, n)
    dense = dense_mlp(cfg, act) if "dense" in kinds else None
    moe = _moe(cfg, act, architecture) if "sparse" in kinds else None
    layers = tuple(LayerSpec(attn, dense if kind == "dense" else moe) for attn, kind in zip(attns, kinds))
    return ModelSpec(architecture=architecture, layers=layers, **model_fields(cfg))


def _moe(cfg: Config, act: str, architecture: str) -> MoESpec:
    """The routed block: sigmoid scores, a correction bias for choice, group-limited top-k, routed scaling,
    shared experts."""
    n_experts = cfg.first(("num_experts", "n_routed_experts", "num_local_experts"))
    top_k, expert_ffn = cfg.req("num_experts_per_tok"), cfg.req("moe_intermediate_size")
    moe_counts(cfg, n_experts, top_k, "n_routed_experts")
    n_group, topk_group = cfg.req("n_group"), cfg.req("topk_group")
    cfg.require(n_experts % n_group == 0 and n_experts // n_group >= 2, "n_group", n_group,
                f"a divisor of n_routed_experts ({n_experts}) leaving at least 2 experts a group (groups rank "
                "by their best two)")
    cfg.require(topk_group <= n_group, "topk_group", topk_group, f"at most n_group ({n_group})")
    cfg.require(top_k <= topk_group * (n_experts // n_group), "num_experts_per_tok", top_k,
                f"at most the {topk_group * (n_experts // n_group)} experts of the topk_group groups")
    shared = cfg.req("n_shared_experts")
    cfg.require(shared >= 1, "n_shared_experts", shared,
                f"at least 1 ({architecture} without a shared expert is not supported)")
    return MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        expert_ffn=expert_ffn,
        scoring="sigmoid",
        norm_topk_prob=cfg.opt("norm_topk_prob", True, bool),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=cfg.opt("routed_scaling_factor", 2.5, float),
        correction_bias=True,
        shared_ffn=expert_ffn * shared,
        act=act,
        shared_prefix="shared_experts",
    )


def ignored_tensors(cfg: Config) -> tuple[str, ...]:
    """Tensors its checkpoints carry that the model does not read: the multi-token-prediction layers.

    GLM-5 ships `num_nextn_predict_layers` MTP modules numbered from `num_hidden_layers` on (`model.layers.78.*`),
    a drafter for speculative decoding read only by the MTP drafter (`--speculative mtp`), not by next-token
    decoding.
    """
    n = cfg.opt("num_hidden_layers", DEFAULTS["num_hidden_layers"], int)
    mtp = cfg.opt("num_nextn_predict_layers", 0, int)
    cfg.require(mtp <= n, "num_nextn_predict_layers", mtp, f"at most num_hidden_layers ({n})")
    layers = "|".join(str(i) for i in range(n, n + mtp))
    return ROPE_BUFFERS + ((rf"model\.layers\.(?:{layers})\..+",) if mtp else ())


def mtp_spec(cfg: Config, architecture: str) -> ModelSpec | None:
    """The one-layer spec of the MTP module's decoder layer (a routed layer with its own indexer), or None
    without MTP layers."""
    from engine.models.deepseek import mtp_layer_spec

    return mtp_layer_spec(spec_from_config(cfg, architecture),
                          Config({"num_hidden_layers": DEFAULTS["num_hidden_layers"], **cfg.data}, cfg.source))
