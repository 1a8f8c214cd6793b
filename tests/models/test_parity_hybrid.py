"""Qwen3.5-MoE's text model and Kimi Linear against transformers.

Parity: prompt logits within 1e-4 of the largest logit and 32 greedy tokens identical (ours decoding from the
cache, the reference recomputing), over several configurations of each family covering its optional features,
then the config readers' defaults and refusals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from app.plan.speed_model import decode_calls
from engine.errors import ModelFormatError
from engine.fused.plan import FusedDecode, _NotFusable
from engine.kv import KVCache, KVPool, blocks_for
from engine.loader import load_model
from engine.models import spec_from_config
from engine.models.transformer import expected_shapes
from engine.spec import GatedDeltaNetSpec, KimiDeltaSpec
from support.families import FAMILIES
from support.reference import BASE, assert_matches_reference, build_checkpoint

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32

# --- Qwen3.5-MoE ---

QWEN_SMALL = dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=48)
QWEN_CASES = {
    # the default pattern (every 4th layer full), value heads grouped 2 per key head
    "interval-grouped": dict(QWEN_SMALL, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4),
    # full layers first and between, MHA with biases, half the head rotated, a 3-tap convolution, key and value
    # heads of different widths, top-1, multimodal RoPE sections (plain RoPE on text positions)
    "alternating-bias-partial": dict(QWEN_SMALL, num_hidden_layers=4, num_key_value_heads=4, attention_bias=True,
                                     layer_types=["full_attention", "linear_attention"] * 2, num_experts_per_tok=1,
                                     rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                      "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                                      "mrope_interleaved": True},
                                     linear_conv_kernel_dim=3, linear_num_key_heads=4, linear_num_value_heads=4,
                                     linear_key_head_dim=8),
    # one key head for four value heads, one KV head, tied embeddings, YaRN over the full rotary
    "mqa-tied-yarn": dict(QWEN_SMALL, num_hidden_layers=3, num_key_value_heads=1, tie_word_embeddings=True,
                          full_attention_interval=2, linear_num_key_heads=1, linear_num_value_heads=4,
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 128, "partial_rotary_factor": 1.0}),
}


@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_qwen3_5_moe_matches_transformers(case, tmp_path):
    folder = build_checkpoint(tmp_path / case, "qwen3_5_moe_text", **QWEN_CASES[case])
    loaded, ref, _ = assert_matches_reference(folder, PROMPT, N_GREEDY, architecture="Qwen3_5MoeForCausalLM")
    assert loaded.spec.is_recurrent


def build_vision_language(folder: Path, text: dict, seed: int = 0) -> Path:
    """A tiny Qwen3_5MoeForConditionalGeneration (text model and a one-block vision tower), saved as published:
    the text tensors under model.language_model., the vision tower's under model.visual."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=BASE["hidden_size"],
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    text = {**BASE, **text}
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=150, video_token_id=151,
                           vision_start_token_id=152, vision_end_token_id=153,
                           tie_word_embeddings=text.get("tie_word_embeddings", False))
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith((".bias", ".dt_bias")):
                p.normal_(0.0, 1.0 if name.endswith("dt_bias") else 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_5_moe_vision_language_checkpoint_runs_its_text_model(tmp_path, caplog, tied):
    folder = build_vision_language(tmp_path / "vl", dict(QWEN_SMALL, num_hidden_layers=4, linear_num_key_heads=2,
                                                         linear_num_value_heads=4, tie_word_embeddings=tied))
    with caplog.at_level("INFO", logger="engine.models.qwen3_5_moe"):
        loaded, _, _ = assert_matches_reference(folder, PROMPT, N_GREEDY,
                                                architecture="Qwen3_5MoeForConditionalGeneration")
    assert "vision tower" in caplog.text
    assert loaded.spec.n_layers == 4 and loaded.spec.tie_embeddings == tied


def test_qwen3_5_moe_fused_experts_are_cut_per_expert(tmp_path):
    """Experts stored fused per layer (experts.gate_up_proj [E, 2I, hidden], experts.down_proj [E, hidden, I],
    under model.language_model.) give the per-expert checkpoint's logits."""
    from safetensors.numpy import load_file, save_file

    folder = build_vision_language(tmp_path / "vl", dict(QWEN_SMALL, num_hidden_layers=2, linear_num_key_heads=2,
                                                         linear_num_value_heads=4, full_attention_interval=2))
    whole = load_model(folder)
    want = whole.model.forward(PROMPT, KVCache(whole.spec, 64), all_logits=True)
    whole.close()
    tensors = load_file(folder / "model.safetensors")
    for i in range(2):
        p = f"model.language_model.layers.{i}.mlp.experts"
        pieces = {n: [tensors.pop(f"{p}.{e}.{n}.weight") for e in range(4)] for n in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{p}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(pieces["gate_proj"],
                                                                                        pieces["up_proj"])])
        tensors[f"{p}.down_proj"] = np.stack(pieces["down_proj"])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    fused = load_model(folder)
    try:
        assert np.array_equal(fused.model.forward(PROMPT, KVCache(fused.spec, 64), all_logits=True), want)
    finally:
        fused.close()


def _qwen_config(**over) -> dict:
    base = dict(architectures=["Qwen3_5MoeForCausalLM"], hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, vocab_size=160, linear_num_key_heads=2, linear_num_value_heads=4)
    return {**base, **over}


def test_qwen3_5_moe_reference_defaults_are_read():
    spec = spec_from_config(_qwen_config())
    assert [type(layer.attn).__name__ for layer in spec.layers] == ["GatedDeltaNetSpec"] * 3 + ["AttentionSpec"]
    full, linear, moe = spec.layers[3].attn, spec.layers[0].attn, spec.layers[0].ffn
    assert full.head_dim == 256 and full.rope.dim == 64 and full.output_gate and full.n_kv_heads == 2
    assert isinstance(linear, GatedDeltaNetSpec) and linear.split_proj
    assert (moe.n_experts, moe.top_k, moe.shared_ffn, moe.shared_gate) == (256, 8, 512, True)
    assert all(layer.ffn == moe for layer in spec.layers)
    vl = spec_from_config(dict(architectures=["Qwen3_5MoeForConditionalGeneration"], tie_word_embeddings=True,
                               text_config={k: v for k, v in _qwen_config().items() if k != "architectures"}))
    assert vl.tie_embeddings and vl.layers == spec.layers
    text_tied = spec_from_config(dict(architectures=["Qwen3_5MoeForConditionalGeneration"],
                                      text_config={**_qwen_config(), "tie_word_embeddings": True}))
    assert not text_tied.tie_embeddings                 # the outer config's value (absent: False) decides


@pytest.mark.parametrize("over, key", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "full_attention"]), "layer_types"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(hidden_act="swish7"), "hidden_act"),
])
def test_qwen3_5_moe_unsupported_values_are_refused(over, key):
    with pytest.raises(ModelFormatError, match=key):
        spec_from_config(_qwen_config(**over))
    with pytest.raises(ModelFormatError, match=key):
        spec_from_config(dict(architectures=["Qwen3_5MoeForConditionalGeneration"], text_config=_qwen_config(**over)))


# --- Kimi Linear ---

KIMI_SMALL = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, num_key_value_heads=4, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
                  num_local_experts=8, num_experts_per_tok=2, linear_num_heads=2, linear_head_dim=16)
KIMI_CASES = {
    # KDA around a latent attention layer, the first layer dense, one shared expert, no query low-rank
    "mixed-dense-first": dict(KIMI_SMALL, num_hidden_layers=3,
                              layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # a query low-rank, biases, group-limited top-k without renormalisation, two shared experts, every layer
    # sparse, a 3-tap convolution, latent attention first
    "qlora-groups-bias-unnormed": dict(KIMI_SMALL, num_hidden_layers=3, q_lora_rank=32, attention_bias=True,
                                       n_group=4, topk_group=2, norm_topk_prob=False, n_shared_experts=2,
                                       routed_scaling_factor=1.5, mlp_layer_types=["sparse"] * 3,
                                       linear_conv_kernel_dim=3,
                                       layer_types=["full_attention", "linear_attention", "linear_attention"]),
    # the reference's default layer pattern (the 5th layer full) and first dense layer, a larger rms_norm_eps
    "default-pattern": dict(KIMI_SMALL, num_hidden_layers=5, rms_norm_eps=1e-3),
    # only KDA layers, four narrower heads, a dense layer between sparse ones, no shared expert, top-1,
    # tie_word_embeddings that the reference does not honour (its head stays its own; its cache needs an
    # attention layer: it runs without one)
    "all-kda-tied-top1": dict(KIMI_SMALL, num_hidden_layers=3, linear_num_heads=4, linear_head_dim=8,
                              layer_types=["linear_attention"] * 3, mlp_layer_types=["sparse", "dense", "sparse"],
                              n_shared_experts=0, num_experts_per_tok=1, tie_word_embeddings=True, use_cache=False),
}


@pytest.mark.parametrize("case", list(KIMI_CASES))
def test_kimi_linear_matches_transformers(case, tmp_path):
    folder = build_checkpoint(tmp_path / case, "kimi_linear", **KIMI_CASES[case])
    loaded, ref, _ = assert_matches_reference(folder, PROMPT, N_GREEDY, architecture="KimiLinearForCausalLM")
    assert loaded.spec.is_recurrent == ("linear_attention" in ref.config.layer_types)


def _kimi_config(**over) -> dict:
    base = dict(architectures=["KimiLinearForCausalLM"], hidden_size=64, num_hidden_layers=6, vocab_size=160)
    return {**base, **over}


def test_kimi_linear_reference_defaults_are_read():
    spec = spec_from_config(_kimi_config())
    kinds = ["MLASpec" if i == 4 else "KimiDeltaSpec" for i in range(6)]          # every 4th from index 4 full
    assert [type(layer.attn).__name__ for layer in spec.layers] == kinds
    assert [type(layer.ffn).__name__ for layer in spec.layers] == ["MLPSpec"] + ["MoESpec"] * 5
    mla, delta, moe = spec.layers[4].attn, spec.layers[0].attn, spec.layers[1].ffn
    assert mla.rope.kind == "none" and mla.q_lora_rank is None and mla.scale == (128 + 64) ** -0.5
    assert (delta.n_v_heads, delta.v_head_dim, delta.conv_kernel, delta.rms_eps) == (32, 128, 4, 1e-5)
    assert (moe.n_experts, moe.top_k, moe.shared_ffn, moe.scoring, moe.routed_scaling_factor) == \
        (256, 8, 1024, "sigmoid", 2.446)
    assert spec.max_position == 1048576 and spec.norm_offset == 0.0
    assert not spec_from_config(_kimi_config(tie_word_embeddings=True)).tie_embeddings
    # the published spelling: linear_attn_config (1-indexed layers) and the attribute_map's names
    published = spec_from_config(_kimi_config(
        linear_attn_config=dict(head_dim=16, num_heads=2, short_conv_kernel_size=3, full_attn_layers=[2, 6],
                                kda_layers=[1, 3, 4, 5]),
        num_experts=16, num_experts_per_token=4, num_shared_experts=2, moe_renormalize=False, num_expert_group=4,
        topk_group=2, model_max_length=4096, first_k_dense_replace=2, mla_use_nope=True,
        moe_router_activation_func="sigmoid", moe_layer_freq=1))
    assert [type(layer.attn).__name__ for layer in published.layers] == \
        ["KimiDeltaSpec", "MLASpec", "KimiDeltaSpec", "KimiDeltaSpec", "KimiDeltaSpec", "MLASpec"]
    assert (published.layers[0].attn.v_head_dim, published.layers[0].attn.conv_kernel) == (16, 3)
    moe = published.layers[2].ffn
    assert (moe.n_experts, moe.top_k, moe.shared_ffn, moe.norm_topk_prob, moe.n_group) == (16, 4, 2048, False, 4)
    assert type(published.layers[1].ffn).__name__ == "MLPSpec" and published.max_position == 4096


@pytest.mark.parametrize("over, key", [
    (dict(layer_types=["linear_attention", "sliding_attention"] * 3), "layer_types"),
    (dict(mlp_layer_types=["dense"]), "mlp_layer_types"),
    (dict(linear_attn_config=dict(full_attn_layers=[1], kda_layers=[2, 3])), "linear_attn_config"),
    (dict(num_attention_heads=4, num_key_value_heads=2), "num_key_value_heads"),
    (dict(num_experts=8, num_expert_group=3), "num_expert_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(linear_num_heads=0), "linear_num_heads"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(hidden_act="swish7"), "hidden_act"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
])
def test_kimi_linear_unsupported_values_are_refused(over, key):
    with pytest.raises(ModelFormatError, match=key):
        spec_from_config(_kimi_config(**over))


# --- KDA's recurrent state through the cache, on a 4-bit container (row-invariant kernels) ---

@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    model_type, overrides = FAMILIES["kimi_linear"]
    src = build_checkpoint(tmp_path_factory.mktemp("src"), model_type, **overrides)
    loaded = load_model(convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4),
                                log=lambda m: None))
    yield loaded.model
    loaded.close()


def _solo(model, tokens: list[int], steps: int = 0) -> list[np.ndarray]:
    """Prompt logits, then those of `steps` greedy tokens, on a fresh private cache."""
    cache = KVCache(model.spec, 128)
    out = [model.forward(tokens, cache, all_logits=True)]
    for _ in range(steps):
        out.append(model.forward([int(out[-1][-1].argmax())], cache))
    return out


def test_kda_prompt_in_pieces_gives_the_bits_of_one_pass(kimi):
    assert any(isinstance(layer.attn, KimiDeltaSpec) for layer in kimi.spec.layers)
    whole = _solo(kimi, PROMPT)[0]
    cache = KVCache(kimi.spec, 64)
    pieces = [kimi.forward(PROMPT[a:b], cache, all_logits=True) for a, b in ((0, 7), (7, 8), (8, 20))]
    assert np.array_equal(np.concatenate(pieces), whole)


def test_kda_batch_gives_each_sequence_its_solo_result(kimi):
    prompts = [PROMPT[:9], PROMPT[4:], [7, 8, 9]]
    solo = [_solo(kimi, p, steps=3) for p in prompts]
    pool = KVPool(kimi.spec, 3 * (blocks_for(128) + 1))
    caches = [KVCache(kimi.spec, 128, pool=pool) for _ in prompts]
    got = [[x] for x in kimi.forward_batch(list(zip(prompts, caches)), all_logits=True)]
    for _ in range(3):
        rows = kimi.forward_batch([([int(g[-1][-1].argmax())], c) for g, c in zip(got, caches)])
        for g, r in zip(got, rows):
            g.append(r)
    for want, have in zip(solo, got):
        for a, b in zip(want, have):
            assert np.array_equal(a, b)


def test_kda_truncating_into_the_last_short_step(kimi):
    cache = KVCache(kimi.spec, 128)
    kimi.forward(PROMPT, cache)
    kimi.forward([4, 5, 6, 7], cache)
    cache.truncate(len(PROMPT) + 2)                                # back into the last step: its kept states
    assert np.array_equal(kimi.forward([9], cache), _solo(kimi, PROMPT + [4, 5, 9])[0][-1:])


def test_kda_states_checkpointed_at_block_boundaries_serve_a_new_sequence(kimi):
    """A long step (past KEEP_STEP) hands back its KDA state at the block boundary too, so another sequence
    sharing the prefix restores it and gets the logits and tokens of no reuse."""
    pool = KVPool(kimi.spec, 400, block_size=4)
    first = KVCache(kimi.spec, 128, pool=pool)
    kimi.forward(PROMPT[:17], first)                               # one long step: its last boundary is 16
    assert pool.checkpoints.made == 1
    prompt = PROMPT[:18] + [8, 8, 8]
    other = KVCache(kimi.spec, 128, pool=pool)
    assert other.adopt(prompt) == 16
    got = [kimi.forward(prompt[16:], other, all_logits=True)]
    for _ in range(3):
        got.append(kimi.forward([int(got[-1][-1].argmax())], other))
    want = _solo(kimi, prompt, steps=3)
    assert np.array_equal(got[0], want[0][16:])
    for a, b in zip(got[1:], want[1:]):
        assert np.array_equal(a, b)


def test_the_fused_step_declines_kda(kimi):
    assert FusedDecode.for_model(kimi) is None
    with pytest.raises(_NotFusable, match="Kimi delta attention"):
        FusedDecode(kimi)


@pytest.mark.parametrize("config", [
    dict(architectures=["Qwen3_5MoeForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
         vocab_size=160, head_dim=16, num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2,
         linear_num_value_heads=4),
    dict(architectures=["KimiLinearForCausalLM"], hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
         vocab_size=160, linear_num_heads=2, linear_head_dim=32, kv_lora_rank=32, q_lora_rank=32),
], ids=["qwen3_5_moe", "kimi_linear"])
def test_the_speed_model_counts_every_attention_matrix(config):
    """The planner's decode cost counts each quantized matrix of the recurrent and attention blocks once."""
    spec = spec_from_config(config)
    shapes = expected_shapes(spec)
    mats = {n: (shape, 4) for n, shape in shapes.items()
            if len(shape) == 2 and (".self_attn." in n or ".linear_attn." in n) and not n.endswith("kv_b_proj.weight")}
    layers, _ = decode_calls(spec, mats)
    for i, calls in enumerate(layers):
        want = sum(o * k for n, (o, k) in ((n, m[0]) for n, m in mats.items()) if n.startswith(f"model.layers.{i}."))
        assert want and sum(c.weights for c in calls) == want, i
