"""Random-weight Hugging Face checkpoints of real architectures, for benchmarks without downloads.

`plan_checkpoint` lays out a shape's tensors, files and byte counts without writing anything;
`write_checkpoint` streams seeded normal(0, 0.02) weights to safetensors shard by shard (never
the whole model in RAM), writes config.json as transformers 5 writes it, and trains a
SentencePiece tokenizer on offline text (Python's standard library) so that both Colibri and
llama.cpp's converter can read the folder. The folder appears under its name only when complete.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import sysconfig
import tempfile
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from app.bench.synth.config import BOS_ID, EOS_ID, INIT_STD, UNK_ID, Shape
from app.bench.synth.shapes import DTYPES, TRANSFORMERS_FORMAT, config_for, get_shape
from engine.errors import ColibriError, DiskFullError, is_disk_full
from engine.spec import ModelSpec, MoESpec

SHARD_BYTES = 2_000_000_000        # largest shard ("2GB" as transformers counts it)
CHUNK = 1 << 22                    # elements generated per job: fixes the random stream per seed

# progress(bytes written, bytes in all, what is being written)
Progress = Callable[[int, int, str], None]


# ---- the plan: tensors, files, counts -------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the checkpoint: where it goes and how it is initialised."""

    name: str
    shape: tuple[int, ...]
    init: str          # "normal" (std INIT_STD) or "ones" (norm weights)
    file: str          # the safetensors file that holds it
    offset: int        # byte offset inside the file's data section
    nbytes: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class SynthPlan:
    """Everything `write_checkpoint` will write for a shape and dtype, known before writing."""

    shape: Shape
    dtype: str
    config: dict[str, Any]
    spec: ModelSpec
    tensors: tuple[TensorPlan, ...]
    files: tuple[str, ...]
    total_params: int
    active_params: int     # used per token: all but the routed experts a token does not pick
    nbytes: int            # tensor bytes in all files

    @property
    def sharded(self) -> bool:
        """Whether the weights span several files (and an index)."""
        return len(self.files) > 1


def _tensor_order(names: list[str]) -> list[str]:
    """Embedding, then layer by layer (experts of a layer together), then final norm and head."""
    def key(name: str) -> tuple[int, int]:
        if name.startswith("model.layers."):
            return 1, int(name.split(".")[2])
        return (0, 0) if name.startswith("model.embed_tokens") else (2, 0)
    return sorted(names, key=key)  # stable: keeps the spec's order inside a layer


def _active_params(spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> int:
    """All parameters but the routed experts a token does not pick (per-expert or fused tensors alike)."""
    total = sum(int(np.prod(dims, dtype=np.int64)) for dims in shapes.values())
    idle = 0
    for i, layer in enumerate(spec.layers):
        if isinstance(layer.ffn, MoESpec):
            prefix = f"model.layers.{i}."   # routed experts sit under ".experts." (shared ones: "shared_experts")
            routed = sum(int(np.prod(dims, dtype=np.int64)) for name, dims in shapes.items()
                         if name.startswith(prefix) and ".experts." in name)
            idle += routed * (layer.ffn.n_experts - layer.ffn.top_k) // layer.ffn.n_experts
    return total - idle


def _stored_shapes(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Colibri's tensor names -> the names and shapes transformers saves for the family.

    gpt-oss checkpoints hold each layer's experts fused ([E, hidden, 2*ffn] gate/up interleaved, [E, ffn,
    hidden] down, their biases) and the router as `mlp.router`; transformers reads no other layout.
    """
    if config["model_type"] != "gpt_oss":
        return shapes
    out: dict[str, tuple[int, ...]] = {}
    e, h, i = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    for name, dims in shapes.items():
        if ".mlp.experts." in name:
            if name.endswith(".experts.0.gate_proj.weight"):
                base = name[:-len("0.gate_proj.weight")]
                out |= {base + "gate_up_proj": (e, h, 2 * i), base + "gate_up_proj_bias": (e, 2 * i),
                        base + "down_proj": (e, i, h), base + "down_proj_bias": (e, h)}
        elif ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".mlp.router.")] = dims
        else:
            out[name] = dims
    return out


def plan_checkpoint(shape_name: str, dtype: str = "bf16", shard_bytes: int = SHARD_BYTES,
                    layers: int | None = None) -> SynthPlan:
    """Lay out the checkpoint of `shape_name` (its first `layers` layers; all by default): tensors (named and
    shaped as transformers saves the family), shard files, parameter and byte counts."""
    from engine.models import spec_from_config  # imported here: `colibri --help` stays quick
    from engine.models.transformer import expected_shapes

    shape = get_shape(shape_name)
    config = config_for(shape, dtype, layers)
    spec = spec_from_config(config, f"synth shape {shape.name}")
    shapes = _stored_shapes(config, expected_shapes(spec))
    item = DTYPES[dtype][1]
    groups: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    used = 0
    for name in _tensor_order(list(shapes)):
        nbytes = int(np.prod(shapes[name], dtype=np.int64)) * item
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, shapes[name], nbytes))
        used += nbytes
    n = len(groups)
    files = ("model.safetensors",) if n == 1 else tuple(f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n))
    tensors = []
    for file, group in zip(files, groups):
        offset = 0
        for name, dims, nbytes in group:
            init = "ones" if name.endswith("norm.weight") else "normal"
            tensors.append(TensorPlan(name, tuple(dims), init, file, offset, nbytes))
            offset += nbytes
    total = sum(t.size for t in tensors)
    return SynthPlan(shape, dtype, config, spec, tuple(tensors), files, total,
                     _active_params(spec, shapes), sum(t.nbytes for t in tensors))


# ---- weights --------------------------------------------------------------------------------


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the stored little-endian representation (bf16 rounded to nearest even)."""
    if dtype == "f32":
        return x.astype("<f4", copy=False)
    if dtype == "f16":
        return x.astype("<f2")
    u = x.view(np.uint32)
    u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    u >>= np.uint32(16)
    return u.astype("<u2")


def tensor_chunk(t: TensorPlan, index: int, seed: int, dtype: str, std: float = INIT_STD) -> bytes:
    """The stored bytes of elements [index*CHUNK, ...) of tensor t; the same for any shard layout."""
    n = min(CHUNK, t.size - index * CHUNK)
    if t.init == "ones":
        values = np.ones(n, np.float32)
    else:
        rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(t.name.encode()), index]))
        values = rng.standard_normal(n, dtype=np.float32)
        values *= np.float32(std)
    return _encode(values, dtype).tobytes()


def _header(tensors: list[TensorPlan], st_dtype: str) -> bytes:
    table: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        table[t.name] = {"dtype": st_dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.nbytes]}
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_weights(plan: SynthPlan, folder: Path, seed: int, progress: Progress | None) -> None:
    st_dtype = DTYPES[plan.dtype][0]
    std = float(plan.config["initializer_range"])
    done = 0
    with ThreadPoolExecutor(max_workers=2) as pool:  # numpy releases the GIL while filling chunks
        for file in plan.files:
            tensors = [t for t in plan.tensors if t.file == file]
            jobs = ((t, i) for t in tensors for i in range(-(-t.size // CHUNK)))
            pending: deque = deque()
            with open(folder / file, "wb") as f:
                f.write(_header(tensors, st_dtype))
                while True:
                    while len(pending) < 4 and (job := next(jobs, None)) is not None:
                        pending.append(pool.submit(tensor_chunk, job[0], job[1], seed, plan.dtype, std))
                    if not pending:
                        break
                    data = pending.popleft().result()
                    f.write(data)
                    done += len(data)
                    if progress is not None:
                        progress(done, plan.nbytes, file)
                f.flush()
                os.fsync(f.fileno())
    if plan.sharded:
        index = {
            "metadata": {"total_parameters": plan.total_params, "total_size": plan.nbytes},
            "weight_map": {t.name: t.file for t in sorted(plan.tensors, key=lambda t: t.name)},
        }
        _write_json(folder / "model.safetensors.index.json", index)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ---- tokenizer ------------------------------------------------------------------------------


def _sentencepiece():
    try:
        import sentencepiece
    except ImportError:
        raise ColibriError(
            "colibri synth trains a SentencePiece tokenizer and needs the sentencepiece package: "
            "pip install 'colibri[bench]'"
        ) from None
    return sentencepiece


def corpus_lines(limit: int | None = None) -> list[str]:
    """Non-blank lines of the Python standard library's sources (offline text), evenly thinned to `limit`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    lines: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines += [line for line in text.splitlines() if line.strip()]
    if len(lines) < 1000:
        raise ColibriError(f"found too little text under {root} to train a tokenizer; "
                           "run colibri synth with a Python that has its standard library sources")
    if limit is not None and len(lines) > limit:
        step = len(lines) / limit
        lines = [lines[int(i * step)] for i in range(limit)]
    return lines


def train_sentencepiece(vocab_size: int, lines: list[str]) -> bytes:
    """A SentencePiece BPE model (byte fallback, Llama's settings) of up to `vocab_size` pieces."""
    spm = _sentencepiece()
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        character_coverage=0.9995, hard_vocab_limit=False, input_sentence_size=0, shuffle_input_sentence=False,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1, num_threads=2, minloglevel=2,
    )
    return out.getvalue()


def tokenizer_json(sp_model: bytes) -> str:
    """tokenizer.json that encodes like the SentencePiece model (built as for a 'llama' GGUF vocabulary)."""
    from engine.tokenizer.gguf_vocab import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, build_from_gguf

    sp = _sentencepiece().SentencePieceProcessor(model_proto=sp_model)
    n = sp.get_piece_size()
    kinds = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
             else BYTE if sp.is_byte(i) else NORMAL for i in range(n)]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.bos_token_id": BOS_ID, "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.unknown_token_id": UNK_ID,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": True,
    }
    return build_from_gguf(meta, "the trained SentencePiece model").backend.to_str(pretty=True)


def tokenizer_config(sp_model: bytes, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for the trained model: special tokens, BOS policy, no cleanup."""
    sp = _sentencepiece().SentencePieceProcessor(model_proto=sp_model)
    special = {str(i): {"content": sp.id_to_piece(i), "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for i in (UNK_ID, BOS_ID, EOS_ID)}
    return {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": special,
        "bos_token": sp.id_to_piece(BOS_ID), "eos_token": sp.id_to_piece(EOS_ID), "unk_token": sp.id_to_piece(UNK_ID),
        "clean_up_tokenization_spaces": False, "model_max_length": max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(folder: Path, vocab_size: int, max_length: int, lines: list[str] | None = None) -> int:
    """Train and write tokenizer.model, tokenizer.json and tokenizer_config.json; return the piece count."""
    if lines is None:
        # enough text for the vocabulary, and no more: small vocabularies train in a fraction of a second
        lines = corpus_lines(None if vocab_size > 8192 else 40 * vocab_size)
    model = train_sentencepiece(vocab_size, lines)
    (folder / "tokenizer.model").write_bytes(model)
    (folder / "tokenizer.json").write_text(tokenizer_json(model), encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config(model, max_length))
    return _sentencepiece().SentencePieceProcessor(model_proto=model).get_piece_size()


# ---- the whole folder -----------------------------------------------------------------------


def _check_target(out: Path, need: int) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ColibriError(f"{out} already exists; choose a new folder or remove it first")
    parent = out.parent
    if not parent.is_dir():
        raise ColibriError(f"{parent} does not exist; create it first or choose another OUT")
    free = shutil.disk_usage(parent).free
    if free < need + (64 << 20):
        raise ColibriError(f"{parent} has {free / 1e9:.1f} GB free but the checkpoint needs {need / 1e9:.1f} GB; "
                           "free some space, choose another folder, or a smaller --dtype / shape")


def write_checkpoint(shape_name: str, out: str | Path, *, seed: int = 0, dtype: str = "bf16",
                     progress: Progress | None = None, corpus: list[str] | None = None,
                     shard_bytes: int = SHARD_BYTES, layers: int | None = None) -> SynthPlan:
    """Write the random checkpoint of `shape_name` (its first `layers` layers) to folder `out` atomically;
    return its plan.

    `corpus` replaces the tokenizer's training text (default: the standard library's sources).
    """
    _sentencepiece()  # fail before any work when the tokenizer cannot be trained
    plan = plan_checkpoint(shape_name, dtype, shard_bytes, layers)
    out = Path(out).expanduser().absolute()
    _check_target(out, plan.nbytes)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        if progress is not None:
            progress(0, plan.nbytes, "tokenizer")
        pieces = write_tokenizer(tmp, plan.spec.vocab_size, plan.spec.max_position, corpus)
        if pieces > plan.spec.vocab_size:
            raise ColibriError(f"the tokenizer has {pieces} pieces, more than the vocabulary's {plan.spec.vocab_size}")
        _write_json(tmp / "config.json", plan.config)
        _write_json(tmp / "generation_config.json",
                    {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "transformers_version": TRANSFORMERS_FORMAT})
        _write_weights(plan, tmp, seed, progress)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if out.is_dir():
            out.rmdir()  # an empty folder given as OUT is replaced
        os.rename(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise DiskFullError(f"disk full in {out.parent} while writing the checkpoint (nothing was kept): free "
                                "space, choose another folder, or a smaller --dtype / shape") from None
        raise
    return plan
