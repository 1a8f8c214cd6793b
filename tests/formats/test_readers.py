"""Readers on bad input: every failure names the file and the problem, and says what to do."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.formats.gguf_model import GGUFModel, unpermute_qk
from engine.loader import load_model
from engine.models import supported_architectures
from support.reference import build_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("good"), "llama", num_hidden_layers=2)


@pytest.fixture
def copy(good, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(good, dst)
    return dst


def _edit_config(folder, drop=(), **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    for key in drop:
        cfg.pop(key, None)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_path(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file or folder"):
        load_model(tmp_path / "nowhere")


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json.*missing"):
        load_model(copy)


def test_config_not_json(copy):
    (copy / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match=r"config\.json.*not valid JSON"):
        load_model(copy)


def test_no_weights(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="no model.safetensors"):
        load_model(copy)


def test_truncated_safetensors(copy):
    path = copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors.*truncated"):
        load_model(copy)


def test_garbage_header(copy):
    path = copy / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10) + b"\xff" * 10 + b"\x00" * 64)
    with pytest.raises(ModelFormatError, match=r"model\.safetensors.*not valid JSON"):
        load_model(copy)


def test_file_too_short(copy):
    (copy / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(ModelFormatError, match="too short"):
        load_model(copy)


def test_shape_mismatch_names_tensor_and_shapes(copy):
    _edit_config(copy, intermediate_size=80)
    with pytest.raises(ModelFormatError, match=r"mlp\.(gate|up|down)_proj\.weight has shape \[.*\] but config\.json implies"):
        load_model(copy)


def test_missing_tensor(copy):
    _edit_config(copy, num_hidden_layers=3)
    with pytest.raises(ModelFormatError, match=r"missing: model\.layers\.2\."):
        load_model(copy)


def test_integer_weight_dtype_is_refused(copy):
    """A weight stored as integers cannot be a float weight: the error names tensor and dtype."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(copy / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"model\.norm\.weight is I32"):
        load_model(copy)


def test_unknown_dtype_is_refused(copy):
    path = copy / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["model.norm.weight"]["dtype"] = "F8_E5M2"
    header["model.norm.weight"]["data_offsets"][1] = header["model.norm.weight"]["data_offsets"][0] + 64
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    with pytest.raises(ModelFormatError, match="F8_E5M2"):
        load_model(copy)


def test_unsupported_architecture_lists_supported(copy):
    _edit_config(copy, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(copy)
    assert "GPTNeoXForCausalLM" in str(err.value)
    for arch in supported_architectures():
        assert arch in str(err.value)
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "DeepseekV3ForCausalLM"} <= set(supported_architectures())


def test_bad_config_value_names_the_key(copy):
    _edit_config(copy, num_attention_heads="four")
    with pytest.raises(ModelFormatError, match="'num_attention_heads' is 'four', expected int"):
        load_model(copy)


def test_unsupported_rope_type(copy):
    # an older config: top-level rope_theta and rope_scaling, no rope_parameters
    _edit_config(copy, drop=("rope_parameters",), rope_theta=10000.0, rope_scaling={"type": "longrope", "factor": 2.0})
    with pytest.raises(ModelFormatError, match="rope type 'longrope' is not supported"):
        load_model(copy)


def test_missing_shard(tmp_path):
    folder = build_checkpoint(tmp_path / "sharded", "llama", shard_size="50KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFormatError, match=f"{shard.name}.*missing"):
        load_model(folder)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is no gguf file at all" * 10)
    with pytest.raises(ModelFormatError, match=r"model\.gguf.*not a readable GGUF"):
        load_model(path)


def test_wrong_file_kind(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(ModelFormatError, match=r"not a \.gguf file"):
        load_model(path)


def _write_gguf(path, arch="llama", truncate=False):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 200])


def test_truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    _write_gguf(path, truncate=True)
    with pytest.raises(ModelFormatError, match=r"cut\.gguf"):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    _write_gguf(path, arch="falcon")
    with pytest.raises(UnsupportedArchitectureError, match="'falcon' is not supported"):
        GGUFModel(path)


def test_gguf_missing_tensors_are_named(tmp_path):
    path = tmp_path / "partial.gguf"
    _write_gguf(path)
    with pytest.raises(ModelFormatError, match=r"partial\.gguf: \d+ tensor\(s\) .*missing: .*model\.layers\.0\.input_layernorm"):
        load_model(path)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp interleaves each head's two rotary halves; undoing it restores the rows."""
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert: per head, rows (2, half) -> (half, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, heads), w)


def test_progress_reaches_one_and_can_cancel(good):
    from engine.loader import LoadCancelled

    seen: list[float] = []
    load_model(good, lambda fraction, message: seen.append(fraction))
    assert seen[0] == 0.0 and seen[-1] == 1.0 and seen == sorted(seen)
    with pytest.raises(LoadCancelled):
        load_model(good, lambda fraction, message: fraction < 0.5)
