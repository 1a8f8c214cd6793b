"""GGUF files of the MoE architectures as llama.cpp names them: olmoe, deepseek2, glm4moe, gpt-oss.

Each test writes a tiny random transformers checkpoint as llama.cpp's converter would
(support.gguf_writer.convert_like_llama_cpp: its names, metadata keys and transformations), loads the
GGUF with Colibri and compares it with transformers running the checkpoint with the values the file
holds (F16 rounding applied to the same weights).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.kv import KVCache
from engine.loader import load_model
from support.gguf_writer import F16, F32, convert_like_llama_cpp, write_gguf
from support.reference import build_checkpoint, load_reference, reference_greedy, reference_logits, relative_error

pytestmark = pytest.mark.parity   # each model read from a GGUF is run against transformers

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140]
DEEPSEEK = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16,
                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
                num_key_value_heads=4)   # DeepSeek's configs give every head its own K and V, as the converter needs


def _convert(tmp_path, model_type, outtype=F32, split_kv_b=True, extra=None, expert_type=None, **overrides):
    """(GGUF path, reference model on the file's values, those values by HF name)."""
    from safetensors.numpy import load_file, save_file

    folder = build_checkpoint(tmp_path / "hf", model_type, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors") | (extra or {})
    back = convert_like_llama_cpp(tmp_path / "model.gguf", cfg, tensors, outtype, split_kv_b=split_kv_b,
                                  expert_type=expert_type)
    for name in extra or {}:
        back.pop(name)
    rounded = tmp_path / "hf-roundtrip"
    rounded.mkdir()
    (rounded / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in back.items()}, rounded / "model.safetensors",
              metadata={"format": "pt"})
    return tmp_path / "model.gguf", load_reference(rounded), back


def _check(path, ref, architecture: str, greedy: int = 16, rows16: bool = False):
    """Prompt logits within 1e-4 of the reference's largest, and `greedy` tokens through the KV cache identical.
    `rows16`: Q4_0 / Q8_0 matrices, run with 8-bit activations (as a rows16 container's are): logits within 5e-2,
    and no greedy comparison (a random model's greedy path may part at that distance)."""
    loaded = load_model(path)
    assert loaded.spec.architecture == architecture
    cache = KVCache(loaded.spec, 128)
    ours = loaded.model.forward(PROMPT, cache, all_logits=True)
    if rows16:
        assert relative_error(ours, reference_logits(ref, PROMPT)) < 5e-2
        return loaded
    assert relative_error(ours, reference_logits(ref, PROMPT)) < 1e-4
    tokens, logits = [], ours[-1]
    for _ in range(greedy):
        tokens.append(int(logits.argmax()))
        logits = loaded.model.forward([tokens[-1]], cache)[-1]
    assert tokens == reference_greedy(ref, PROMPT, greedy)
    return loaded


def _gguf_names(path) -> set[str]:
    return {t.name for t in gguf.GGUFReader(str(path)).tensors}


def test_olmoe_f16(tmp_path):
    """OLMoE: q/k norms over the whole projection, experts stacked, no Q/K permutation, F16 matrices."""
    path, ref, _ = _convert(tmp_path, "olmoe", F16, num_experts=4, num_experts_per_tok=2)
    assert {"blk.0.attn_q_norm.weight", "blk.0.ffn_gate_exps.weight"} <= _gguf_names(path)
    loaded = _check(path, ref, "OlmoeForCausalLM")
    assert loaded.spec.is_moe


def test_olmoe_quantized_experts(tmp_path):
    """A Q4_0 OLMoE file runs its matrices as QuantizedTensors (the names map the same for quantized files), each
    expert's in the rows16 layout, with the file's values."""
    from safetensors.numpy import load_file, save_file

    from engine.quant import QuantizedTensor

    folder = build_checkpoint(tmp_path / "hf", "olmoe", num_experts=4, num_experts_per_tok=2)
    cfg = json.loads((folder / "config.json").read_text())
    back = write_gguf(tmp_path / "model.gguf", "olmoe", cfg, load_file(folder / "model.safetensors"),
                      {"": gguf.GGMLQuantizationType.Q4_0})
    rounded = tmp_path / "rt"
    rounded.mkdir()
    (rounded / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in back.items()}, rounded / "model.safetensors",
              metadata={"format": "pt"})
    loaded = _check(tmp_path / "model.gguf", load_reference(rounded), "OlmoeForCausalLM", rows16=True)
    expert = loaded.model.experts.experts(0, [2])[2]
    assert isinstance(expert.up, QuantizedTensor) and expert.up.layout == "rows16"
    assert np.array_equal(expert.up.dequantize(), back["model.layers.0.mlp.experts.2.up_proj.weight"])


def test_deepseek_v3_split_kv_b(tmp_path):
    """DeepSeek-V3 (Kimi K2's layout): query low-rank, sigmoid router with correction bias and expert groups,
    kv_b_proj split by the converter into k_b (transposed) and v_b, F16."""
    path, ref, _ = _convert(tmp_path, "deepseek_v3", F16, q_lora_rank=24, n_group=2, topk_group=1,
                            scoring_func="sigmoid", routed_scaling_factor=2.5, **DEEPSEEK)
    names = _gguf_names(path)
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.exp_probs_b.bias"} <= names
    assert "blk.1.attn_kv_b.weight" not in names
    meta = gguf.GGUFReader(str(path)).fields
    assert meta["deepseek2.attention.head_count_kv"].contents() == 1      # llama.cpp's MQA view of MLA
    loaded = _check(path, ref, "DeepseekV3ForCausalLM")
    assert loaded.spec.layers[1].ffn.n_group == 2 and loaded.spec.layers[1].ffn.scoring == "sigmoid"


def test_deepseek_v3_yarn(tmp_path):
    """DeepSeek-V3's and Kimi K2's YaRN: factor, original context and betas as keys, mscale_all_dim as
    llama.cpp's yarn_log_multiplier (0.1 times it); the softmax scale depends on it."""
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 0.8,
            "mscale_all_dim": 0.8, "beta_fast": 24.0, "beta_slow": 2.0}
    path, ref, _ = _convert(tmp_path, "deepseek_v3", F32, q_lora_rank=24, n_group=2, topk_group=1,
                            scoring_func="sigmoid", rope_scaling=yarn, max_position_embeddings=2560, **DEEPSEEK)
    assert abs(gguf.GGUFReader(str(path)).fields["deepseek2.rope.scaling.yarn_log_multiplier"].contents() - 0.08) < 1e-6
    _check(path, ref, "DeepseekV3ForCausalLM")


def test_deepseek_v2_unsplit_kv_b_no_q_lora(tmp_path):
    """DeepSeek-V2-Lite's shape: no query low-rank (attn_q), softmax router, shared expert, and a file from
    before llama.cpp's MLA rework (attn_kv_b whole, no *_mla keys)."""
    path, ref, _ = _convert(tmp_path, "deepseek_v2", F32, split_kv_b=False, q_lora_rank=None,
                            routed_scaling_factor=1.5, n_shared_experts=1, **DEEPSEEK)
    names = _gguf_names(path)
    assert {"blk.1.attn_q.weight", "blk.1.attn_kv_b.weight"} <= names and "blk.1.attn_k_b.weight" not in names
    fields = gguf.GGUFReader(str(path)).fields
    assert "deepseek2.attention.key_length_mla" not in fields and fields["deepseek2.attention.key_length"].contents() == 24
    _check(path, ref, "DeepseekV2ForCausalLM")


def test_glm4moe_mtp_block_is_not_a_layer(tmp_path):
    """GLM-4.5: partial RoPE, q/k norms and biases, sigmoid groups; the file's last block is the MTP drafter
    (blk.3.nextn.*), counted in block_count, which is no decoder layer."""
    rng = np.random.default_rng(0)
    mtp = {"model.layers.3.eh_proj.weight": rng.normal(size=(64, 128)).astype(np.float32),
           "model.layers.3.enorm.weight": np.ones(64, np.float32),
           "model.layers.3.hnorm.weight": np.ones(64, np.float32)}
    path, ref, _ = _convert(tmp_path, "glm4_moe", F16, extra=mtp, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
                            use_qk_norm=True, attention_bias=True, head_dim=16, num_nextn_predict_layers=1)
    names = _gguf_names(path)
    assert {"blk.3.nextn.eh_proj.weight", "blk.1.post_attention_norm.weight", "blk.1.attn_q_norm.weight"} <= names
    assert gguf.GGUFReader(str(path)).fields["glm4moe.block_count"].contents() == 4
    loaded = _check(path, ref, "Glm4MoeForCausalLM")
    assert loaded.spec.n_layers == 3


def test_gpt_oss_sinks_window_biases(tmp_path):
    """gpt-oss: sinks, a 4-token sliding window on even layers (the prompt is longer), biases everywhere,
    YaRN, and the fused gate_up de-interleaved by the converter into gate and up stacks."""
    path, ref, _ = _convert(tmp_path, "gpt_oss", F16, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                            sliding_window=4)
    names = _gguf_names(path)
    assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_exps.bias", "blk.0.ffn_gate_inp.bias"} <= names
    loaded = _check(path, ref, "GptOssForCausalLM")
    assert [layer.attn.sliding_window for layer in loaded.spec.layers] == [4, None, 4]


def test_gpt_oss_mxfp4_experts(tmp_path):
    """gpt-oss as its GGUFs are published: MXFP4 expert stacks (the converter repacks the checkpoint's blocks),
    F16 elsewhere; read through the gguf package's dequantization."""
    path, ref, _ = _convert(tmp_path, "gpt_oss", F16, expert_type=gguf.GGMLQuantizationType.MXFP4,
                            num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    _check(path, ref, "GptOssForCausalLM")


def test_deepseek2_without_kv_lora_rank_is_refused(tmp_path):
    """A deepseek2 file missing an MLA size names the key, never a traceback or a wrong model."""
    from safetensors.numpy import load_file

    folder = build_checkpoint(tmp_path / "hf", "deepseek_v2", q_lora_rank=None, **DEEPSEEK)
    cfg = json.loads((folder / "config.json").read_text())
    path = tmp_path / "model.gguf"
    convert_like_llama_cpp(path, cfg, load_file(folder / "model.safetensors"))
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), "deepseek2")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "deepseek2.attention.kv_lora_rank"):
            continue
        value = field.contents()
        vtype = field.types[0]
        w.add_key_value(key, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="deepseek2.attention.kv_lora_rank is missing"):
        load_model(tmp_path / "broken.gguf")


def test_unknown_architecture_lists_the_new_ones(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="deepseek2.*glm4moe.*gpt-oss.*olmoe"):
        load_model(tmp_path / "x.gguf")


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe", "glm-dsa", "kimi-linear"])
def test_folder_only_architectures_name_the_folder_as_the_fix(tmp_path, arch):
    """Families Colibri runs from Hugging Face folders but not yet from GGUF: refused with that way out."""
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match=f"'{arch}'.*not read from GGUF.*Hugging Face folder"):
        load_model(tmp_path / "x.gguf")


def test_mistral_is_written_as_llama(tmp_path):
    """llama.cpp converts Mistral as "llama" (Q/K permuted, no window kept): it runs as Llama, which matches
    Mistral within its window (4096 here, the prompt far shorter)."""
    from safetensors.numpy import load_file

    folder = build_checkpoint(tmp_path / "hf", "mistral", head_dim=16)
    cfg = json.loads((folder / "config.json").read_text())
    write_gguf(tmp_path / "model.gguf", "llama", cfg, load_file(folder / "model.safetensors"), {})
    _check(tmp_path / "model.gguf", load_reference(folder), "LlamaForCausalLM")


def test_olmo2_post_norms(tmp_path):
    path, ref, _ = _convert(tmp_path, "olmo2", F16)
    assert {"blk.0.post_ffw_norm.weight", "blk.0.attn_q_norm.weight"} <= _gguf_names(path)
    _check(path, ref, "Olmo2ForCausalLM")


def test_phi3_fused_qkv_and_window(tmp_path):
    """Phi-3: q/k/v and gate/up stay fused (attn_qkv, ffn_up), partial RoPE, and a sliding window shorter than
    the prompt."""
    path, ref, _ = _convert(tmp_path, "phi3", F16, pad_token_id=0, sliding_window=6, partial_rotary_factor=0.5)
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= _gguf_names(path)
    assert "blk.0.ffn_gate.weight" not in _gguf_names(path)
    loaded = _check(path, ref, "Phi3ForCausalLM")
    assert loaded.spec.layers[0].attn.sliding_window == 6


def test_phi3_longrope_runs_its_short_factors_within_the_original_length(tmp_path):
    """A Phi-3 128k file carries its LongRoPE factors as tensors: read into the config, where the family runs
    the short factors and makes original_max_position_embeddings the model's context (prompt and answer: 30 of
    64 positions, where the reference takes the short factors too)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [3.0 + i for i in range(8)],
            "short_factor": [1.0 + 0.3 * i for i in range(8)], "original_max_position_embeddings": 64}
    path, ref, _ = _convert(tmp_path, "phi3", pad_token_id=0, rope_scaling=rope, original_max_position_embeddings=64)
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= _gguf_names(path)
    from engine.formats.gguf_model import GGUFModel

    params = GGUFModel(path).config["rope_parameters"]
    assert params["long_factor"] == rope["long_factor"] and params["short_factor"] == pytest.approx(rope["short_factor"])
    loaded = _check(path, ref, "Phi3ForCausalLM")
    assert loaded.spec.max_position == 64 and loaded.spec.layers[0].attn.rope.kind == "longrope"


def test_granitemoe_multipliers_permuted_qk_split_experts(tmp_path):
    """Granite-MoE: its multipliers read from the *_scale keys, Q and K un-permuted, the fused experts read from
    the gate and up stacks the converter splits them into, F16 matrices."""
    path, ref, _ = _convert(tmp_path, "granitemoe", F16, num_local_experts=4, num_experts_per_tok=2,
                            embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
                            logits_scaling=2.5)
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_inp.weight"} <= _gguf_names(path)
    loaded = _check(path, ref, "GraniteMoeForCausalLM")
    assert (loaded.spec.embedding_multiplier, loaded.spec.logits_scaling) == (3.0, 2.5)


def test_minimax_m2_qk_norms_partial_rotary_routing_bias(tmp_path):
    """MiniMax-M2: whole-projection q/k norms, half the head rotated, sigmoid routing with its correction bias,
    w1/w3/w2 expert stacks."""
    path, ref, _ = _convert(tmp_path, "minimax_m2", F16, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                            rotary_dim=8)
    assert {"blk.0.attn_q_norm.weight", "blk.0.exp_probs_b.bias", "blk.0.ffn_down_exps.weight"} <= _gguf_names(path)
    loaded = _check(path, ref, "MiniMaxM2ForCausalLM")
    assert loaded.spec.layers[0].attn.rope.dim == 8 and loaded.spec.layers[0].ffn.correction_bias


def test_granitemoe_shared_experts_are_refused(tmp_path):
    """GraniteMoeShared files use the same GGUF name with shared-expert tensors: refused, not run without them."""
    path = tmp_path / "shared.gguf"
    w = gguf.GGUFWriter(str(path), "granitemoe")
    for key, value in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 4),
                       ("attention.head_count", 2), ("expert_count", 2), ("expert_used_count", 1),
                       ("expert_shared_feed_forward_length", 4)):
        w.add_uint32(f"granitemoe.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="shared experts"):
        load_model(path)


def test_gemma2_norms_plus_one_softcaps_window(tmp_path):
    """Gemma 2: the converter stores each norm as w + 1 and drops lm_head; soft caps and a window of 4 on
    alternate layers."""
    path, ref, back = _convert(tmp_path, "gemma2", F16, head_dim=16, sliding_window=4, query_pre_attn_scalar=16)
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    assert np.allclose(stored["blk.0.attn_norm.weight"], back["model.layers.0.input_layernorm.weight"] + 1)
    assert "output.weight" not in stored
    loaded = _check(path, ref, "Gemma2ForCausalLM")
    assert [layer.attn.sliding_window for layer in loaded.spec.layers] == [4, None, 4]


def test_gemma3_local_and_global_rope(tmp_path):
    """Gemma 3: every 6th layer global with a scaled RoPE of its own base, local layers on rope.freq_base_swa,
    per-head q/k norms stored + 1."""
    path, ref, _ = _convert(tmp_path, "gemma3_text", F16, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                            num_hidden_layers=6, rope_scaling={"rope_type": "linear", "factor": 8.0})
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["gemma3.rope.freq_base_swa"].contents() == 10000.0
    loaded = _check(path, ref, "Gemma3ForCausalLM")
    assert [layer.attn.sliding_window for layer in loaded.spec.layers] == [4, 4, 4, 4, 4, None]


def test_olmo3_is_refused_not_run_without_its_window(tmp_path):
    """llama.cpp writes OLMo 3 as olmo2 with a sliding window, which the OLMo 2 family does not apply."""
    from safetensors.numpy import load_file

    folder = build_checkpoint(tmp_path / "hf", "olmo2")
    cfg = json.loads((folder / "config.json").read_text())
    cfg |= {"sliding_window": 4}
    path = tmp_path / "model.gguf"
    convert_like_llama_cpp(path, cfg, load_file(folder / "model.safetensors"))
    with pytest.raises(UnsupportedArchitectureError, match="sliding window .*OLMo 3"):
        load_model(path)


def test_sliding_window_pattern_as_llama_cpp_reads_it():
    """`attention.sliding_window_pattern`: one flag a layer, or n (every n-th layer global, 0 none), else the
    architecture's own n."""
    from engine.formats.gguf_model import swa_layer_types

    def get(values):
        return lambda key, default=None: values.get(key, default)

    s, f = "sliding_attention", "full_attention"
    assert swa_layer_types(get({}), 7, 6) == [s] * 5 + [f, s]
    assert swa_layer_types(get({"attention.sliding_window_pattern": 2}), 4, 6) == [s, f, s, f]
    assert swa_layer_types(get({"attention.sliding_window_pattern": 0}), 3, 6) == [s] * 3
    assert swa_layer_types(get({"attention.sliding_window_pattern": [True, False, True]}), 3, 6) == [s, f, s]
    with pytest.raises(ValueError, match="2 flags for 3 layers"):
        swa_layer_types(get({"attention.sliding_window_pattern": [True, False]}), 3, 6)


def test_deepseek2_gguf_converts_as_its_checkpoint(tmp_path):
    """`colibri convert` of a split-kv_b DeepSeek GGUF (kv_b_proj rebuilt) gives the container its Hugging Face
    checkpoint gives: the same logits, bit for bit."""
    from safetensors.numpy import load_file

    from app.hub.convert import ConvertSettings, convert

    dims = {**DEEPSEEK, "kv_lora_rank": 32, "qk_rope_head_dim": 16}    # every row a whole number of groups
    folder = build_checkpoint(tmp_path / "hf", "deepseek_v3", q_lora_rank=32, n_group=2, topk_group=1,
                              scoring_func="sigmoid", **dims)
    cfg = json.loads((folder / "config.json").read_text())
    convert_like_llama_cpp(tmp_path / "model.gguf", cfg, load_file(folder / "model.safetensors"))
    logits = []
    for src, out in ((tmp_path / "model.gguf", "from-gguf"), (folder, "from-hf")):
        model = load_model(convert(src, tmp_path / out, ConvertSettings(bits=8), log=lambda m: None))
        logits.append(model.model.forward(PROMPT, KVCache(model.spec, 64), all_logits=True))
    assert np.array_equal(logits[0], logits[1])


def test_phimoe_layernorm_biases_window_sparse_mixer(tmp_path):
    """Phi-3.5-MoE: LayerNorms with biases (blocks and output), q/k/v/o and head biases, a window shorter than
    the prompt, w1/w3/w2 expert stacks routed by the sparse mixer at PhiMoE's default threshold, F16 matrices."""
    path, ref, _ = _convert(tmp_path, "phimoe", F16, num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                            lm_head_bias=True, sliding_window=6, original_max_position_embeddings=512)
    assert {"blk.0.attn_norm.bias", "output_norm.bias", "output.bias", "blk.0.ffn_up_exps.weight"} <= _gguf_names(path)
    loaded = _check(path, ref, "PhimoeForCausalLM")
    assert loaded.spec.layers[0].attn.sliding_window == 6 and loaded.spec.lm_head_bias


def test_phimoe_longrope_scale_is_the_files_attn_factor(tmp_path):
    """A Phi-3.5-MoE file's LongRoPE: factors as tensors, its cos/sin scale the converter's attn_factor
    (sqrt(1 + ln 32 / ln 16) = 1.5 here; the checkpoint's mscale is set to the same so the reference agrees)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [3.0 + i for i in range(8)],
            "short_mscale": 1.5, "long_mscale": 1.5}
    path, ref, _ = _convert(tmp_path, "phimoe", num_local_experts=4, num_experts_per_tok=2,
                            rope_parameters=rope, original_max_position_embeddings=16)
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= _gguf_names(path)
    loaded = _check(path, ref, "PhimoeForCausalLM", greedy=4)
    assert loaded.spec.layers[0].attn.rope.kind == "longrope"
    assert loaded.spec.layers[0].attn.rope.attention_factor == pytest.approx(1.5)


def test_ernie_moe_interval_shared_experts_correction_bias_biases(tmp_path):
    """ERNIE-4.5 MoE: a dense first layer then MoE every second layer (leading_dense_block_count,
    interleave_moe_layer_step; the end index read from where the routers are), two shared experts as one MLP,
    the [1, E] correction bias, biases on every projection and the tied head, F16 matrices."""
    path, ref, _ = _convert(tmp_path, "ernie4_5_moe", F16, num_hidden_layers=4, moe_num_experts=4, moe_k=2,
                            moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=1,
                            moe_layer_interval=2, moe_layer_end_index=3, use_bias=True)
    names = _gguf_names(path)
    assert {"blk.1.exp_probs_b.bias", "blk.3.ffn_up_shexp.bias", "blk.0.ffn_gate.bias", "output.bias"} <= names
    assert "blk.2.ffn_gate_inp.weight" not in names
    loaded = _check(path, ref, "Ernie4_5_MoeForCausalLM")
    assert [type(layer.ffn).__name__ for layer in loaded.spec.layers] == ["MLPSpec", "MoESpec", "MLPSpec", "MoESpec"]


def test_ernie_moe_routers_off_the_described_layers_are_refused(tmp_path):
    """Routers where the interval keys say none are: refused, not run as another layout."""
    path, _, _ = _convert(tmp_path, "ernie4_5_moe", num_hidden_layers=2, moe_num_experts=4, moe_k=2,
                          moe_intermediate_size=32, moe_num_shared_experts=0, moe_layer_start_index=0,
                          moe_layer_interval=1, moe_layer_end_index=1)
    from engine.formats.gguf_meta import gguf_metadata, open_gguf
    from engine.formats.gguf_model import gguf_config

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    meta["ernie4_5-moe.interleave_moe_layer_step"] = 2          # would put a router in block 1 only
    with pytest.raises(UnsupportedArchitectureError, match="describe MoE blocks"):
        gguf_config(meta, True, str(path), [t.name for t in reader.tensors])
