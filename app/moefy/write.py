"""Writing an upcycled model as a standard Mixtral checkpoint: config.json, model.safetensors, tokenizer.

Tensors are streamed into one safetensors file (the header is known in advance), so a 1.3 GB
checkpoint never sits in memory at once. Experts are the dense feed-forward matrices times
(1 + noise * N(0, 1)), each from its own seeded generator: expert e of layer i is the same bytes
for the same seed, whatever the other experts are.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from engine.errors import ColibriError, DiskFullError, is_disk_full
from engine.models.transformer import layer_prefix
from engine.spec import AttentionSpec, MLPSpec, ModelSpec, RopeSpec
from engine.tokenizer import Tokenizer
from engine.weights import TensorSource

DTYPES = {"bfloat16": "BF16", "float32": "F32"}
MOE_PREFIX = "block_sparse_moe"
# dense MLP matrix -> Mixtral expert matrix (w1 gate, w3 up, w2 down)
EXPERT_NAMES = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def rope_parameters(rope: RopeSpec) -> dict[str, Any]:
    """The config.json `rope_parameters` of a Llama RoPE spec."""
    if rope.freq_factors is not None:
        raise ColibriError("the source's RoPE comes as per-frequency factors (a GGUF rope_freqs tensor), which a "
                           "config.json cannot express: moefy the model's Hugging Face folder instead")
    params: dict[str, Any] = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.kind == "linear":
        params["factor"] = rope.factor
    elif rope.kind == "llama3":
        params |= {"factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                   "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": rope.original_max_position}
    elif rope.kind != "default":
        raise ColibriError(f"RoPE type {rope.kind!r} is not one a Llama model uses; moefy cannot carry it over")
    return params


def mixtral_config(spec: ModelSpec, n_experts: int, top_k: int, dtype: str) -> dict[str, Any]:
    """config.json of the upcycled model: the dense spec's numbers, E experts of the dense FFN's size."""
    attn, ffn = spec.layers[0].attn, spec.layers[0].ffn
    assert isinstance(attn, AttentionSpec) and isinstance(ffn, MLPSpec)
    eos = list(spec.eos_token_ids)
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": ffn.intermediate,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "hidden_act": ffn.act,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.rms_eps,
        "rope_parameters": rope_parameters(attn.rope),
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "num_local_experts": n_experts,
        "num_experts_per_tok": top_k,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
    }


def perturbed(w: np.ndarray, noise: float, seed: int, layer: int, expert: int, matrix: int) -> np.ndarray:
    """w * (1 + noise * N(0, 1)) from the generator of (seed, layer, expert, matrix); w itself when noise is 0."""
    if noise == 0:
        return w
    rng = np.random.default_rng([seed, layer, expert, matrix])
    eps = rng.standard_normal(w.shape, dtype=np.float32)
    eps *= np.float32(noise)
    eps += np.float32(1.0)
    return w * eps


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)


class SafetensorsWriter:
    """One safetensors file written tensor by tensor, in the order its header lists them."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: str, metadata: dict[str, str]):
        self.code = DTYPES[dtype]
        self.item = 2 if self.code == "BF16" else 4
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, shape in entries:
            size = int(np.prod(shape)) * self.item
            header[name] = {"dtype": self.code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.order = [name for name, _ in entries]
        self.shapes = dict(entries)
        self.done = 0
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, array: np.ndarray) -> None:
        """Append the next tensor (its name and shape must be the header's next entry)."""
        if self.done >= len(self.order) or self.order[self.done] != name:
            raise RuntimeError(f"tensor {name} written out of order")
        if tuple(array.shape) != tuple(self.shapes[name]):
            raise RuntimeError(f"tensor {name} has shape {array.shape}, header says {self.shapes[name]}")
        data = f32_to_bf16(array) if self.code == "BF16" else np.ascontiguousarray(array, dtype="<f4")
        self.file.write(data.tobytes())
        self.done += 1

    def close(self) -> None:
        """Check every tensor was written, then flush the file to disk."""
        with self.file:
            if self.done != len(self.order):
                raise RuntimeError(f"{len(self.order) - self.done} tensors were never written")
            self.file.flush()
            os.fsync(self.file.fileno())


def checkpoint_tensors(spec: ModelSpec, n_experts: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the upcycled checkpoint with its shape, in the order they are written."""
    h = spec.hidden_size
    entries: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab_size, h))]
    for i, layer in enumerate(spec.layers):
        attn, ffn = layer.attn, layer.ffn
        assert isinstance(attn, AttentionSpec) and isinstance(ffn, MLPSpec)
        p = layer_prefix(i)
        q, kv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        entries += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                    (f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                    (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                    (f"{p}.{MOE_PREFIX}.gate.weight", (n_experts, h))]
        shapes = {"w1": (ffn.intermediate, h), "w3": (ffn.intermediate, h), "w2": (h, ffn.intermediate)}
        for e in range(n_experts):
            entries += [(f"{p}.{MOE_PREFIX}.experts.{e}.{new}.weight", shapes[new]) for _, new in EXPERT_NAMES]
    entries.append(("model.norm.weight", (h,)))
    if not spec.tie_embeddings:
        entries.append(("lm_head.weight", (spec.vocab_size, h)))
    return entries


def write_weights(path: Path, spec: ModelSpec, source: TensorSource, routers: dict[int, np.ndarray], noise: float,
                  seed: int, dtype: str, metadata: dict[str, str], tick: Callable[[int], None] | None = None) -> None:
    """Write model.safetensors: the dense tensors as they are, a router and E perturbed FFN copies per layer."""
    n_experts = next(iter(routers.values())).shape[0]
    with disk_full_as_error(path):
        writer = SafetensorsWriter(path, checkpoint_tensors(spec, n_experts), dtype, metadata)
        try:
            for name, array in _tensor_stream(spec, source, routers, noise, seed):
                writer.write(name, array)
                if tick is not None and name.endswith(".gate.weight"):
                    tick(int(name.split(".")[2]))
        except BaseException:
            writer.file.close()  # the caller removes the half-written file with its folder
            raise
        writer.close()


@contextlib.contextmanager
def disk_full_as_error(path: Path) -> Iterator[None]:
    """Turn a full disk while writing PATH (in moefy's temporary folder) into a DiskFullError."""
    try:
        yield
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise DiskFullError(f"disk full in {path.parent.parent} while writing the MoE's {path.name} (nothing was "
                            "kept): free space or choose another OUT, and run moefy again") from None


def _tensor_stream(spec: ModelSpec, source: TensorSource, routers: dict[int, np.ndarray], noise: float,
                   seed: int) -> Iterator[tuple[str, np.ndarray]]:
    n_experts = next(iter(routers.values())).shape[0]
    yield "model.embed_tokens.weight", source.load("model.embed_tokens.weight")
    for i in range(spec.n_layers):
        p = layer_prefix(i)
        for part in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj"):
            yield f"{p}.{part}.weight", source.load(f"{p}.{part}.weight")
        yield f"{p}.{MOE_PREFIX}.gate.weight", routers[i]
        dense = [source.load(f"{p}.mlp.{old}.weight") for old, _ in EXPERT_NAMES]
        for e in range(n_experts):
            for m, (_, new) in enumerate(EXPERT_NAMES):
                yield f"{p}.{MOE_PREFIX}.experts.{e}.{new}.weight", perturbed(dense[m], noise, seed, i, e, m)
    yield "model.norm.weight", source.load("model.norm.weight")
    if not spec.tie_embeddings:
        yield "lm_head.weight", source.load("lm_head.weight")


def write_tokenizer(src: Path, out: Path, tokenizer: Tokenizer | None, gguf_meta: dict[str, Any] | None,
                    max_position: int) -> None:
    """Tokenizer files for OUT: copied from a folder source, or made from a GGUF's tokenizer metadata."""
    with disk_full_as_error(out / "tokenizer.json"):
        _write_tokenizer(src, out, tokenizer, gguf_meta, max_position)


def _write_tokenizer(src: Path, out: Path, tokenizer: Tokenizer | None, gguf_meta: dict[str, Any] | None,
                     max_position: int) -> None:
    if gguf_meta is None:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        if (src / "additional_chat_templates").is_dir():
            shutil.copytree(src / "additional_chat_templates", out / "additional_chat_templates")
        return
    if tokenizer is None:
        return
    (out / "tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "model_max_length": max_position, **tokenizer.special_tokens}
    default = gguf_meta.get("tokenizer.chat_template")
    named = {k.removeprefix("tokenizer.chat_template."): v for k, v in gguf_meta.items()
             if k.startswith("tokenizer.chat_template.") and isinstance(v, str)}
    if named:
        config["chat_template"] = ([{"name": "default", "template": default}] if default else []) + \
            [{"name": n, "template": t} for n, t in sorted(named.items())]
    elif default:
        config["chat_template"] = default
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_json(path: Path, data: Any) -> None:
    """A JSON file, indented, with a final newline."""
    with disk_full_as_error(path):
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
