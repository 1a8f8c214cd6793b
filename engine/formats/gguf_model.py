"""GGUF files as models: metadata -> a config.json-style dict, tensors -> Hugging Face names.

Weights are dequantized to float32 with the `gguf` package (every type it can dequantize), or,
when the model runs them (`quantized=True`), Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matrices become
`QuantizedTensor`s holding the same values: those block formats are Colibri's 4-, 5- and 8-bit
group-32 formats with the bytes rearranged (no rounding), so decode reads 4.5-8.5 bits per weight
instead of 32. llama.cpp stores the Q and K projections of Llama-architecture models permuted
for its interleaved RoPE; that permutation is undone here so the shared blocks see Hugging Face layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

import gguf
import numpy as np

from engine.errors import ModelFormatError, UnsupportedArchitectureError
from engine.formats.gguf_meta import gguf_metadata, open_gguf, release_tensor_pages
from engine.formats.page_release import np_map, release_range
from engine.kernels.layout import BLOCK
from engine.quant.tensor import QuantizedTensor

# GGUF architecture -> (Hugging Face architecture, its MoE variant when the file has experts)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "MixtralForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", None),
    "qwen3": ("Qwen3ForCausalLM", None),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_EXPERT_STACKS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_config(meta: dict[str, Any], n_output: bool, path: str) -> dict[str, Any]:
    """A config.json-style dict for the model a GGUF file describes (its values are checked as a config's are)."""
    try:
        return _gguf_config(meta, n_output, path)
    except (TypeError, ValueError, OverflowError) as exc:   # a value of the wrong type: a list where a count goes
        raise ModelFormatError(f"{path}: GGUF metadata is malformed ({exc}); download the file again") from None


def _gguf_config(meta: dict[str, Any], n_output: bool, path: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHITECTURES))}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"{path}: metadata {arch}.{key} is missing; the GGUF file is incomplete")
        return value

    dense_name, moe_name = _ARCHITECTURES[arch]
    n_experts = int(meta.get(f"{arch}.expert_count") or 0)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    if heads < 1:   # the head size below divides by it; the config's own checks come after
        raise ModelFormatError(f"{path}: metadata {arch}.attention.head_count is {heads}, expected at least 1; "
                               "the GGUF file is damaged: download it again")
    cfg: dict[str, Any] = {
        "architectures": [moe_name if n_experts and moe_name else dense_name],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        "tie_word_embeddings": not n_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_parameters"].update(
            rope_type=scaling,
            factor=float(get("rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length", cfg["max_position_embeddings"])),
        )
    if n_experts:
        cfg |= {
            "num_experts": n_experts,
            "num_local_experts": n_experts,
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length", cfg["intermediate_size"])),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": arch != "qwen2moe",
        }
        if arch == "llama":
            cfg["intermediate_size"] = int(get("expert_feed_forward_length", cfg["intermediate_size"]))
    return cfg


_Q = gguf.GGMLQuantizationType
# block formats that are Colibri formats: type -> (bits, asymmetric, bytes of d [, m], bytes of the high-bit word)
_NATIVE = {_Q.Q4_0: (4, False, 0), _Q.Q4_1: (4, True, 0), _Q.Q5_0: (5, False, 4), _Q.Q5_1: (5, True, 4),
           _Q.Q8_0: (8, False, 0)}


def native_blocks(raw: np.ndarray, qtype: "gguf.GGMLQuantizationType", rows: int, cols: int) -> QuantizedTensor:
    """GGUF blocks of a [rows, cols] matrix (raw bytes) as a QuantizedTensor of the same values.

    ggml's block is d (fp16) [, m (fp16)] [, qh (uint32: bit j = high bit of weight j)], then the codes:
    16 bytes of nibbles (byte j: weight j low, weight 16 + j high; Colibri's nibble plane) or 32
    signed bytes. Q4_0 and Q5_0 store u with w = d * (u - 2**(bits-1)): Colibri's symmetric format;
    Q8_0 stores signed q = u - 128; Q4_1 and Q5_1 store w = d * u + m: the asymmetric format.
    """
    bits, asym, high = _NATIVE[qtype]
    nb = cols // BLOCK
    blocks = np.asarray(raw, np.uint8).reshape(rows, nb, -1)                      # [rows, nb, block bytes]
    head = 4 if asym else 2
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.uint16).reshape(rows, nb)
    mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16).reshape(rows, nb) if asym \
        else np.zeros((rows, 0), np.uint16)
    codes = blocks[..., head + high:]
    if bits == 8:
        a = (codes ^ np.uint8(0x80)).reshape(rows, nb * 32)                      # signed q -> u = q + 128
    else:
        a = np.ascontiguousarray(codes).reshape(rows, nb * 16)
    b = np.ascontiguousarray(blocks[..., head:head + high]).reshape(rows, nb * high) if high \
        else np.zeros((rows, 0), np.uint8)
    return QuantizedTensor((rows, cols), bits, BLOCK, asym, np.ascontiguousarray(a), b, scales, mins)


def _rows(q: QuantizedTensor, rows) -> QuantizedTensor:
    """Some rows of a quantized matrix (a slice gives views, an index array copies)."""
    n = q.a[rows].shape[0]
    return QuantizedTensor((n, q.shape[1]), q.bits, q.group, q.asymmetric, np.ascontiguousarray(q.a[rows]),
                           np.ascontiguousarray(q.b[rows]), np.ascontiguousarray(q.scales[rows]),
                           np.ascontiguousarray(q.mins[rows]))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, (pairs, 2) rows back to (2, half) order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModel:
    """A GGUF file's metadata, config and tensors (by Hugging Face name, as float32).

    With `quantized`, matrices stored in a block format Colibri runs as is (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0) load as QuantizedTensors of the same values; routers and vectors stay float32.
    """

    def __init__(self, path: str | Path, quantized: bool = False):
        self.path = str(path)
        self.quantized = quantized
        self.reader = open_gguf(path)
        self.meta = gguf_metadata(self.reader)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._cache: dict[str, np.ndarray | QuantizedTensor] = {}
        self._stack_left: dict[str, set[int]] = {}   # GGUF expert stack -> experts not yet dropped (drop_pages)
        self.config = gguf_config(self.meta, "output.weight" in self._tensors, self.path)
        if not self.config["vocab_size"] and "token_embd.weight" in self._tensors:   # no tokenizer: the table says
            self.config["vocab_size"] = int(self._tensors["token_embd.weight"].shape[-1])
        if "rope_freqs.weight" in self._tensors:  # Llama 3.1 scaling, written as per-frequency factors
            factors = self._dequantized("rope_freqs.weight", keep=False).reshape(-1)
            self.config["rope_parameters"]["freq_factors"] = [float(f) for f in factors]
        self._arch = self.meta["general.architecture"]
        moe_prefix = "block_sparse_moe" if self.config["architectures"][0] == "MixtralForCausalLM" else "mlp"
        proj = ("w1", "w3", "w2") if moe_prefix == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
        # HF name -> (GGUF tensor name, expert index or None)
        self._names: dict[str, tuple[str, int | None]] = {}
        self.unmapped: list[str] = []    # GGUF tensors with no Hugging Face name: no model reads them
        for name, t in self._tensors.items():
            if name in _GLOBAL_NAMES:
                self._names[_GLOBAL_NAMES[name]] = (name, None)
                continue
            m = _BLOCK.fullmatch(name)
            if not m:
                if name != "rope_freqs.weight":     # read into the config above
                    self.unmapped.append(name)
                continue
            layer, rest = f"model.layers.{m.group(1)}", m.group(2)
            if rest in _LAYER_NAMES:
                self._names[f"{layer}.{_LAYER_NAMES[rest]}"] = (name, None)
            elif rest == "ffn_gate_inp.weight":
                self._names[f"{layer}.{moe_prefix}.gate.weight"] = (name, None)
            elif rest in _EXPERT_STACKS:
                n_experts = int(t.shape[-1])  # ggml order: [in, out, experts]
                for e in range(n_experts):
                    self._names[f"{layer}.{moe_prefix}.experts.{e}.{proj[_EXPERT_STACKS[rest]]}.weight"] = (name, e)
            else:
                self.unmapped.append(name)

    def names(self) -> Iterable[str]:
        """Every tensor, by Hugging Face name."""
        return self._names.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in Hugging Face (row-major [out, in]) order."""
        gname, expert = self._names[name]
        shape = tuple(int(d) for d in reversed(self._tensors[gname].shape))
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])
        return shape[1:] if expert is not None else shape

    def location(self, name: str) -> str:
        """The file (and GGUF tensor) holding a tensor."""
        gname = self._names.get(name, (name, None))[0]
        return f"{self.path} ({gname})"

    def _dequantized(self, gname: str, keep: bool) -> np.ndarray:
        """The GGUF tensor as float32; expert stacks are kept so each expert is a view of one array."""
        if gname not in self._cache:
            t = self._tensors[gname]
            try:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelFormatError(
                    f"{self.path}: tensor {gname} is {t.tensor_type.name}, which the gguf package cannot dequantize; "
                    "use a GGUF with another quantization (Q4_0, Q4_K_M, Q8_0, F16 ...)"
                ) from None
            data = np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
            if t.tensor_type != gguf.GGMLQuantizationType.F32:   # a copy: the stored bytes leave this process's RSS
                release_range(np_map(self.reader.data), None, int(t.data_offset), int(t.n_bytes))
            if not keep:
                return data
            self._cache[gname] = data
        return self._cache[gname]

    def _native(self, name: str, gname: str) -> bool:
        """Whether `name` loads as a QuantizedTensor: a matrix a model multiplies by, in a native block format."""
        t = self._tensors[gname]
        return (self.quantized and t.tensor_type in _NATIVE and len(t.shape) >= 2
                and not name.endswith((".gate.weight", "shared_expert_gate.weight")))   # routers stay float32

    def _quantized(self, gname: str, keep: bool) -> QuantizedTensor:
        """The GGUF tensor as one QuantizedTensor [rows, in] (an expert stack's rows laid end to end)."""
        if gname not in self._cache:
            t = self._tensors[gname]
            shape = [int(d) for d in t.shape]                                    # ggml order: [in, out, ...]
            q = native_blocks(t.data, t.tensor_type, int(np.prod(shape[1:])), shape[0])
            if not keep:
                return q
            self._cache[gname] = q
        return self._cache[gname]

    def load(self, name: str) -> np.ndarray | QuantizedTensor:
        """A tensor in Hugging Face layout: float32, dequantized, or (see `quantized`) a QuantizedTensor."""
        gname, expert = self._names[name]
        if self._native(name, gname):
            q = self._quantized(gname, keep=expert is not None)
            if expert is not None:
                rows = self.shape(name)[0]
                return _rows(q, slice(expert * rows, (expert + 1) * rows))
            if self._arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                heads = self.config["num_attention_heads"] if ".q_proj." in name else self.config["num_key_value_heads"]
                q = _rows(q, unpermute_qk(np.arange(q.shape[0]), heads))
            return q
        data = self._dequantized(gname, keep=expert is not None)
        if expert is not None:
            return data[expert]
        if self._arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = self.config["num_attention_heads"] if ".q_proj." in name else self.config["num_key_value_heads"]
            data = unpermute_qk(data, heads)
        if name.endswith("shared_expert_gate.weight"):
            data = data.reshape(1, -1)
        return data

    def release(self) -> None:
        """Drop dequantized stacks kept for expert slicing (the model holds its own references)."""
        self._cache.clear()

    def drop_pages(self, name: str) -> None:
        """Give back a tensor read once: its mapped pages, and for an expert, once every expert of its stack has
        been dropped, the stack kept for slicing and the stack's pages."""
        gname, expert = self._names[name]
        if expert is not None:
            left = self._stack_left.setdefault(gname, set(range(int(self._tensors[gname].shape[-1]))))
            left.discard(expert)
            if left:
                return
            del self._stack_left[gname]
            self._cache.pop(gname, None)
        release_tensor_pages(self.reader, self._tensors[gname])
