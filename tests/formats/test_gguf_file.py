"""The lean GGUF header reader against the gguf package's GGUFReader: the same metadata and the same tensor views."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.formats.gguf_file import GGUFFile
from engine.formats.gguf_meta import open_gguf

Q = gguf.GGMLQuantizationType


def _same_as_reference(path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes,
                                                                           b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        np.testing.assert_array_equal(a.data, b.data)
    return ours


def _write(path, endianess=gguf.GGUFEndian.LITTLE) -> dict[str, np.ndarray]:
    """A GGUF of every metadata value type and several tensor types; the arrays written, by name."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo, wörld ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    arrays = {"f32": rng.standard_normal((3, 64)).astype(np.float32),
              "f16": rng.standard_normal((2, 32)).astype(np.float16)}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    raw = rng.standard_normal((4, 256)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(raw, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_the_metadata_and_tensors_match_gguf_readers_on_every_value_type(tmp_path):
    path = tmp_path / "all.gguf"
    arrays = _write(path)
    ours = _same_as_reference(path)
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.strs"] == ["a", "", "ünï"]
    by_name = {t.name: t for t in ours.tensors}
    np.testing.assert_array_equal(by_name["f32"].data, arrays["f32"])
    np.testing.assert_array_equal(by_name["f16"].data, arrays["f16"])
    assert by_name["q8"].data.shape == (4, 256 // 32 * 34)


def test_a_big_endian_file_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "big.gguf"
    arrays = _write(path, gguf.GGUFEndian.BIG)
    ours = _same_as_reference(path)
    np.testing.assert_array_equal({t.name: t for t in ours.tensors}["f32"].data, arrays["f32"])


@pytest.mark.slow
def test_the_real_smollm2_file_matches(smollm2_gguf):
    ours = _same_as_reference(smollm2_gguf)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152


def test_a_truncated_file_says_what_is_wrong(tmp_path):
    path = tmp_path / "cut.gguf"
    _write(path)
    data = path.read_bytes()
    last = GGUFFile(path).tensors[-1]
    for keep in (3, 40, 300, last.data_offset + last.n_bytes - 1):
        path.write_bytes(data[:keep])
        with pytest.raises(ModelFormatError, match="not a readable GGUF file.*download or convert it again"):
            open_gguf(path)
