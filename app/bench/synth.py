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
import math
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

from app.bench.synth_config import BOS_ID, EOS_ID, INIT_STD, UNK_ID, Shape, common_config
from app.bench.synth_families import FAMILY_SHAPES
from engine.errors import ColibriError, DiskFullError, is_disk_full
from engine.spec import ModelSpec, MoESpec

# The transformers release whose config.json layout this module writes.
TRANSFORMERS_FORMAT = "5.0.0"
SHARD_BYTES = 2_000_000_000        # largest shard ("2GB" as transformers counts it)
CHUNK = 1 << 22                    # elements generated per job: fixes the random stream per seed

# --dtype -> (safetensors dtype, bytes per element, config.json "dtype")
DTYPES: dict[str, tuple[str, int, str]] = {
    "bf16": ("BF16", 2, "bfloat16"),
    "f16": ("F16", 2, "float16"),
    "f32": ("F32", 4, "float32"),
}


# progress(bytes written, bytes in all, what is being written)
Progress = Callable[[int, int, str], None]


# ---- shapes ---------------------------------------------------------------------------------


def llama_config(*, head_dim: int, **kw: Any) -> dict[str, Any]:
    """A LlamaForCausalLM config.json (without dtype and version)."""
    return common_config("LlamaForCausalLM", "llama", **kw) | {
        "attention_bias": False, "head_dim": head_dim, "mlp_bias": False, "pretraining_tp": 1,
    }


def mixtral_config(*, head_dim: int, experts: int, top_k: int, **kw: Any) -> dict[str, Any]:
    """A MixtralForCausalLM config.json (without dtype and version)."""
    return common_config("MixtralForCausalLM", "mixtral", **kw) | {
        "head_dim": head_dim, "num_experts_per_tok": top_k, "num_local_experts": experts,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def olmoe_config(*, experts: int, top_k: int, **kw: Any) -> dict[str, Any]:
    """An OlmoeForCausalLM config.json (without dtype and version)."""
    return common_config("OlmoeForCausalLM", "olmoe", **kw) | {
        "attention_bias": False, "clip_qkv": None, "norm_topk_prob": False, "num_experts": experts,
        "num_experts_per_tok": top_k, "output_router_logits": False, "router_aux_loss_coef": 0.01,
    }


def qwen2_config(**kw: Any) -> dict[str, Any]:
    """A Qwen2ForCausalLM (Qwen2.5) config.json (without dtype and version): Llama's layout, q/k/v biases."""
    return common_config("Qwen2ForCausalLM", "qwen2", **kw) | {
        "layer_types": ["full_attention"] * kw["layers"], "max_window_layers": kw["layers"], "sliding_window": None,
        "use_sliding_window": False,
    }


def qwen3_moe_config(*, head_dim: int, experts: int, top_k: int, moe_ffn: int, **kw: Any) -> dict[str, Any]:
    """A Qwen3MoeForCausalLM config.json (without dtype and version): q/k norms, softmax top-k routing; the
    expert count under transformers 5's name (`num_local_experts`; the release says `num_experts`)."""
    return common_config("Qwen3MoeForCausalLM", "qwen3_moe", **kw) | {
        "attention_bias": False, "decoder_sparse_step": 1, "head_dim": head_dim, "max_window_layers": kw["layers"],
        "mlp_only_layers": [], "moe_intermediate_size": moe_ffn, "norm_topk_prob": True, "num_local_experts": experts,
        "num_experts_per_tok": top_k, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "use_sliding_window": False,
    }


def glm4_moe_config(*, experts: int, top_k: int, moe_ffn: int, dense_layers: int, shared_experts: int = 1,
                    qk_norm: bool = True, partial_rotary: float = 0.5, head_dim: int | None = None,
                    attention_bias: bool = False, **kw: Any) -> dict[str, Any]:
    """A Glm4MoeForCausalLM (GLM-4.5) config.json (without dtype and version): sigmoid routing with a
    score-correction bias, `dense_layers` dense layers first, partial RoPE."""
    config = common_config("Glm4MoeForCausalLM", "glm4_moe", **kw) | {
        "attention_bias": attention_bias, "first_k_dense_replace": dense_layers, "moe_intermediate_size": moe_ffn,
        "n_group": 1, "n_routed_experts": experts, "n_shared_experts": shared_experts, "norm_topk_prob": True,
        "num_experts_per_tok": top_k, "num_nextn_predict_layers": 0, "output_router_logits": False,
        "routed_scaling_factor": 1.0, "topk_group": 1, "use_qk_norm": qk_norm,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    config["rope_parameters"] = config["rope_parameters"] | {"partial_rotary_factor": partial_rotary}
    return config


def glm_moe_dsa_config(*, experts: int, top_k: int, moe_ffn: int, dense_layers: int, q_lora: int, kv_lora: int,
                       nope_dim: int, rope_dim: int, v_dim: int, index_heads: int, index_dim: int, index_topk: int,
                       indexer_types: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """A GlmMoeDsaForCausalLM (GLM-5) config.json (without dtype and version): latent attention with a
    sparse-attention indexer per layer ("full", or "shared": reuses the previous full layer's pick)."""
    layers = kw["layers"]
    config = common_config("GlmMoeDsaForCausalLM", "glm_moe_dsa", kv_heads=kw["heads"], **kw) | {
        "attention_bias": False, "first_k_dense_replace": dense_layers, "head_dim": rope_dim,
        "index_head_dim": index_dim, "index_n_heads": index_heads, "index_topk": index_topk,
        "indexer_types": indexer_types or ["full"] * layers, "kv_lora_rank": kv_lora,
        "layer_types": ["indexed_attention"] * layers, "mlp_bias": False,
        "mlp_layer_types": ["dense"] * dense_layers + ["sparse"] * (layers - dense_layers),
        "moe_intermediate_size": moe_ffn, "n_group": 1, "n_routed_experts": experts, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_experts_per_tok": top_k, "output_router_logits": False, "q_lora_rank": q_lora,
        "qk_head_dim": nope_dim + rope_dim, "qk_nope_head_dim": nope_dim, "qk_rope_head_dim": rope_dim,
        "routed_scaling_factor": 2.5, "topk_group": 1, "v_head_dim": v_dim,
    }
    return config


def gpt_oss_config(*, head_dim: int, experts: int, top_k: int, sliding_window: int, **kw: Any) -> dict[str, Any]:
    """A GptOssForCausalLM config.json (without dtype and version): alternating sliding and full
    attention with sinks, biased experts with the clamped SwiGLU, YaRN RoPE."""
    config = common_config("GptOssForCausalLM", "gpt_oss", **kw) | {
        "attention_bias": True, "head_dim": head_dim,
        "layer_types": ["sliding_attention", "full_attention"] * (kw["layers"] // 2) + ["sliding_attention"] * (kw["layers"] % 2),
        "num_experts_per_tok": top_k, "num_local_experts": experts, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "sliding_window": sliding_window, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    }
    config["rope_parameters"] = {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": kw["max_pos"] // 32,
        "rope_theta": float(kw["rope_theta"]), "rope_type": "yarn", "truncate": False,
    }
    return config


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("mixtral-1.7b", "Mixtral MoE, 64 experts top-8 (the benchmark shape)", mixtral_config(
        hidden=1024, layers=16, heads=16, kv_heads=16, head_dim=64, experts=64, top_k=8, ffn=512,
        vocab=32000, rope_theta=1e6, max_pos=4096, eps=1e-5)),
    Shape("olmoe-7b", "OLMoE-1B-7B's shape, 64 experts top-8, q/k norms", olmoe_config(
        hidden=2048, layers=16, heads=16, kv_heads=16, experts=64, top_k=8, ffn=1024,
        vocab=50304, rope_theta=1e4, max_pos=4096, eps=1e-5)),
    Shape("glm5-256e", "GLM-5's experts scaled down: 256 experts top-8, latent attention, indexer",
          glm_moe_dsa_config(
              hidden=1024, layers=6, heads=16, experts=256, top_k=8, moe_ffn=256, ffn=1536, dense_layers=1,
              q_lora=512, kv_lora=512, nope_dim=192, rope_dim=64, v_dim=256, index_heads=32, index_dim=128,
              index_topk=2048, vocab=32000, rope_theta=1e6, max_pos=8192, eps=1e-5)),
    # Published shapes: config.json values of the released checkpoints (from their model cards' configs), but the
    # token ids, which are the synthetic tokenizer's, and MTP layers, which Colibri does not run (none written).
    Shape("qwen3-30b-a3b", "Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B, 2025-04 release): 128 experts top-8, 30.5 B",
          qwen3_moe_config(
              hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_ffn=768, ffn=6144,
              vocab=151936, rope_theta=1e6, max_pos=40960, eps=1e-6)),
    Shape("gpt-oss-20b", "gpt-oss-20b (openai/gpt-oss-20b, 2025-08 release): 32 experts top-4, 20.9 B",
          gpt_oss_config(
              hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, ffn=2880,
              sliding_window=128, vocab=201088, rope_theta=1.5e5, max_pos=131072, eps=1e-5)),
    Shape("gpt-oss-120b", "gpt-oss-120b (openai/gpt-oss-120b, 2025-08 release): 128 experts top-4, 116.8 B",
          gpt_oss_config(
              hidden=2880, layers=36, heads=64, kv_heads=8, head_dim=64, experts=128, top_k=4, ffn=2880,
              sliding_window=128, vocab=201088, rope_theta=1.5e5, max_pos=131072, eps=1e-5)),
    Shape("glm-4.5-air", "GLM-4.5-Air (zai-org/GLM-4.5-Air, 2025-07 release): 128 experts top-8 + shared, 106 B",
          glm4_moe_config(
              hidden=4096, layers=46, heads=96, kv_heads=8, head_dim=128, experts=128, top_k=8, moe_ffn=1408,
              ffn=10944, dense_layers=1, qk_norm=False, attention_bias=True, vocab=151552, rope_theta=1e6,
              max_pos=131072, eps=1e-5)),
    Shape("qwen2.5-32b", "Qwen2.5-32B-Instruct (Qwen/Qwen2.5-32B-Instruct, 2024-09 release): dense, 32.8 B",
          qwen2_config(
              hidden=5120, layers=64, heads=40, kv_heads=8, ffn=27648, vocab=152064, rope_theta=1e6,
              max_pos=32768, eps=1e-6)),
    Shape("glm-5", "GLM-5 (zai-org/GLM-5, 2026-02 release): 256 experts top-8, latent attention, indexer, 744 B; "
          "use --layers N", glm_moe_dsa_config(
              hidden=6144, layers=78, heads=64, experts=256, top_k=8, moe_ffn=2048, ffn=12288, dense_layers=3,
              q_lora=2048, kv_lora=512, nope_dim=192, rope_dim=64, v_dim=256, index_heads=32, index_dim=128,
              index_topk=2048, vocab=154880, rope_theta=1e6, max_pos=202752, eps=1e-5)),
    *FAMILY_SHAPES,
    Shape("mixtral-tiny", "a few-MB Mixtral for tests and quick runs", mixtral_config(
        hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2, ffn=128,
        vocab=1024, rope_theta=1e6, max_pos=512, eps=1e-5)),
    Shape("olmoe-tiny", "a few-MB OLMoE for tests and quick runs", olmoe_config(
        hidden=128, layers=4, heads=4, kv_heads=4, experts=8, top_k=2, ffn=128,
        vocab=1024, rope_theta=1e4, max_pos=512, eps=1e-5)),
    Shape("glm4-moe-tiny", "a few-MB GLM-4.5 (sigmoid routing, shared expert, partial RoPE)", glm4_moe_config(
        hidden=128, layers=4, heads=4, kv_heads=2, experts=8, top_k=2, moe_ffn=64, ffn=256, dense_layers=1,
        vocab=1024, rope_theta=1e6, max_pos=512, eps=1e-5)),
    Shape("glm5-tiny", "a few-MB GLM-5 (latent attention, sparse-attention indexer, shared indexer layer)",
          glm_moe_dsa_config(
              hidden=128, layers=4, heads=4, experts=8, top_k=2, moe_ffn=64, ffn=256, dense_layers=1,
              q_lora=64, kv_lora=32, nope_dim=32, rope_dim=16, v_dim=32, index_heads=4, index_dim=32, index_topk=4,
              indexer_types=["full", "full", "shared", "full"], vocab=1024, rope_theta=1e4, max_pos=512, eps=1e-5)),
    Shape("gpt-oss-tiny", "a few-MB gpt-oss (sinks, sliding window, biased clamped-SwiGLU experts)", gpt_oss_config(
        hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2, ffn=128, sliding_window=4,
        vocab=1024, rope_theta=1.5e5, max_pos=4096, eps=1e-5)),
    Shape("llama-tiny", "a few-MB dense Llama for tests and quick runs", llama_config(
        hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=384,
        vocab=1024, rope_theta=1e4, max_pos=512, eps=1e-5)),
)}


def get_shape(name: str) -> Shape:
    """The shape called `name`, or an error listing the known ones."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ColibriError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)} (see `colibri synth --list`)") from None


def with_layers(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config cut to its first `layers` decoder layers: each layer keeps its published shapes and kind."""
    n = config["num_hidden_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= n:
        raise ColibriError(f"--layers {layers!r}: choose 1 to {n} (the shape's layer count)")
    out = dict(config, num_hidden_layers=layers)
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):     # one entry per layer
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    if "max_window_layers" in out:
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    return out


def config_for(shape: Shape, dtype: str, layers: int | None = None) -> dict[str, Any]:
    """The config.json dict of `shape` stored in `dtype` (its first `layers` layers), keys sorted as transformers
    writes them."""
    if dtype not in DTYPES:
        raise ColibriError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    config = shape.config if layers is None else with_layers(shape.config, layers)
    full = config | {"dtype": DTYPES[dtype][2], "transformers_version": TRANSFORMERS_FORMAT}
    return dict(sorted(full.items()))


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


# ---- a quantized container, written directly --------------------------------------------------
#
# `colibri synth SHAPE OUT --bits B` writes what `colibri convert SRC OUT --bits B` would write from the bf16
# checkpoint of the shape (same manifest, tensor kinds, plan, dense.bin and expert extents: convert's
# ContainerWriter and uniform plan do the writing), but with random codes and fp16 scales drawn directly: no
# bfloat16 detour, no quantization search. Each buffer is generated chunk by chunk while earlier chunks are
# written, so the working set is a few chunks whatever the model's size.

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
