"""Ollama's `details` of a model, read from its own files: the parameter count in Ollama's spelling, and the
quantization of a GGUF (its file type, else the type of most weights) and of a Hugging Face folder."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from app.server.model_details import model_details, parameter_size


@pytest.mark.parametrize("count, text", [
    (134_515_008, "135M"), (360_000_000, "360M"), (1_500_000, "1.5M"), (1_711_376_384, "1.7B"),
    (8_030_261_248, "8B"), (70_553_706_496, "70.6B"), (12_000, "12K"), (999, "999"), (None, ""), (0, ""),
])
def test_parameter_counts_read_as_ollama_writes_them(count, text):
    assert parameter_size(count) == text


def _gguf(path, file_type):
    w = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:
        w.add_file_type(file_type)
    big = np.linspace(-1, 1, 64 * 256, dtype=np.float32).reshape(64, 256)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(big, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_tells_its_file_type_else_its_commonest_tensor_type(tmp_path):
    typed = _gguf(tmp_path / "typed.gguf", gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert model_details(typed) == ("16.6K", "Q4_K_M")      # 64 x 256 + 256 weights
    assert model_details(_gguf(tmp_path / "untyped.gguf", None)) == ("16.6K", "Q8_0")
    assert model_details(_gguf(tmp_path / "f32.gguf", gguf.LlamaFileType.ALL_F32))[1] == "F32"


def test_a_hugging_face_folder_tells_its_dtype_or_published_quantization(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((1000, 64), np.float16),
               "model.norm.weight": np.zeros(64, np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_details(folder) == ("64.1K", "F16")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "quantization_config": {"quant_method": "fp8"}}))
    assert model_details(folder)[1] == "FP8"


def test_a_model_that_cannot_be_read_gets_empty_details(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    assert model_details(bad) == ("", "")
