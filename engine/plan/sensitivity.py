"""Sensitivity: each matrix's quantization error put in one unit, the model's output KL.

The planner's error for a matrix, E||dW x||^2, is in the units of that matrix's output: logits
for the output head, hidden-state units for a matrix inside the network, whose error the later
layers amplify or damp. Handing out bytes by error removed per byte needs one unit, so this module
measures it: quantize one matrix at a probe width, run calibration tokens, and take the KL
divergence of the next-token distribution from the unquantized model's. Its scale is KL / error:
the planner then compares scale * error, an estimate of the KL each choice adds.

One measurement per matrix of each decoder layer (routed experts of one layer and kind together)
and per matrix outside the layers: linear in depth. Each runs only from the matrix's own layer on,
from the reference's stored hidden states; the measurements of one layer run the layers after it
together, as one batch of rows (small matrices multiply far faster many rows at a time). Fitting a
layer factor times a kind factor from far fewer measurements (n_layers + n_kinds groups) was tried
and misjudged single matrices by up to 45x (layer 0's v_proj), so every matrix is measured.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from engine.blocks.ffn import MoE
from engine.kv import KVCache
from engine.models.transformer import Transformer
from engine.spec import ModelSpec
from engine.weights import TensorSource

PROBE_BITS = 3                 # the width a matrix is quantized to while its KL is measured
PROBE_TOKENS = 256             # calibration tokens each measurement runs
PIECE_TOKENS = 128             # ... taken in pieces this long from across the calibration text
REFERENCE_BYTES = 256 << 20    # at most this much of stored reference probabilities
KL_FLOOR = 1e-9                # nats: a matrix whose KL rounds to zero still gets a (tiny) scale

# name -> (the matrix quantized at the probe format and dequantized [out, in] float32, its weighted error)
Probe = Callable[[str], tuple[np.ndarray, float]]
Log = Callable[[str], None]


@dataclass(frozen=True)
class GroupKL:
    """One measurement: a matrix (or one layer's routed experts of one kind) at the probe format, and its KL."""

    label: str                  # "model.layers.3.mlp.down_proj.weight", "model.layers.3.mlp.experts.*.w1"
    members: tuple[str, ...]
    kl: float                   # mean KL(reference || probed) per token, nats
    error: float                # the members' weighted errors at the probe format, summed

    @property
    def scale(self) -> float:
        """KL per unit of weighted error."""
        return max(self.kl, KL_FLOOR) / self.error if self.error > 0 else 0.0


@dataclass(frozen=True)
class Sensitivity:
    """Per matrix, the output KL per unit of its weighted error; and the measurements behind it."""

    scales: dict[str, float]
    groups: tuple[GroupKL, ...]
    tokens: int                 # calibration tokens each measurement ran

    def to_json(self) -> dict:
        """The manifest form (each group's KL; the scales are in the plan's tensors)."""
        return {"tokens": self.tokens, "probe_bits": PROBE_BITS,
                "kl": {g.label: round(g.kl, 7) for g in self.groups}}


def time_left(elapsed: float, done: float, total: float) -> str:
    """", about N s left" for a job DONE of TOTAL units into it after ELAPSED seconds ("" at its end or start)."""
    if done <= 0 or done >= total:
        return ""
    left = elapsed * (total - done) / done
    return f", about {left / 60:.0f} min left" if left >= 120 else f", about {left:.0f} s left"


def layer_and_kind(name: str) -> tuple[int | None, str]:
    """(decoder layer, kind) of a tensor name: 'model.layers.3.mlp.experts.7.w1.weight' -> (3, 'mlp.experts.*.w1')."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(?:\.weight)?", name)
    if m is None:
        return None, name
    return int(m.group(1)), re.sub(r"\.experts\.\d+\.", ".experts.*.", m.group(2))


def probe_groups(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """label -> members of every measurement: each matrix, with one layer's routed experts of a kind together."""
    groups: dict[str, list[str]] = {}
    for n in names:
        layer, kind = layer_and_kind(n)
        label = n if layer is None or ".experts.*." not in kind else f"model.layers.{layer}.{kind}"
        groups.setdefault(label, []).append(n)
    return {label: tuple(members) for label, members in groups.items()}


def first_layer(name: str, spec: ModelSpec) -> int:
    """The first decoder layer whose input changes when `name` changes (n_layers: only the output head)."""
    layer, _ = layer_and_kind(name)
    if layer is not None:
        return layer
    return spec.n_layers if name == "lm_head.weight" else 0


class Resident:
    """A tensor source read once into float32 memory (a GGUF source dequantizes on every load)."""

    def __init__(self, source: TensorSource):
        self.source, self.path = source, source.path
        self._cache: dict[str, np.ndarray] = {}

    def names(self) -> Iterable[str]:
        """The source's tensor names."""
        return self.source.names()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return self.source.shape(name)

    def location(self, name: str) -> str:
        """Where the tensor lives, for messages."""
        return self.source.location(name)

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32, read on first use."""
        if name not in self._cache:
            self._cache[name] = np.asarray(self.source.load(name), dtype=np.float32)
        return self._cache[name]


class Overlay:
    """A tensor source with some tensors replaced (the probe-quantized ones)."""

    def __init__(self, base: TensorSource, replaced: Mapping[str, np.ndarray]):
        self.base, self.replaced, self.path = base, replaced, base.path

    def names(self) -> Iterable[str]:
        """The base's tensor names."""
        return self.base.names()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return self.base.shape(name)

    def location(self, name: str) -> str:
        """Where the tensor lives, for messages."""
        return self.base.location(name)

    def load(self, name: str) -> np.ndarray:
        """The replacement if there is one, else the base's tensor."""
        return self.replaced[name] if name in self.replaced else self.base.load(name)


def pick_tokens(sequences: Sequence[Sequence[int]], n_tokens: int, piece: int = PIECE_TOKENS) -> list[list[int]]:
    """About n_tokens in pieces of up to `piece` tokens, spread evenly over the calibration text (every topic)."""
    pieces = [list(s[i : i + piece]) for s in sequences for i in range(0, len(s), piece)]
    pieces = [p for p in pieces if len(p) >= 2]
    total = sum(len(p) for p in pieces)
    if total <= n_tokens:
        return pieces
    wanted = min(len(pieces), math.ceil(n_tokens * len(pieces) / total))
    out, have = [], 0
    for i in np.unique(np.linspace(0, len(pieces) - 1, wanted).round().astype(int)):
        take = pieces[i][: n_tokens - have]
        if len(take) >= 2:
            out.append(take)
            have += len(take)
    return out


def forward_from(model: Transformer, x: np.ndarray, start: int, keep: list[np.ndarray] | None = None) -> np.ndarray:
    """Logits [T, V] of a whole sequence whose hidden state x [T, hidden] enters layer `start` (fresh cache).

    The steps of Transformer.forward, resumable at any layer (the layers before `start` are not
    run); `keep` collects each layer's input and the final hidden state (n_layers + 1 arrays).
    """
    return model.head(run_from(model, x, [x.shape[0]], start, keep=keep))


def run_from(model: Transformer, x: np.ndarray, lengths: Sequence[int], start: int, stop: int | None = None,
             keep: list[np.ndarray] | None = None) -> np.ndarray:
    """The hidden states [R, hidden] after layers start .. stop - 1 of sequences stacked in x [R, hidden].

    Each sequence (`lengths`: its rows, in order) starts at position 0 on a fresh cache; the
    projections run once for all rows, attention per sequence. `keep` collects each layer's input
    and the last output.
    """
    eps, residual = model.spec.rms_eps, np.float32(model.spec.residual_multiplier)   # Granite scales block outputs
    stop = model.spec.n_layers if stop is None else stop
    caches = [KVCache(model.spec, n) for n in lengths]
    positions = np.concatenate([c.positions(n) for c, n in zip(caches, lengths)])     # [R]
    bounds = np.cumsum([0, *lengths])
    rows = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    for i in range(start, stop):
        if keep is not None:
            keep.append(x)
        layer = model.layers[i]
        segments = [(r, c.layers[i]) for r, c in zip(rows, caches)]
        x = x + residual * layer.attn_output(layer.attn(layer.attn_input(x, eps), positions, segments), eps)
        h = layer.ffn_input(x, eps)
        x = x + residual * layer.ffn_output(
            layer.ffn(h, model.experts)[0] if isinstance(layer.ffn, MoE) else layer.ffn(h), eps)
    if keep is not None:
        keep.append(x)
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities [T, V] (float32) of logits [T, V]."""
    x = logits - logits.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


@dataclass(frozen=True)
class Reference:
    """The unquantized model over the probe tokens: next-token distributions and hidden states."""

    seqs: list[list[int]]
    probs: list[np.ndarray]          # [T, V] float32 per sequence
    hidden: list[list[np.ndarray]]   # per sequence, each layer's input [T, hidden] and the final state
    neg_entropy: float               # sum over tokens of sum_v p log p

    @classmethod
    def measure(cls, model: Transformer, seqs: list[list[int]]) -> "Reference":
        """Run the unquantized model over seqs."""
        probs, hidden, neg_entropy = [], [], 0.0
        for s in seqs:
            keep: list[np.ndarray] = []
            lp = log_softmax(forward_from(model, model.embed_tokens(np.asarray(s)), 0, keep=keep))
            p = np.exp(lp)
            neg_entropy += float(np.einsum("tv,tv->", p, lp, dtype=np.float64))
            probs.append(p)
            hidden.append(keep)
        return cls(seqs, probs, hidden, neg_entropy)

    def kl(self, model: Transformer, start: int = 0) -> float:
        """Mean KL(reference || model) per token, nats; the model's layers before `start` must be the reference's."""
        cross = 0.0
        for s, p, hid in zip(self.seqs, self.probs, self.hidden):
            x = model.embed_tokens(np.asarray(s)) if start == 0 else hid[start]
            cross += float(np.einsum("tv,tv->", p, log_softmax(forward_from(model, x, start)), dtype=np.float64))
        return (self.neg_entropy - cross) / sum(len(s) for s in self.seqs)

    def kl_stacked(self, model: Transformer, variants: Sequence[Transformer], layer: int) -> list[float]:
        """`kl` of each variant, whose weights differ from `model`'s in decoder layer `layer` only.

        Each variant runs that layer; the layers after it run once for all variants' rows (one larger
        product per matrix instead of one per variant), then the head per sequence.
        """
        lengths = [len(s) for s in self.seqs]
        x = np.concatenate([h[layer] for h in self.hidden])                                  # [T, hidden]
        x = np.concatenate([run_from(v, x, lengths, layer, layer + 1) for v in variants])   # [n * T, hidden]
        x = run_from(model, x, lengths * len(variants), layer + 1)
        cross = np.zeros(len(variants))
        bounds = np.cumsum([0, *lengths * len(variants)])
        for k in range(len(bounds) - 1):
            v, s = divmod(k, len(lengths))
            lp = log_softmax(model.head(x[bounds[k] : bounds[k + 1]]))                       # [T_s, V]
            cross[v] += float(np.einsum("tv,tv->", self.probs[s], lp, dtype=np.float64))
        return [float(c) for c in (self.neg_entropy - cross) / sum(lengths)]


def measure_sensitivity(spec: ModelSpec, source: TensorSource, names: Sequence[str], probe: Probe,
                        sequences: Sequence[Sequence[int]], log: Log = print,
                        n_tokens: int = PROBE_TOKENS) -> Sensitivity:
    """Quantize each matrix of `names` alone at the probe format, measure the output KL on calibration tokens."""
    seqs = pick_tokens(sequences, min(n_tokens, max(2, REFERENCE_BYTES // (4 * spec.vocab_size))))
    tokens = sum(len(s) for s in seqs)
    t0 = time.perf_counter()
    base = Transformer(spec, source)
    reference = Reference.measure(base, seqs)
    plan = probe_groups(names)
    log(f"sensitivity: {len(plan)} matrices quantized to {PROBE_BITS} bits each alone, KL on {tokens} tokens ...")
    measured, scales = [], {}
    # a measurement runs the layers from its own on and the head: its share of the pass's time
    layer_weights = [0] * (spec.n_layers + 1)
    for n in names:
        layer_weights[min(first_layer(n, spec), spec.n_layers)] += int(np.prod(source.shape(n)))
    after = np.cumsum(layer_weights[::-1])[::-1]           # [n_layers + 1]: weights run from layer i on
    work = {label: int(after[min(first_layer(n, spec) for n in members)]) for label, members in plan.items()}
    total = sum(work.values())
    # the groups inside one decoder layer are measured together (kl_stacked); the others (the embedding, tied to
    # the head, and the head) one at a time
    batches: dict[int | str, list[str]] = {}
    for label, members in plan.items():
        layers = {layer_and_kind(n)[0] for n in members}
        key = layers.pop() if len(layers) == 1 and None not in layers else label
        batches.setdefault(key, []).append(label)
    kls: dict[str, float] = {}
    errors: dict[str, float] = {}
    done = 0
    for key, labels in batches.items():
        variants = []
        for label in labels:
            replaced = {}
            errors[label] = 0.0
            for n in plan[label]:
                replaced[n], e = probe(n)
                errors[label] += e
            variants.append(Transformer(spec, Overlay(source, replaced)))
        if isinstance(key, int):
            kls.update(zip(labels, reference.kl_stacked(base, variants, key)))
        else:
            kls[key] = reference.kl(variants[0], min(first_layer(n, spec) for n in plan[key]))
        done += sum(work[label] for label in labels)
        if len(kls) // 25 > (len(kls) - len(labels)) // 25 or len(kls) == len(plan):
            elapsed = time.perf_counter() - t0
            log(f"sensitivity: measured {len(kls)}/{len(plan)} ({elapsed:.0f} s{time_left(elapsed, done, total)})")
    for label, members in plan.items():
        g = GroupKL(label, members, kls[label], errors[label])
        measured.append(g)
        scales.update(dict.fromkeys(members, g.scale))
    return Sensitivity(scales, tuple(measured), tokens)
