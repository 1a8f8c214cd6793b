"""to_buffers / from_buffers: JSON meta and named arrays, reloaded from read-only memory maps without copies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.quant import BITS, QuantizedTensor, quantize

SHAPE = (19, 256)


def _tensor(bits: int, group: int = 64, asymmetric: bool | None = None) -> QuantizedTensor:
    w = np.random.default_rng(bits).standard_normal(SHAPE).astype(np.float32)
    return quantize(w, bits, group, asymmetric=asymmetric)


def _write_and_map(tmp_path, buffers: dict[str, np.ndarray], raw: bool) -> tuple[np.memmap, dict[str, np.ndarray]]:
    """All buffers in one file, mapped read-only; views by name (as raw bytes or typed, like a container)."""
    path = tmp_path / "tensor.bin"
    offsets, pos = {}, 0
    with open(path, "wb") as f:
        for name, arr in buffers.items():
            pad = -pos % 64
            f.write(b"\0" * pad)
            pos += pad
            offsets[name] = (pos, arr.nbytes, arr.dtype, arr.shape)
            f.write(arr.tobytes())
            pos += arr.nbytes
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    views = {}
    for name, (off, n, dtype, shape) in offsets.items():
        span = mm[off:off + n]
        views[name] = span if raw else span.view(dtype).reshape(shape)
    return mm, views


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("raw", [False, True])
def test_round_trip_through_read_only_memmap_shares_memory(tmp_path, bits, raw):
    q = _tensor(bits, asymmetric=True if bits == 4 else None)
    meta, buffers = q.to_buffers()
    meta = json.loads(json.dumps(meta))                      # JSON-able
    assert all(arr.flags.c_contiguous for arr in buffers.values())
    mm, views = _write_and_map(tmp_path, buffers, raw)
    q2 = QuantizedTensor.from_buffers(meta, views)
    for name in buffers:
        assert np.shares_memory(getattr(q2, name), mm), name  # nothing was copied
    assert not q2.a.flags.writeable
    assert (q2.shape, q2.bits, q2.group, q2.asymmetric) == (q.shape, q.bits, q.group, q.asymmetric)
    assert q2.nbytes == q.nbytes
    assert np.array_equal(q2.dequantize(), q.dequantize())
    x = np.random.default_rng(0).standard_normal((5, SHAPE[1])).astype(np.float32)
    assert np.array_equal(q2.matmul(x), q.matmul(x))
    assert np.array_equal(q2.matmul(x[:1]), q.matmul(x[:1]))


def test_pickle_and_copy_rebuild_the_kernel_view():
    import copy
    import pickle

    q = _tensor(5)
    x = np.random.default_rng(1).standard_normal((3, SHAPE[1])).astype(np.float32)
    for clone in (pickle.loads(pickle.dumps(q)), copy.deepcopy(q), copy.copy(q)):
        assert np.array_equal(clone.matmul(x), q.matmul(x))
    again = pickle.loads(pickle.dumps(q))
    assert again.descriptor[5] == again.a.ctypes.data != q.a.ctypes.data  # its own arrays, not stale addresses


def test_buffers_hold_only_what_the_format_uses():
    assert set(_tensor(4).to_buffers()[1]) == {"a", "scales"}
    assert set(_tensor(5).to_buffers()[1]) == {"a", "b", "scales"}
    assert set(_tensor(2).to_buffers()[1]) == {"a", "scales", "mins"}
    meta = _tensor(3).to_buffers()[0]
    assert meta["bits"] == 3 and meta["group"] == 64 and meta["shape"] == list(SHAPE) and meta["asymmetric"] is False


def test_bad_buffers_are_named():
    q = _tensor(5)
    meta, buffers = q.to_buffers()
    with pytest.raises(ValueError, match="missing: b"):
        QuantizedTensor.from_buffers(meta, {k: v for k, v in buffers.items() if k != "b"})
    with pytest.raises(ValueError, match="'scales' holds"):
        QuantizedTensor.from_buffers(meta, {**buffers, "scales": buffers["scales"][:-1]})
    with pytest.raises(ValueError, match="'a' has dtype float32"):
        QuantizedTensor.from_buffers(meta, {**buffers, "a": buffers["a"].astype(np.float32)})
    with pytest.raises(ValueError, match="C-contiguous"):
        QuantizedTensor.from_buffers(meta, {**buffers, "scales": np.asfortranarray(buffers["scales"])})
    with pytest.raises(ValueError, match="newer"):
        QuantizedTensor.from_buffers({**meta, "version": 99}, buffers)
    with pytest.raises(ValueError, match="layout"):
        QuantizedTensor.from_buffers({**meta, "layout": "other"}, buffers)
    with pytest.raises(ValueError, match="bit width 7"):
        QuantizedTensor.from_buffers({**meta, "bits": 7}, buffers)
    with pytest.raises(ValueError, match="shape"):
        QuantizedTensor.from_buffers({**meta, "shape": [19, 128]}, buffers)


def test_constructor_checks_shape_and_group():
    q = _tensor(4)
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        QuantizedTensor((19, 200), 4, 64, False, q.a, q.b, q.scales, q.mins)
    with pytest.raises(ValueError, match="group size 16"):
        QuantizedTensor(q.shape, 4, 16, False, q.a, q.b, q.scales, q.mins)
    with pytest.raises(ValueError, match="'a' holds"):
        QuantizedTensor(q.shape, 8, 64, False, q.a, q.b, q.scales, q.mins)
