"""Feed-forward blocks: the gated MLP, and the Mixture-of-Experts block with its router.

The MoE block never holds routed experts itself: it asks an `ExpertSource` for the distinct
experts a step needs (one request per layer step, the "Union" of the design), so that later
sources can stream them from disk. Each call reports its routing (which experts, which weights,
per token) so that the rest of the engine can cache, prefetch and display experts. Experts with
biases or gpt-oss's clamped SwiGLU run through `biased_expert`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from engine.blocks.linear import Probe, is_block_quantized, linear, linear_many
from engine.blocks.norm import activation, silu
from engine.kernels.experts import expert_outputs, weighted_sum
from engine.kernels.fp32 import matmul_f32
from engine.kernels.rows import SIGMOID, SOFTMAX, route_rows, silu_product
from engine.spec import MLPSpec, MoESpec
from engine.telemetry import NULL, Telemetry
from engine.weights import Weights


def mlp_shapes(prefix: str, hidden: int, intermediate: int,
               names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"), bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Tensors of one gated MLP (gate, up, down, and their biases when `bias`) with their shapes."""
    gate, up, down = names
    shapes = {
        f"{prefix}.{gate}.weight": (intermediate, hidden),
        f"{prefix}.{up}.weight": (intermediate, hidden),
        f"{prefix}.{down}.weight": (hidden, intermediate),
    }
    if bias:
        shapes |= {f"{prefix}.{gate}.bias": (intermediate,), f"{prefix}.{up}.bias": (intermediate,),
                   f"{prefix}.{down}.bias": (hidden,)}
    return shapes


@dataclass(frozen=True)
class ExpertWeights:
    """One gated MLP's matrices (also the unit a routed expert is stored, cached and read in)."""

    gate: np.ndarray  # [I, hidden]  (float32, or a quantized tensor of that shape)
    up: np.ndarray    # [I, hidden]
    down: np.ndarray  # [hidden, I]
    names: tuple[str, str, str] = ("", "", "")  # tensor names of gate, up, down (for probes)
    gate_bias: np.ndarray | None = None   # [I]: dense and shared MLPs of families with biases (ERNIE 4.5)
    up_bias: np.ndarray | None = None     # [I]
    down_bias: np.ndarray | None = None   # [hidden]

    @classmethod
    def load(cls, w: Weights, prefix: str, names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
             bias: bool = False) -> "ExpertWeights":
        """Take gate, up and down of the MLP at `prefix` (and their biases when `bias`)."""
        full = tuple(f"{prefix}.{n}.weight" for n in names)
        if not bias:
            return cls(w[full[0]], w[full[1]], w[full[2]], full)
        b = [w[f"{prefix}.{n}.bias"] for n in names]
        return cls(w[full[0]], w[full[1]], w[full[2]], full, b[0], b[1], b[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the three matrices (and their biases)."""
        biases = sum(b.nbytes for b in (self.gate_bias, self.up_bias, self.down_bias) if b is not None)
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + biases


def expert_bias_shapes(prefix: str, hidden: int, intermediate: int,
                       names: Sequence[str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, tuple[int, ...]]:
    """The biases of one expert's gate, up and down (gpt-oss), with their shapes."""
    gate, up, down = names
    return {f"{prefix}.{gate}.bias": (intermediate,), f"{prefix}.{up}.bias": (intermediate,),
            f"{prefix}.{down}.bias": (hidden,)}


@dataclass(frozen=True)
class ExpertBiases:
    """A layer's routed experts' biases, held resident beside the router (2 I + hidden floats an expert)."""

    gate: np.ndarray  # [E, I]
    up: np.ndarray    # [E, I]
    down: np.ndarray  # [E, hidden]

    @classmethod
    def load(cls, w: Weights, prefixes: Sequence[str], names: Sequence[str]) -> "ExpertBiases":
        """Stack the biases of the experts whose tensor prefixes are `prefixes`, in order."""
        return cls(*(np.stack([w.dense(f"{p}.{n}.bias") for p in prefixes]).astype(np.float32) for n in names))


def clamped_swiglu(g: np.ndarray, u: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's activation: (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    lim = np.float32(limit)
    g = np.minimum(g, lim)
    u = np.clip(u, -lim, lim)
    with np.errstate(over="ignore"):
        glu = g / (np.float32(1.0) + np.exp(-np.float32(alpha) * g))
    return ((u + np.float32(1.0)) * glu).astype(np.float32)


def biased_expert(x: np.ndarray, e: ExpertWeights, spec: MoESpec, bias: "ExpertBiases | None", expert: int,
                  probe: Probe | None = None) -> np.ndarray:
    """One routed expert with biases and/or the clamped SwiGLU (gpt-oss): x [T, hidden] -> [T, hidden]."""
    g, u = linear_many(x, (e.gate, e.up))                                     # [T, I] each
    if bias is not None:
        g, u = g + bias.gate[expert], u + bias.up[expert]
    if spec.swiglu_limit is not None:
        h = clamped_swiglu(g, u, spec.swiglu_limit, spec.swiglu_alpha)
    else:
        act = activation(spec.act)
        h = silu_product(g, u) if act is silu else act(g) * u
    if probe is not None:
        probe(e.names[0], x)
        probe(e.names[1], x)
        probe(e.names[2], h)
    out = linear(h, e.down)
    return out + bias.down[expert] if bias is not None else out


def gated_mlp(x: np.ndarray, e: ExpertWeights, act, probe: Probe | None = None) -> np.ndarray:
    """down(act(gate(x)) * up(x)) for x [T, hidden] -> [T, hidden] (each projection adding its bias, if any)."""
    g, u = linear_many(x, (e.gate, e.up))                                     # [T, I] each
    if e.gate_bias is not None:
        g, u = g + e.gate_bias, u + e.up_bias
    h = silu_product(g, u) if act is silu else act(g) * u
    if probe is not None:
        probe(e.names[0], x)
        probe(e.names[1], x)
        probe(e.names[2], h)
    out = linear(h, e.down)                                                   # [T, hidden]
    return out + e.down_bias if e.down_bias is not None else out


@dataclass(frozen=True)
class MLP:
    """A dense feed-forward block."""

    spec: MLPSpec
    weights: ExpertWeights

    def __call__(self, x: np.ndarray, probe: Probe | None = None) -> np.ndarray:
        """x [T, hidden] -> [T, hidden]."""
        return gated_mlp(x, self.weights, activation(self.spec.act), probe)


@runtime_checkable
class ExpertSource(Protocol):
    """Where the MoE block gets routed experts from: resident, or read from disk by engine.offload.ExpertStore."""

    def experts(self, layer: int, ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        """The weights of the given experts of one layer."""

    def groups(self, layer: int, ids: Sequence[int]) -> Iterator[Mapping[int, ExpertWeights]]:
        """The same experts in groups as they become available (each stays valid until the next is asked for)."""


@dataclass(frozen=True)
class StoreHooks:
    """What a running fused call's driver (engine/fused/driver.py) attaches to a streaming store with
    `StreamingExpertSource.attach`: every callback is optional, and the store calls only those given."""

    # on a reader thread, as a read completes that could not be handed over (`on_arrival`): wakes the driver
    on_read: Callable[[], None] | None = None
    # on a reader thread, an expert read into a slot whose tensors are laid out, before the store takes it in:
    # a call waiting for it goes on without the driver waking
    on_arrival: Callable[[tuple[int, int], ExpertWeights], None] | None = None
    # while a call runs: whether an expert may give up its slot now (False: the call may be reading it)
    guard: Callable[[tuple[int, int]], bool] | None = None
    # the store closes
    on_close: Callable[[], None] | None = None


NO_HOOKS = StoreHooks()


@runtime_checkable
class StreamingExpertSource(ExpertSource, Protocol):
    """An expert source that holds only some experts in memory and reads the others from disk: it takes guesses
    of what comes next, learns from each token, and can feed a fused step while it runs."""

    def prefetch(self, layer: int, ids: Sequence[int], read: bool = True) -> None:
        """A guess of the experts a coming layer step will ask for (read ahead when `read`, else only scored)."""

    def need(self, layer: int, ids: Sequence[int], meanwhile: Callable[[], None] = ...) -> bool:
        """Start reading the given experts a running step waits for; False when they cannot all be held."""

    def collect(self) -> None:
        """Take in the reads that completed, on the thread that owns the store."""

    def add_listener(self, fn: Callable[[tuple[int, int], ExpertWeights | None], None]) -> bool:
        """Call `fn(key, weights)` when an expert comes into memory (None: when it leaves); False if refused."""

    def end_token(self, n: int = 1) -> None:
        """The end of n tokens: the usage history and placement learn from them."""

    def set_capacity(self, capacity: int) -> None:
        """A new byte budget for the experts held in memory, applied between two tokens."""

    def batch_rows(self, most: int) -> int:
        """How many sequences (1 .. most) may decode together without their steps reading over each other's
        experts in the cache."""

    def set_io_threads(self, threads: int) -> None:
        """A new number of reader threads."""

    def learn_policy(self) -> float | None:
        """Fit the replacement policy to the session's usage before it is saved; its new half-life, if any."""

    def attach(self, hooks: StoreHooks | None) -> None:
        """Give the store a running fused call's callbacks (None: the call's driver is gone)."""

    def close(self) -> None:
        """Stop the readers and release the memory; idempotent."""


class ResidentExperts:
    """Every routed expert held in memory (as views of the checkpoint where possible)."""

    def __init__(self, per_layer: Mapping[int, Sequence[ExpertWeights]]):
        self.per_layer = {layer: list(experts) for layer, experts in per_layer.items()}

    def experts(self, layer: int, ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        """The weights of the given experts of one layer."""
        held = self.per_layer[layer]
        return {i: held[i] for i in ids}

    def groups(self, layer: int, ids: Sequence[int]) -> Iterator[Mapping[int, ExpertWeights]]:
        """All of them at once."""
        yield self.experts(layer, ids)


@dataclass(frozen=True)
class Routing:
    """Which experts each token of a step went to in one layer, and with what weights."""

    layer: int
    experts: np.ndarray  # [T, K] int64
    weights: np.ndarray  # [T, K] float32


def route(spec: MoESpec, logits: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Choose top-k experts per token from router logits [T, E] -> (ids [T, K], weights [T, K]).

    Without expert groups, one compiled row at a time (engine.kernels.rows.route_row: the fused
    decode step routes with the same function); with groups (DeepSeek), each group ranked by
    `spec.group_score`, or a floor under the renormalisation's divisor (ERNIE 4.5's norm_min), in numpy;
    PhiMoE's sparse mixer in `sparsemixer`.
    """
    if spec.scoring == "sparsemixer":
        return sparsemixer(logits, spec.top_k, spec.jitter_eps)
    if spec.n_group == 1 and spec.scoring in ("softmax", "sigmoid") and not spec.norm_min:
        scoring = SOFTMAX if spec.scoring == "softmax" else SIGMOID
        return route_rows(logits, spec.top_k, scoring, bias, spec.norm_topk_prob, spec.routed_scaling_factor)
    t, e = logits.shape
    k = spec.top_k
    if spec.scoring == "sigmoid":
        scores = (1.0 / (1.0 + np.exp(-logits.astype(np.float32)))).astype(np.float32)
    else:
        shifted = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
        scores = np.exp(shifted)
        scores /= scores.sum(axis=-1, keepdims=True)
    choice = scores + bias if bias is not None else scores.copy()
    if spec.n_group > 1:
        # keep the topk_group groups that score highest (sum of their two best, or their best); mask the others
        grouped = choice.reshape(t, spec.n_group, e // spec.n_group)
        if spec.group_score == "max":
            group_scores = grouped.max(axis=-1)                                   # [T, G]
        else:
            group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)      # [T, G]
        keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, : spec.topk_group]
        group_mask = np.zeros((t, spec.n_group), bool)
        np.put_along_axis(group_mask, keep, True, axis=-1)
        choice = np.where(np.repeat(group_mask, e // spec.n_group, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]                      # [T, K] best first
    weights = np.take_along_axis(scores, ids, axis=-1)
    if spec.norm_topk_prob:
        denominator = weights.sum(axis=-1, keepdims=True)
        if spec.scoring == "sigmoid":
            denominator = denominator + np.float32(1e-20)
        if spec.norm_min:
            denominator = np.maximum(denominator, np.float32(spec.norm_min))
        weights = weights / denominator
    weights = (weights * np.float32(spec.routed_scaling_factor)).astype(np.float32)
    return ids.astype(np.int64), weights


def sparsemixer(logits: np.ndarray, top_k: int, jitter_eps: float) -> tuple[np.ndarray, np.ndarray]:
    """PhiMoE's sparse-mixer routing at inference, router logits [T, E] -> (ids [T, K], weights [T, K]).

    The best expert, weighted by its softmax over the experts whose logit is within a relative 2 * jitter_eps of
    it (the others masked out); then the second best the same way with the first masked out. The reference
    defines exactly two: slots past the second (only a read-ahead guess asks for more) take the next best
    logits with weight 0.
    """
    t, e = logits.shape
    scores = np.ascontiguousarray(logits, np.float32)                            # [T, E]
    rows = np.arange(t)
    ids = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k].astype(np.int64)   # ties to the lower id
    weights = np.zeros((t, top_k), np.float32)
    masked = scores.copy()
    threshold = np.float32(2 * jitter_eps)
    for slot in range(min(2, top_k)):
        best = masked[rows, ids[:, slot]][:, None]                               # [T, 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            far = (best - scores) / np.maximum(np.abs(scores), best) > threshold    # [T, E]
        gates = np.where(far, np.float32(-np.inf), masked)
        gates = np.exp(gates - best)                                             # best is the row's max
        weights[:, slot] = gates[rows, ids[:, slot]] / gates.sum(axis=-1)
        masked[rows, ids[:, slot]] = -np.inf                                     # the second excludes the first
    return ids, weights


@dataclass(frozen=True)
class MoE:
    """A routed Mixture-of-Experts block with optional (gated) shared experts.

    gpt-oss adds a router bias and per-expert biases: the biases are held here, resident, for every expert
    (2 I + hidden floats each, a small fraction of its matrices), so a streamed expert is its three
    matrices as for every family.
    """

    spec: MoESpec
    layer: int
    router: np.ndarray                       # [E, hidden]
    correction_bias: np.ndarray | None       # [E]
    shared: ExpertWeights | None
    shared_gate: np.ndarray | None           # [1, hidden]
    prefix: str = ""                         # tensor name prefix of the block
    router_bias: np.ndarray | None = None    # [E] added to the router logits (gpt-oss)
    expert_biases: ExpertBiases | None = None  # (gpt-oss)

    def router_logits(self, x: np.ndarray) -> np.ndarray:
        """The router's logits [T, E] of x [T, hidden]."""
        logits = matmul_f32(x, self.router)
        return logits + self.router_bias if self.router_bias is not None else logits

    def __call__(self, x: np.ndarray, source: ExpertSource, probe: Probe | None = None,
                 telemetry: Telemetry = NULL) -> tuple[np.ndarray, Routing]:
        """x [T, hidden] -> ([T, hidden], this step's routing).

        Each (token, slot) output is computed alone and the slots are summed in order afterwards, so the
        result does not depend on which experts were in memory first or how the source grouped them.
        """
        act = activation(self.spec.act)
        t, hidden = x.shape
        with telemetry.phase("dense"):
            if probe is not None:
                probe(f"{self.prefix}.gate.weight", x)
            ids, weights = route(self.spec, self.router_logits(x), self.correction_bias)   # [T, K] each
        k = ids.shape[1]
        flat = ids.reshape(-1)                                                         # [T*K] slot s = t*K + k
        needed = np.unique(ids)
        y = np.empty((t * k, hidden), np.float32)                                      # [T*K, hidden]
        with telemetry.phase("experts"):
            for group in source.groups(self.layer, [int(i) for i in needed]):
                slots = np.nonzero(np.isin(flat, np.fromiter(group, np.int64, len(group))))[0]
                self._outputs(x, ids, group, slots, y, act, probe)
            out = weighted_sum(y, weights, np.zeros((t, hidden), np.float32))
        if self.shared is not None:
            with telemetry.phase("dense"):
                shared = gated_mlp(x, self.shared, act, probe)
                if self.shared_gate is not None:
                    if probe is not None:
                        probe(f"{self.prefix}.shared_expert_gate.weight", x)
                    shared = shared * (1.0 / (1.0 + np.exp(-matmul_f32(x, self.shared_gate))))
                out += shared
        return out, Routing(self.layer, ids, weights)

    def _outputs(self, x, ids, experts, slots, y, act, probe) -> None:
        """y[s] for the given slots whose experts are in `experts`: one fused call, or one expert at a time."""
        first = next(iter(experts.values()))
        plain = self.expert_biases is None and self.spec.swiglu_limit is None
        quantized = all(is_block_quantized(w) for w in (first.gate, first.up, first.down))
        if probe is None and plain and self.spec.act == "silu" and quantized:
            expert_outputs(x, ids, experts, slots, y)
            return
        flat, k = ids.reshape(-1), ids.shape[1]
        if not plain:
            for expert_id, e in experts.items():
                mine = slots[flat[slots] == expert_id]
                if mine.size:
                    y[mine] = biased_expert(x[mine // k], e, self.spec, self.expert_biases, expert_id, probe)
            return
        for expert_id, e in experts.items():
            mine = slots[flat[slots] == expert_id]                   # slots routed here; a token picks it once
            if mine.size:
                y[mine] = gated_mlp(x[mine // k], e, act, probe)     # [n, hidden]
