"""A config.json of the wrong types or ranges, or weights that do not match it, is refused at open with the key,
the value (or the tensors) and the fix named; nothing divides by zero or runs a model of no layers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.loader import check_tensor_names, load_model, open_checkpoint
from engine.models import spec_from_config
from engine.models.transformer import expected_shapes
from support.tiny_checkpoint import MIXTRAL, write_tiny

FIX = r"fetch the model again"

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 80, "tie_word_embeddings": True,
}
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 80, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "kv_lora_rank": 16, "q_lora_rank": 24, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "num_nextn_predict_layers": 1,
}


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("num_attention_heads", 0, "an integer >= 1"),         # ZeroDivisionError before
    ("num_hidden_layers", 0, "an integer >= 1"),           # ran and emitted text before
    ("num_hidden_layers", -3, "an integer >= 1"),
    ("num_hidden_layers", "2", "int"),                     # a string is not a count
    ("num_hidden_layers", 2.5, "int"),
    ("num_hidden_layers", True, "int"),
    ("hidden_size", -64, "an integer >= 1"),
    ("num_key_value_heads", 0, "an integer >= 1"),
    ("vocab_size", 0, "an integer >= 1"),
    ("intermediate_size", 0, "a positive size for the dense layers"),
    ("num_attention_heads", 5, "a divisor of hidden_size 64"),
    ("rope_theta", "big", "float"),
    ("rope_theta", -1.0, "a positive number"),
    ("eos_token_id", "2", "a token id or a list of them"),
    ("hidden_act", 3, "str"),
])
def test_a_bad_value_is_named_with_the_fix(key: str, value, expected: str) -> None:
    with pytest.raises(ModelFormatError, match=rf"config\.json: '{key}' is {value!r:.20}.*expected {expected}.*{FIX}"):
        spec_from_config({**LLAMA, key: value})


@pytest.mark.parametrize(("config", "key", "expected"), [
    ({**MIXTRAL, "num_experts_per_tok": 9}, "num_experts_per_tok", "at most the 8 experts"),
    ({**MIXTRAL, "num_experts_per_tok": 0}, "num_experts_per_tok", "an integer >= 1"),
    ({**MIXTRAL, "num_local_experts": 0}, "num_local_experts", "at least one expert"),
    ({**DEEPSEEK, "topk_group": 3}, "topk_group", "at most n_group"),
    ({**DEEPSEEK, "n_group": 0}, "n_group", "an integer >= 1"),
    ({**DEEPSEEK, "qk_rope_head_dim": 0}, "qk_rope_head_dim", "an integer >= 2"),
    ({**MIXTRAL, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8, "moe_intermediate_size": 32,
      "decoder_sparse_step": 0}, "decoder_sparse_step", "an integer >= 1"),     # a modulo by zero before
])
def test_moe_ranges(config: dict, key: str, expected: str) -> None:
    with pytest.raises(ModelFormatError, match=rf"'{key}' is .*expected {expected}"):
        spec_from_config(config)


def test_the_sound_configs_still_parse() -> None:
    assert spec_from_config(LLAMA).n_layers == 2
    assert spec_from_config(MIXTRAL).layers[0].ffn.top_k == 2
    assert spec_from_config(DEEPSEEK).is_moe


@pytest.mark.parametrize("value", [0, -3, "2"])
def test_a_folder_with_a_bad_layer_count_is_refused_at_open(tmp_path: Path, value) -> None:
    src = write_tiny(tmp_path / "tiny")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": value}))
    with pytest.raises(ModelFormatError, match=r"config\.json: 'num_hidden_layers' is"):
        load_model(src)


def test_weights_of_more_layers_than_the_config_are_named(tmp_path: Path) -> None:
    src = write_tiny(tmp_path / "tiny")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ModelFormatError, match=r"tiny: \d+ tensor\(s\) the model does not use: model\.layers\.1\..* and "
                                               r"\d+ more; the weights do not match the config \(1 layers"):
        open_checkpoint(src)


def test_an_unknown_tensor_is_refused_and_a_rope_buffer_allowed(tmp_path: Path) -> None:
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    ok = write_tiny(tmp_path / "ok", extra=inv_freq)
    assert open_checkpoint(ok).spec.n_layers == 2
    bad = write_tiny(tmp_path / "bad", extra={"model.layers.0.mlp.mystery.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(ModelFormatError, match=r"1 tensor\(s\) the model does not use: model\.layers\.0\.mlp\.mystery"):
        open_checkpoint(bad)


def test_missing_tensors_are_named_with_a_count(tmp_path: Path) -> None:
    drop = tuple(f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight" for e in range(8))
    src = write_tiny(tmp_path / "tiny", drop=drop)
    with pytest.raises(ModelFormatError, match=r"8 tensor\(s\) the config implies are missing: "
                                               r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w2\.weight.* and 3 more"):
        open_checkpoint(src)


def test_a_tied_model_may_carry_a_copy_of_its_head(tmp_path: Path) -> None:
    head = {"lm_head.weight": np.zeros((80, 64), np.float32)}
    src = write_tiny(tmp_path / "tiny", LLAMA, extra=head)
    assert open_checkpoint(src).spec.tie_embeddings


def test_deepseek_multi_token_prediction_layers_are_allowed_and_no_more() -> None:
    spec = spec_from_config(DEEPSEEK)
    names = set(expected_shapes(spec))
    source = SimpleNamespace(path="deepseek")
    mtp = {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.shared_head.norm.weight",
           "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"}
    check_tensor_names(spec, names | mtp, DEEPSEEK, "config.json", source)
    with pytest.raises(ModelFormatError, match=r"model\.layers\.3\.eh_proj\.weight"):
        check_tensor_names(spec, names | mtp | {"model.layers.3.eh_proj.weight"}, DEEPSEEK, "config.json", source)
    with pytest.raises(ModelFormatError, match=r"model\.layers\.2\.eh_proj\.weight"):
        without = {k: v for k, v in DEEPSEEK.items() if k != "num_nextn_predict_layers"}
        check_tensor_names(spec, names | mtp, without, "config.json", source)


def test_gguf_tensors_without_a_hugging_face_name_are_reported(tmp_path: Path) -> None:
    import gguf

    from engine.formats.gguf_model import GGUFModel

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_embedding_length, 8), (w.add_feed_forward_length, 16),
                       (w.add_head_count, 2), (w.add_context_length, 64)):
        add(value)
    for name in ("token_embd.weight", "mystery.weight", "blk.0.strange.weight", "blk.0.attn_norm.weight"):
        w.add_tensor(name, np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFModel(path)
    assert sorted(g.unmapped) == ["blk.0.strange.weight", "mystery.weight"]
    assert g.config["vocab_size"] == 10          # no tokenizer in the file: the embedding table's rows
