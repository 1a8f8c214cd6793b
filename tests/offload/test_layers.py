"""Whole-layer streaming against resident: the layer store changes where weights live, never the answer."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.errors import ColibriError, ModelFormatError
from engine.formats.container import Container
from engine.kv import KVCache
from engine.loader import OffloadOptions, load_model
from engine.models import spec_from_config
from engine.models.transformer import Transformer
from engine.offload.io import PAGE
from engine.offload.layers import LayerStore, _plan_layer, slot_bytes
from engine.offload.store import StoreSettings
from engine.telemetry import Telemetry
from support.offload import greedy_logits
from support.reference import BASE, build_checkpoint

PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7, 150, 12, 33]
LAYERS, STEPS = 4, 8
PASSES = 1 + STEPS          # the prompt is one forward pass, then one per generated token


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("src"), "llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def q4(src, tmp_path_factory):
    return convert(src, tmp_path_factory.mktemp("c") / "q4", ConvertSettings(bits=4), log=lambda m: None)


@pytest.fixture(scope="module")
def f32(src, tmp_path_factory):
    """8-bit attention, float32 MLP matrices: plain views over the slot as well as quantized ones."""
    settings = ConvertSettings(bits=8, keep=(("*mlp*", 32),))
    return convert(src, tmp_path_factory.mktemp("c") / "f32", settings, log=lambda m: None)


def _run(loaded, steps: int = STEPS) -> tuple[np.ndarray, list[int]]:
    return greedy_logits(loaded, PROMPT, steps)


@pytest.fixture(scope="module")
def resident(q4, f32):
    return {q4: _run(load_model(q4)), f32: _run(load_model(f32))}


def _stream(container, resident_layers: int, depth: int, io: str = "pread", telemetry=None):
    options = OffloadOptions(StoreSettings(capacity=0, io=io), depth, None, resident_layers=resident_layers)
    return load_model(container, offload=options, telemetry=telemetry or Telemetry())


def _spec(container: Container):
    return spec_from_config(container.config)


def _io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("colibri-io")]


@pytest.mark.parametrize("which, held, depth, io", [
    ("q4", 0, 0, "pread"),     # every layer streamed, no read-ahead: one blocking read per layer
    ("q4", 0, 1, "pread"),
    ("q4", 1, 1, "pread"),
    ("q4", 2, 1, "pread"),     # 2 streamed layers in 2 slots: read once, then held
    ("q4", 0, 3, "pread"),     # 4 slots for 4 layers: likewise
    ("q4", 1, 2, "mmap"),      # the page-fault baseline
    ("q4", LAYERS, 1, "pread"),  # nothing streamed
    ("f32", 0, 1, "pread"),
    ("f32", 1, 0, "mmap"),
])
def test_streamed_layers_give_bitwise_the_resident_logits(q4, f32, resident, which, held, depth, io):
    container = {"q4": q4, "f32": f32}[which]
    telemetry = Telemetry()
    loaded = _stream(container, held, depth, io, telemetry)
    try:
        logits, tokens = _run(loaded)
        store = loaded.store
        stats, buffers, slots, slot = store.stats(), store.buffer_bytes, store.n_slots, store.slot_bytes
    finally:
        loaded.close()
    want_logits, want_tokens = resident[container]
    assert tokens == want_tokens
    assert np.array_equal(logits, want_logits)

    streamed = LAYERS - held
    if io == "mmap" or slots < streamed:
        # each streamed layer read once per pass; read-ahead wraps past the last pass into the next token's first layers
        ahead = depth if io == "pread" else 0
        assert stats.reads == PASSES * streamed + ahead
    else:
        assert stats.reads == streamed                  # the slots hold every streamed layer: read once, kept
    if io == "pread" and depth >= 1:
        assert stats.hits == PASSES * streamed          # every layer read ahead before it was asked for
    if io == "pread" and depth == 0 and streamed > 1:
        assert stats.hits == 0                          # (a tiny read may even finish before it is waited for)
    assert stats.waits <= PASSES * streamed and stats.wait_seconds >= 0.0
    assert telemetry.snapshot().bytes_read == stats.bytes_read
    assert (stats.bytes_read > 0) == (streamed > 0)
    if io == "pread":
        assert slots == min(depth + 1, streamed) and slot % PAGE == 0
        assert buffers == slots * slot             # converted containers hold no f16/bf16 to widen
        assert slot == slot_bytes(Container.open(container, verify=False), range(held, LAYERS))


def test_prefetch_is_counted_in_telemetry(q4):
    telemetry = Telemetry()
    loaded = _stream(q4, 1, 1, telemetry=telemetry)
    try:
        _run(loaded)
        stats = loaded.store.stats()
    finally:
        loaded.close()
    snap = telemetry.snapshot()
    assert snap.prefetch_issued == stats.reads        # with depth >= 1 every read is a read-ahead
    assert snap.prefetch_used == stats.hits == PASSES * (LAYERS - 1)
    assert snap.prefetch_wasted == 0


def test_layers_are_read_in_few_aligned_reads(q4):
    """A layer's tensors are read as contiguous runs, page-aligned in file and slot, covering every tensor once."""
    c = Container.open(q4)
    for i in range(LAYERS):
        plan = _plan_layer(c, i)
        names = sorted(e.name for e, _ in plan.tensors())
        assert names == sorted(n for n in c.entries if n.startswith(f"model.layers.{i}."))
        assert len(plan.runs) <= 2                    # the writer puts norms (float32) apart from the matrices
        wanted = sum(e.length for e, _ in plan.tensors())
        assert sum(r.length for r in plan.runs) <= wanted + len(plan.runs) * PAGE   # no unrelated tensors read
        for run in plan.runs:
            assert run.offset % PAGE == 0 and run.at % PAGE == 0
            for e, at in run.tensors:
                assert run.offset <= e.offset and e.offset + e.length <= run.offset + run.length
                assert at == run.at + e.offset - run.offset
        assert plan.nbytes % PAGE == 0


def test_out_of_order_requests_keep_the_layer_in_use_intact(q4, resident):
    """Asking in any order (a pass cut short by an error, say) still gives the right layers; read-ahead never
    overwrites the layer just returned."""
    loaded = _stream(q4, 0, 1)
    store = loaded.store
    c = Container.open(q4)
    try:
        for i in (3, 1, 1, 0, 2, 3, 0):
            layer = store.layer(i)
            assert np.array_equal(layer.input_norm, c.load(f"model.layers.{i}.input_layernorm.weight"))
        held = store.layer(2)                         # reads of 3 (and on) start into the other slot
        before = held.attn.wq.dequantize()
        store.close()                                 # waits for the reads in flight
        assert np.array_equal(held.attn.wq.dequantize(), before)
        assert np.array_equal(before, c.load("model.layers.2.self_attn.q_proj.weight").dequantize())
    finally:
        loaded.close()
    loaded = _stream(q4, 0, 1)
    try:
        for i in (2, 0, 3):
            loaded.store.layer(i)
        logits, tokens = _run(loaded)
    finally:
        loaded.close()
    assert tokens == resident[q4][1]
    assert np.array_equal(logits, resident[q4][0])


def _corrupt(container, tmp_path, name: str):
    bad = shutil.copytree(container, tmp_path / "bad")
    e = Container.open(container).entries[name]
    with open(bad / e.file, "r+b") as f:
        f.seek(e.offset + e.length // 2)
        byte = f.read(1)
        f.seek(e.offset + e.length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return bad


@pytest.mark.parametrize("io", ["pread", "mmap"])
def test_a_corrupt_streamed_tensor_is_refused(q4, tmp_path, io):
    name = "model.layers.3.mlp.down_proj.weight"
    bad = _corrupt(q4, tmp_path, name)
    loaded = _stream(bad, 1, 1, io)                   # opening reads only what is held, not the streamed layers
    try:
        with pytest.raises(ModelFormatError, match=f"checksum mismatch in tensor {name}.*colibri convert"):
            _run(loaded)
    finally:
        loaded.close()
    with pytest.raises(ModelFormatError, match=f"checksum mismatch in tensor {name}.*colibri convert"):
        _stream(bad, 4, 1, io)                        # held layers are checked at open
    c = Container.open(bad, verify=False)             # the store checks on its own first read
    spec = _spec(c)
    store = LayerStore(c, spec, 1, 1, io=io)
    model = Transformer(spec, c, layers=store)
    try:
        for _ in range(2):                            # refused again when asked again, not served from the slot
            with pytest.raises(ModelFormatError, match=f"checksum mismatch in tensor {name}.*colibri convert"):
                model.forward(PROMPT, KVCache(spec, 32))
        assert store.layer(2) is not None             # the sound layers still load
    finally:
        store.close()
    assert _io_threads() == []


@pytest.mark.parametrize("held, depth, io, flag", [
    (LAYERS + 1, 1, "pread", "--resident-layers 5: use 0 to 4"),
    (-1, 1, "pread", "--resident-layers -1: use 0 to 4"),
    (0, -1, "pread", "--prefetch-depth -1: use 0 or more"),
    (0, 1, "disk", "--io 'disk'"),
])
def test_bad_settings_are_refused_naming_the_flag(q4, held, depth, io, flag):
    c = Container.open(q4)
    with pytest.raises(ColibriError, match=flag):
        LayerStore(c, _spec(c), held, depth, io=io)
    if io == "pread":
        with pytest.raises(ColibriError, match=flag):
            _stream(q4, held, depth)
    assert _io_threads() == []


def test_a_model_with_routed_experts_is_told_to_stream_experts(q4):
    from transformers import AutoConfig

    moe = AutoConfig.for_model("mixtral", **{**BASE, "num_local_experts": 4, "num_experts_per_tok": 2}).to_dict()
    moe["architectures"] = ["MixtralForCausalLM"]
    with pytest.raises(ColibriError, match="routed experts: stream the experts instead"):
        LayerStore(Container.open(q4), spec_from_config(moe), 1, 1)


def test_close_stops_the_readers_and_is_idempotent(q4):
    loaded = _stream(q4, 1, 2)
    store = loaded.store
    loaded.model.forward(PROMPT, KVCache(loaded.spec, 32))   # reads ahead into the next token: in flight at close
    assert _io_threads()
    loaded.close()
    store.close()
    assert _io_threads() == []
    with pytest.raises(RuntimeError, match="after close"):
        store.layer(1)
