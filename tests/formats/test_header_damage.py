"""Damaged safetensors headers and JSON files give a ModelFormatError naming the file, never a traceback."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from engine.errors import ModelFormatError
from engine.formats.hf import SafetensorsFolder, read_json
from engine.formats.safetensors_file import SafetensorsFile


def _safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize(("header", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),        # RecursionError before
    (b"[1, 2, 3]", "header is a JSON list, not a table of tensors"),  # TypeError before
    (b'"text"', "header is a JSON str"),
    (b'{"__metadata__": [1], "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "__metadata__ is not an object"),
    (b'{"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', "malformed entry for tensor w"),
    (b'{"w": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}}', "malformed entry for tensor w"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", 4]}}', "malformed entry for tensor w"),
    (b'{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "malformed entry for tensor w"),
    (b'{"w": [1, 2]}', "malformed entry for tensor w"),
])
def test_damaged_header_names_the_file(tmp_path: Path, header: bytes, message: str) -> None:
    path = _safetensors(tmp_path / "model.safetensors", header, b"\0" * 4)
    with pytest.raises(ModelFormatError, match=rf"model\.safetensors: .*{message}.*download"):
        SafetensorsFile(path)


def test_a_sound_header_still_reads(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    f = SafetensorsFile(_safetensors(tmp_path / "model.safetensors", header, struct.pack("<f", 1.5)))
    assert f.float32("w").tolist() == [1.5]


def test_a_deeply_nested_config_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{\"a\": " * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ModelFormatError, match=r"config\.json: config\.json is nested too deeply"):
        read_json(tmp_path / "config.json", "config.json")


def test_an_index_whose_weight_map_is_not_names_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": ["a.safetensors"]}}))
    with pytest.raises(ModelFormatError, match="weight_map"):
        SafetensorsFolder(tmp_path)
