"""A memory budget divided: resident weights, the expert cache (or layer buffers), KV cache, working buffers.

The budget covers what the model needs; the interpreter's and libraries' own footprint, measured
before the model loads, is reported apart (peak RSS stays within budget + baseline). Asking for
less than the resident part needs fails with the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ColibriError
from engine.formats.container import Container
from engine.generation.prefill import PREFILL_CHUNK
from engine.kv import BLOCK_SIZE
from engine.offload.io import PAGE, round_up
from engine.spec import GatedDeltaNetSpec, MLASpec, ModelSpec, MoESpec


def window_positions(window: int, ctx: int, block_size: int = BLOCK_SIZE, chunk: int = PREFILL_CHUNK) -> int:
    """Positions a sliding-window layer's rows take in engine.kv at most, for a context of `ctx` tokens.

    During a step of up to `chunk` tokens from position L the layer keeps the blocks from the one holding
    L - window + 1 (its first query's reach) to the one holding the step's last position: at worst
    window + chunk - 1 positions, plus up to block_size - 1 before them in the first block, in whole blocks."""
    step = min(chunk, ctx)
    blocks = -(-(window + step + block_size - 2) // block_size)
    return min(ctx, blocks * block_size)


def kv_bytes(spec: ModelSpec, ctx: int, bits: int = 32, block_size: int = BLOCK_SIZE,
             chunk: int = PREFILL_CHUNK) -> int:
    """KV cache bytes for `ctx` tokens as engine.kv stores them: float32, fp16 or int8 rows, each with a
    float32 scale (MLA caches its compressed latent and rotary key, and a sparse-attention indexer's key). A
    sliding-window layer holds only its window, the step being run (`chunk` tokens at most) and the block
    rounding of both (`window_positions`). A recurrent layer adds one sequence's float32 state, twice (held,
    and the next step's)."""
    size = bits // 8
    per_token = state = windowed = 0
    for layer in spec.layers:
        a = layer.attn
        if isinstance(a, GatedDeltaNetSpec):
            state += 2 * 4 * sum(int(np.prod(shape)) for shape in a.state_shapes)
        elif isinstance(a, MLASpec):
            per_token += (a.kv_lora_rank + a.qk_rope_dim) * size + 8
            if a.indexer is not None and not a.indexer.shared:   # the sparse-attention indexer's key, and its scale
                per_token += a.indexer.head_dim * size + 4
        elif a.sliding_window:
            windowed += 2 * a.n_kv_heads * (a.head_dim * size + 4) * window_positions(a.sliding_window, ctx,
                                                                                      block_size, chunk)
        else:
            per_token += 2 * a.n_kv_heads * (a.head_dim * size + 4)
    return per_token * ctx + windowed + state


def working_bytes(spec: ModelSpec, ctx: int) -> int:
    """The largest buffers a prefill chunk makes: attention scores, logits, activations."""
    chunk = min(PREFILL_CHUNK, ctx)
    heads = max((layer.attn.n_heads for layer in spec.layers if not isinstance(layer.attn, GatedDeltaNetSpec)),
                default=0)
    scores = heads * chunk * ctx * 4 * 2                      # scores and probabilities
    logits = chunk * spec.vocab_size * 4
    widest = max(getattr(layer.ffn, "intermediate", 0) or getattr(layer.ffn, "expert_ffn", 0) * 2
                 for layer in spec.layers)
    top_k = max((layer.ffn.top_k for layer in spec.layers if isinstance(layer.ffn, MoESpec)), default=1)
    activations = chunk * top_k * max(widest, spec.hidden_size) * 4 * 4
    return scores + logits + activations


def format_bytes(n: float) -> str:
    """Bytes as a short decimal size (the units `--max-memory` reads)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryPlan:
    """How a budget divides for one model."""

    total: int
    resident: int             # weights that stay in memory (dense part; for dense models also held layers)
    kv: int
    working: int
    streamed: int             # bytes of the streamed weights (all experts, or the streamed layers)
    cache: int                # memory for streamed weights: expert cache, or layer buffers
    ctx: int
    resident_layers: int | None = None   # dense models: layers held

    @property
    def minimum(self) -> int:
        """The least budget this model and context can run in."""
        return self.resident + self.kv + self.working + self.cache_minimum

    cache_minimum: int = 0

    def describe(self) -> str:
        """The division, for the user."""
        what = "expert cache" if self.resident_layers is None else f"layer buffers ({self.resident_layers} layers held)"
        return (f"{format_bytes(self.total)}: resident weights {format_bytes(self.resident)}, {what} "
                f"{format_bytes(self.cache)} of {format_bytes(self.streamed)} streamed, KV cache for {self.ctx} tokens "
                f"{format_bytes(self.kv)}, working buffers {format_bytes(self.working)}")


def _stored_bytes(container: Container, names) -> int:
    """Bytes the tensors take once loaded (f16/bf16 are widened to float32)."""
    total = 0
    for n in names:
        e = container.entries[n]
        total += e.length * 2 if e.kind in ("f16", "bf16") else e.length
    return total


def plan_memory(container: Container, spec: ModelSpec, total: int, ctx: int, prefetch_depth: int = 1,
                resident_layers: int | None = None, kv_bits: int = 32) -> MemoryPlan:
    """Divide `total` bytes for this container; ColibriError with the minimum when it cannot run."""
    if ctx < 1 or ctx > spec.max_position:
        raise ColibriError(f"--ctx {ctx}: the model supports 1 to {spec.max_position} tokens")
    kv, work = kv_bytes(spec, ctx, kv_bits), working_bytes(spec, ctx)
    expert_files = container.expert_files
    if any(isinstance(layer.ffn, MoESpec) for layer in spec.layers):
        dense = [n for n, e in container.entries.items() if e.file not in expert_files]
        resident = _stored_bytes(container, dense)
        lengths = [x.length for x in container.extents.values()]
        slot = round_up(max(lengths), PAGE)
        top_k = max(layer.ffn.top_k for layer in spec.layers if isinstance(layer.ffn, MoESpec))
        streamed = sum(lengths)
        cache_min = top_k * slot
        cache = min(total - resident - kv - work, len(lengths) * slot)
        plan = MemoryPlan(total, resident, kv, work, streamed, max(cache, 0), ctx, None, cache_min)
        if cache < cache_min:
            raise ColibriError(f"--max-memory {format_bytes(total)} is too small for this model: it needs at least "
                               f"{format_bytes(plan.minimum)} (resident weights {format_bytes(resident)}, KV cache for "
                               f"{ctx} tokens {format_bytes(kv)}, working buffers {format_bytes(work)}, {top_k} experts "
                               f"{format_bytes(cache_min)}); raise --max-memory or lower --ctx")
        return plan
    per_layer = []
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        per_layer.append(_stored_bytes(container, [n for n in container.entries if n.startswith(p)]))
    other = _stored_bytes(container, [n for n in container.entries if not n.startswith("model.layers.")])
    from engine.offload.layers import slot_bytes

    n_layers = spec.n_layers

    def buffers_for(n: int) -> int:
        """Layer buffers when the first n layers are held: min(D + 1, streamed) slots of the largest streamed layer."""
        return min(prefetch_depth + 1, n_layers - n) * slot_bytes(container, range(n, n_layers)) if n < n_layers else 0

    buffers = buffers_for(0)
    if resident_layers is None:
        room = total - other - kv - work
        n = 0
        while n < n_layers and sum(per_layer[: n + 1]) + buffers_for(n + 1) <= room:
            n += 1
        resident_layers = n
    if not 0 <= resident_layers <= n_layers:
        raise ColibriError(f"--resident-layers {resident_layers}: use 0 to {n_layers}")
    held = sum(per_layer[:resident_layers])
    cache = buffers_for(resident_layers)
    plan = MemoryPlan(total, other + held, kv, work, sum(per_layer[resident_layers:]), cache, ctx, resident_layers)
    if plan.resident + kv + work + cache > total:
        least = MemoryPlan(total, other, kv, work, 0, buffers, ctx, 0)
        raise ColibriError(f"--max-memory {format_bytes(total)} is too small for this model with {resident_layers} layers "
                           f"held: it needs at least {format_bytes(least.resident + kv + work + buffers)} (embedding and "
                           f"head {format_bytes(other)}, {prefetch_depth + 1} layer buffers {format_bytes(buffers)}, KV "
                           f"cache {format_bytes(kv)}, working buffers {format_bytes(work)}); raise --max-memory, lower "
                           "--ctx, --prefetch-depth or --resident-layers")
    return plan
