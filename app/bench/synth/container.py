"""`colibri synth SHAPE OUT --bits B`: a quantized container, written directly.

It is what `colibri convert SRC OUT --bits B` would write from the bf16 checkpoint of the shape (same manifest, tensor
kinds, plan, dense.bin and expert extents: convert's ContainerWriter and uniform plan do the writing), but with
random codes and fp16 scales drawn directly: no bfloat16 detour, no quantization search. Each buffer is generated
chunk by chunk while earlier chunks are written, so the working set is a few chunks whatever the model's size.
"""

from __future__ import annotations

import math
import shutil
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from app.bench.synth.checkpoint import (
    Progress,
    SynthPlan,
    _sentencepiece,
    _write_json,
    corpus_lines,
    plan_checkpoint,
    tokenizer_config,
    tokenizer_json,
    train_sentencepiece,
)
from app.bench.synth.config import BOS_ID, EOS_ID
from app.bench.synth.shapes import TRANSFORMERS_FORMAT
from engine.errors import ColibriError, DiskFullError, is_disk_full

GEN_BYTES = 8 << 20        # bytes of one generated chunk: the unit of the random stream and of the working set
GEN_AHEAD = 3              # chunks generated ahead of the writer
SCALE_SPREAD = 0.25        # log-normal spread of the group scales (a trained model's scales vary by group)
SYNC_BYTES = 1 << 30       # journal and fsync every GB, not every tensor: per-expert fsyncs halved the write speed


@dataclass(frozen=True)
class ContainerPlan:
    """Everything `write_container` will write, known before writing."""

    synth: SynthPlan            # the shape, its config and spec (the bf16 checkpoint's plan)
    mats: Any                   # app.hub.convert.Matrices: planned, float32, experts
    plan: Any                   # engine.plan.planner.Plan: each planned matrix's bits and group
    bits: int
    group: int
    layers: int | None

    @property
    def nbytes(self) -> int:
        """Weight bytes (quantized and float32), without alignment."""
        return int(self.plan.total_bytes)

    def expected_bytes(self) -> int:
        """About the bytes the finished container takes (convert's estimate: weights, alignment, entries)."""
        from engine.formats.container import EXTENT_ALIGN

        n_tensors = len(self.mats.planned) + len(self.mats.float32)
        return self.nbytes + EXTENT_ALIGN * (len(self.mats.experts) + 1) + 1024 * n_tensors + (16 << 20)

    def resume_key(self, seed: int) -> dict:
        """What binds an interrupted write to its rerun."""
        return {"synth": self.synth.shape.name, "seed": seed, "bits": self.bits, "group": self.group,
                "layers": self.layers, "std": float(self.synth.config["initializer_range"])}


def plan_container(shape_name: str, bits: int, group: int = 32, layers: int | None = None) -> ContainerPlan:
    """Lay out the container `colibri synth SHAPE OUT --bits B` writes: convert's classification and uniform plan."""
    from app.hub.convert import ConvertSettings, classify_spec, uniform_plan
    from engine.quant import BITS, GROUPS

    if bits not in BITS:
        raise ColibriError(f"--bits {bits!r}: choose one of {', '.join(map(str, BITS))}")
    if group not in GROUPS:
        raise ColibriError(f"--group {group!r}: choose one of {', '.join(map(str, GROUPS))}")
    synth = plan_checkpoint(shape_name, "bf16", layers=layers)
    mats = classify_spec(synth.spec)
    plan = uniform_plan(mats, ConvertSettings(bits=bits, group=group))
    return ContainerPlan(synth, mats, plan, bits, group, layers)


class _GeneratedBuffer:
    """One storage array of a quantized tensor, generated in seeded row chunks (container.py's `chunks()`)."""

    def __init__(self, pool: ThreadPoolExecutor, dtype: str, shape: tuple[int, int],
                 make: Callable[[int, int], np.ndarray]):
        self.dtype = np.dtype(dtype)
        self.shape = shape
        self.nbytes = shape[0] * shape[1] * self.dtype.itemsize
        self._pool, self._make = pool, make

    def chunks(self):
        """The buffer's bytes, row chunk by row chunk, GEN_AHEAD chunks generated ahead in the pool."""
        row_bytes = max(1, self.shape[1] * self.dtype.itemsize)
        step = max(1, GEN_BYTES // row_bytes)
        starts = iter(range(0, self.shape[0], step))
        pending: deque = deque()
        while True:
            while len(pending) < GEN_AHEAD and (r0 := next(starts, None)) is not None:
                pending.append(self._pool.submit(self._make, r0, min(self.shape[0], r0 + step)))
            if not pending:
                return
            yield pending.popleft().result()


def _rng(seed: int, name: str, part: str, r0: int) -> np.random.Generator:
    """The random stream of rows r0... of one buffer: fixed by the seed, the tensor, the buffer and the row."""
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode()), zlib.crc32(part.encode()), r0]))


class _GeneratedQuant:
    """A quantized matrix of random codes and fp16 scales, as `QuantizedTensor.to_buffers` describes one.

    Codes are uniform over the width's 2**bits levels but for symmetric formats the lowest (-2**(bits-1), which has
    no positive twin) is moved to the middle level (a zero weight), so that the weights d * (u - 2**(bits-1)) have
    mean zero; zero-point formats (d * u + m) take m centring the codes. A group's scale d is log-normal around
    d0, chosen so that the weights have standard deviation `std`, as a trained model's (and transformers'
    initializer) do.
    """

    def __init__(self, pool: ThreadPoolExecutor, name: str, shape: tuple[int, int], bits: int, group: int,
                 seed: int, std: float):
        from engine.kernels.layout import FORMATS, rows16_allowed
        from engine.quant import QuantizedTensor

        asym = FORMATS[bits].asymmetric                      # the format's default, as convert's uniform plan
        layout = "rows16" if rows16_allowed(bits, asym, shape[0]) else "planes"
        # the meta and per-row buffer widths of one row block of the same format: what quantize() would store
        fmt, rows = FORMATS[bits], 16
        nb, ng = shape[1] // 32, shape[1] // group
        probe = QuantizedTensor((rows, shape[1]), bits, group, asym, np.zeros((rows, nb * fmt.a_bytes), np.uint8),
                                np.zeros((rows, nb * fmt.b_bytes), np.uint8), np.zeros((rows, ng), np.uint16),
                                np.zeros((rows, ng if asym else 0), np.uint16), layout)
        meta, buffers = probe.to_buffers()
        self.meta = meta | {"shape": list(shape)}
        self.shape = shape
        levels, m = 1 << bits, (1 << (bits - 1)) - 1
        # E[(u - centre)^2]: uniform codes centred by the zero point, or symmetric codes -m .. m with 0 twice
        spread = (levels * levels - 1) / 12 if asym else m * (m + 1) * (2 * m + 1) / 3 / levels
        self._bits, self._asym, self._n_in = bits, asym, shape[1]
        self._d0 = std / math.sqrt(spread * math.exp(2 * SCALE_SPREAD ** 2))
        self._centre = -(levels - 1) / 2
        self._name, self._seed = name, seed
        self.buffers = {}
        for key, arr in buffers.items():
            dtype, width = arr.dtype.str, arr.shape[1]
            self.buffers[key] = _GeneratedBuffer(pool, dtype, (shape[0], width), self._maker(key, width))

    def _scales(self, r0: int, r1: int, width: int) -> np.ndarray:
        rng = _rng(self._seed, self._name, "scales", r0)
        d = rng.standard_normal((r1 - r0, width), dtype=np.float32)                        # [rows, groups]
        d *= np.float32(SCALE_SPREAD)
        np.exp(d, out=d)
        d *= np.float32(self._d0)
        return d

    def _maker(self, key: str, width: int) -> Callable[[int, int], np.ndarray]:
        from engine.kernels.layout import f16_bits, f16_values

        if key == "scales":
            return lambda r0, r1: f16_bits(self._scales(r0, r1, width))
        if key == "mins":   # m = centre * d, with d as stored (fp16), so the codes are centred on zero
            return lambda r0, r1: f16_bits(f16_values(f16_bits(self._scales(r0, r1, width))) * np.float32(self._centre))

        bits, half = self._bits, 1 << (self._bits - 1)
        if self._asym:
            def codes(r0: int, r1: int) -> np.ndarray:
                raw = _rng(self._seed, self._name, key, r0).bytes((r1 - r0) * width)   # every byte is a valid packing
                return np.frombuffer(raw, np.uint8)
        elif bits in (4, 8):    # one plane of nibbles or bytes: the lowest code is moved to the middle in place
            def codes(r0: int, r1: int) -> np.ndarray:
                x = np.frombuffer(_rng(self._seed, self._name, key, r0).bytes((r1 - r0) * width), np.uint8).copy()
                if bits == 8:
                    x[x == 0] = half
                else:
                    x |= ((x & 0x0F) == 0).view(np.uint8) << 3     # low nibble 0 -> 8
                    x |= ((x & 0xF0) == 0).view(np.uint8) << 7     # high nibble 0 -> 8
                return x
        else:                   # codes split over two planes: draw whole codes, fix them, pack, keep this plane
            def codes(r0: int, r1: int) -> np.ndarray:
                from engine.kernels.layout import pack_codes

                raw = np.frombuffer(_rng(self._seed, self._name, "codes", r0).bytes((r1 - r0) * self._n_in), np.uint8)
                u = (raw & np.uint8((1 << bits) - 1)).reshape(r1 - r0, self._n_in)
                u = np.where(u == 0, np.uint8(half), u)
                return pack_codes(u, bits)[0 if key == "a" else 1]
        return codes

    def to_buffers(self) -> tuple[dict, dict[str, Any]]:
        """(meta, generated buffers) for ContainerWriter."""
        return self.meta, self.buffers


def _float_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> np.ndarray:
    """A tensor convert keeps in float32 (norms: ones; routers, biases, kv_b ...: normal(0, std)), seeded."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    values = _rng(seed, name, "f32", 0).standard_normal(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
    values *= np.float32(std)
    return values.reshape(shape)


def write_container(shape_name: str, out: str | Path, *, bits: int, group: int = 32, seed: int = 0,
                    layers: int | None = None, progress: Progress | None = None,
                    corpus: list[str] | None = None) -> ContainerPlan:
    """Write the random quantized container of `shape_name` (its first `layers` layers) to `out`; return its plan.

    The container is the one `colibri convert` writes with `--bits B --group G` (ContainerWriter, convert's uniform
    plan), into OUT.partial and renamed to OUT only when complete; an interrupted write resumes on a rerun with
    the same settings. The disk's free space is checked before anything is written. The same seed gives the
    same bytes.
    """
    from app.hub.convert import _check_space
    from engine.formats.container import ContainerWriter

    _sentencepiece()
    cplan = plan_container(shape_name, bits, group, layers)
    synth = cplan.synth
    out = Path(out).expanduser().absolute()
    if out.exists():
        raise ColibriError(f"{out} already exists; choose a new folder or remove it first")
    if not out.parent.is_dir():
        raise ColibriError(f"{out.parent} does not exist; create it first or choose another OUT")
    free = shutil.disk_usage(out.parent).free
    need = cplan.expected_bytes()
    partial = out.with_name(out.name + ".partial")
    if not partial.exists() and free < need:
        raise DiskFullError(f"{out.parent} has {free / 1e9:.1f} GB free but the container needs {need / 1e9:.1f} GB; "
                            "free some space, choose another folder, or fewer --bits / --layers")
    if progress is not None:
        progress(0, cplan.nbytes, "tokenizer")
    model = train_sentencepiece(synth.spec.vocab_size, corpus if corpus is not None else corpus_lines(
        None if synth.spec.vocab_size > 8192 else 40 * synth.spec.vocab_size))
    std = float(synth.config["initializer_range"])
    writer = ContainerWriter(out, cplan.resume_key(seed))
    try:
        if not writer.complete:
            writer.expected_bytes = need
            writer.sync_bytes = SYNC_BYTES
            _check_space(writer)
            with ThreadPoolExecutor(max_workers=2) as pool:    # numpy and the generators release the GIL
                _write_tensors(writer, cplan, pool, seed, std, progress)
            pieces = _write_small_files(writer.partial, synth, model)
            if pieces > synth.spec.vocab_size:
                raise ColibriError(f"the tokenizer has {pieces} pieces, more than the vocabulary's {synth.spec.vocab_size}")
            manifest = {
                "config": synth.config,
                "source": {"path": f"colibri synth {synth.shape.name}", "architecture": synth.spec.architecture,
                           "synth": cplan.resume_key(seed)},
                "plan": cplan.plan.to_json(),
                "calibration_tokens": 0,
            }
            writer.finish(manifest)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise DiskFullError(f"disk full at {writer.written_bytes} of about {need} bytes: free space and run again "
                            f"to resume (the work so far is kept in {writer.partial})") from None
    finally:
        writer.close()
    return cplan


def _write_tensors(writer: Any, cplan: ContainerPlan, pool: ThreadPoolExecutor, seed: int, std: float,
                   progress: Progress | None) -> None:
    """convert's order: float32 tensors, then the other planned matrices, then each routed expert's extent."""
    mats, plan = cplan.mats, cplan.plan

    def quant(name: str) -> _GeneratedQuant:
        tp = plan.tensors[name]
        return _GeneratedQuant(pool, name, tuple(tp.shape), tp.bits, tp.group, seed, std)

    def tick(what: str) -> None:
        if progress is not None:
            progress(min(writer.written_bytes, cplan.nbytes), cplan.nbytes, what)

    in_experts = {n for names in mats.experts.values() for n in names}
    for name, shape in mats.float32.items():
        if not writer.has(name):
            writer.add_dense(name, _float_tensor(name, tuple(shape), seed, std), "f32")
    for name in mats.planned:
        if name not in in_experts and not writer.has(name):
            writer.add_dense(name, quant(name), "quant")
            tick(name)
    for (layer, expert), names in mats.experts.items():
        if not writer.has_expert(layer, expert):
            writer.add_expert(layer, expert, {n: quant(n) for n in names}, dict.fromkeys(names, "quant"))
            if expert % 8 == 7:
                tick(f"layer {layer} experts")
    tick("manifest")


def _write_small_files(folder: Path, synth: SynthPlan, sp_model: bytes) -> int:
    """config.json, generation_config.json and the tokenizer files, as the bf16 checkpoint has them."""
    (folder / "tokenizer.model").write_bytes(sp_model)
    (folder / "tokenizer.json").write_text(tokenizer_json(sp_model), encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config(sp_model, synth.spec.max_position))
    _write_json(folder / "config.json", synth.config)
    _write_json(folder / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "transformers_version": TRANSFORMERS_FORMAT})
    return _sentencepiece().SentencePieceProcessor(model_proto=sp_model).get_piece_size()
