"""Predicted prompt and decode speed of a planned model: a time per token with a term for each cost.

One decoded token at context position S costs

    token_s + L x layer_s              fixed: interpreter, dispatch, barriers, norms, routing, bookkeeping
                                       (and a recurrent layer's state update, the same at every S)
  + key_s x sum of keys(S)             attention over the KV cache: S + 1 keys per attention layer, or its
                                       window; a sparse-attention layer its top-k keys plus its indexer's
                                       scoring of all S + 1 (at that work's share of a key's); none for a
                                       recurrent (gated DeltaNet) layer
  + the quantized matvec kernels       when the engine runs the token as one fused parallel step
                                       (engine/fused/plan.py), the weights it reads at the rate of one
                                       large call; else each kernel call it makes (matrices sharing an
                                       input, e.g. q/k/v, a layer's top_k experts) as measured alone
  + float32 bytes / RAM bandwidth      routers, norms, float32 matrices

and a prompt chunk of T tokens after `start` tokens costs the same with chunk terms: chunk_s +
L x chunk_layer_s, pair_s per query-key pair, T x the weights over the matmul rate on a T-token
batch (routed experts: on the tokens one expert gets from the chunk), the head on the last token.

With experts streaming, the expert bytes a step misses are read at the measured disk bandwidth
while the layers compute (the engine reads as soon as routing is known or predicted one layer
ahead): the layers take max(compute, reads), not their sum. Which experts miss follows from the
cache holding the most used ones (what the learned policy aims at), with routing as measured on
calibration text when the weights are at hand, uniform otherwise (a floor: trained routers reuse
experts more). A step reads each missing expert once, whatever the number of its tokens; reads
ahead that turn out unneeded are not counted.

The constants (`Rates`) are measured on the spot by app.plan.speed_probe; this module only adds up.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from engine.generation.prefill import PREFILL_CHUNK
from engine.plan.planner import FLOAT_BITS, Plan
from engine.spec import GatedDeltaNetSpec, KimiDeltaSpec, MLASpec, MLPSpec, ModelSpec, MoESpec

HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


# ---- what the planned model computes (no machine involved) ---------------------------------------


@dataclass(frozen=True)
class Call:
    """One quantized kernel call of a decode step: matrices that share an input, run together."""

    shapes: tuple[tuple[int, int], ...]   # [out, in] of each matrix
    bits: tuple[int, ...]                 # the width of each

    @property
    def weights(self) -> int:
        """Weights the call multiplies."""
        return sum(o * i for o, i in self.shapes)


Matrices = Mapping[str, tuple[tuple[int, int], int]]   # quantized matrix name -> (shape, bits)


def decode_calls(spec: ModelSpec, mats: Matrices) -> tuple[list[tuple[Call, ...]], Call | None]:
    """The kernel calls one decoded token makes in each layer, in order, and the head's call.

    `mats` maps each quantized matrix to (shape, bits). Follows the engine's blocks: q/k/v in one call
    and o_proj in another (MLA: one call per matrix, its sparse-attention indexer's three matrices too; gated
    DeltaNet: each input projection (fused or split) and out_proj one call each; Kimi delta attention: its six
    projections of the input in one call, f_b, g_b and o_proj one each); gate and up in one call, down in another;
    a MoE layer's top_k routed experts in two fused calls (gate and up of all, then down of all).
    """
    layers = []
    for i, layer in enumerate(spec.layers):
        calls: list[Call] = []

        def add(names: list[str]) -> None:
            present = [n for n in names if n in mats and mats[n][1] != FLOAT_BITS]
            if present:
                calls.append(Call(tuple(tuple(mats[n][0]) for n in present), tuple(mats[n][1] for n in present)))

        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if isinstance(layer.attn, KimiDeltaSpec):     # engine/blocks/kda.py: the input's six in one call
            add([f"{a}.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")])
            for m in ("f_b_proj", "g_b_proj", "o_proj"):
                add([f"{a}.{m}.weight"])
        elif isinstance(layer.attn, GatedDeltaNetSpec):
            # fused per key head, or apart (Qwen3.5's split_proj): absent names add nothing
            for m in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_b", "in_proj_z", "in_proj_a", "out_proj"):
                add([f"{p}.linear_attn.{m}.weight"])
        elif isinstance(layer.attn, MLASpec):
            for m in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "indexer.wk", "indexer.wq_b",
                      "indexer.weights_proj", "o_proj"):
                add([f"{a}.{m}.weight"])      # a shared indexer layer has no matrices of its own: none present
        else:
            add([f"{a}.{m}_proj.weight" for m in "qkv"])
            add([f"{a}.o_proj.weight"])
        f = layer.ffn
        if isinstance(f, MLPSpec):
            add([f"{p}.{f.prefix}.gate_proj.weight", f"{p}.{f.prefix}.up_proj.weight"])
            add([f"{p}.{f.prefix}.down_proj.weight"])
        else:
            gate, up, down = (f"{p}.{f.prefix}.experts.0.{n}.weight" for n in f.proj_names)
            add([gate, up] * f.top_k)
            add([down] * f.top_k)
            if f.shared_ffn:
                s = f"{p}.{f.prefix}.{f.shared_prefix}"
                add([f"{s}.gate_proj.weight", f"{s}.up_proj.weight"])
                add([f"{s}.down_proj.weight"])
        layers.append(tuple(calls))
    head = EMBED if spec.tie_embeddings else HEAD
    if head not in mats or mats[head][1] == FLOAT_BITS:
        return layers, None
    return layers, Call((tuple(mats[head][0]),), (mats[head][1],))


@dataclass(frozen=True, eq=False)
class Work:
    """What one token of the planned model multiplies and reads, from its shapes and widths."""

    spec: ModelSpec
    layer_calls: tuple[tuple[Call, ...], ...]   # the kernel calls a decoded token makes in each layer
    head_call: Call | None         # the output head's call (outside the layers)
    dense: dict[int, int]          # bits -> weights a token multiplies outside routed experts and the head
    head: dict[int, int]           # bits -> weights of the output head (a prompt chunk runs it on one token)
    experts: dict[int, float]      # bits -> expected weights of the routed experts one token runs
    float_bytes: int               # float32 bytes a token reads (routers, norms, float32 matrices)
    formats: dict[int, tuple[int, bool]]   # bits -> (group, asymmetric) most weights at that width have
    dense_in: int                  # input width most dense weights have (the kernels' inner loop)
    expert_shape: tuple[int, int] | None   # [out, in] of most routed expert matrices
    token_bytes: int               # weight bytes one decoded token reads
    cold_usage: np.ndarray         # [n] share of tokens routed to each expert left on disk
    cold_bytes: np.ndarray         # [n] its bytes
    routing: str                   # "uniform" or "measured on calibration text"
    quantized: bool = True         # every matrix a decode step multiplies is quantized (none kept float32)

    @property
    def calls(self) -> dict[Call, int]:
        """Each distinct kernel call inside the layers, and how many a decoded token makes."""
        return dict(Counter(c for layer in self.layer_calls for c in layer))

    @property
    def streams(self) -> bool:
        """Whether some routed experts stay on disk."""
        return self.cold_bytes.size > 0

    @property
    def hit_rate(self) -> float:
        """Expected share of a decoded token's expert picks found in memory."""
        picks = sum(layer.ffn.top_k for layer in self.spec.layers if isinstance(layer.ffn, MoESpec))
        return 1.0 - float(self.cold_usage.sum()) / picks if picks else 1.0

    def miss_bytes(self, tokens: int = 1) -> float:
        """Expected expert bytes read from disk in a step of `tokens` tokens (a missing expert is read once a step)."""
        if not self.streams:
            return 0.0
        touched = 1.0 - np.power(1.0 - np.clip(self.cold_usage, 0.0, 1.0), tokens)    # [n]
        return float(touched @ self.cold_bytes)

    @property
    def expert_batch(self) -> int:
        """Tokens one routed expert gets, on average, from a prompt chunk."""
        moe = [layer.ffn for layer in self.spec.layers if isinstance(layer.ffn, MoESpec)]
        if not moe:
            return PREFILL_CHUNK
        return max(1, round(PREFILL_CHUNK * sum(f.top_k for f in moe) / sum(f.n_experts for f in moe)))

    @property
    def main_bits(self) -> int:
        """The width most of a token's weights have."""
        share = Counter(self.dense) + Counter(self.head) + Counter({b: int(w) for b, w in self.experts.items()})
        return max(share, key=share.get) if share else 4


def bytes_per_weight(bits: int, formats: Mapping[int, tuple[int, bool]]) -> float:
    """Storage bytes per weight at a width: codes plus fp16 scales (and offsets) per group."""
    group, asym = formats[bits]
    return bits / 8 + (2 + 2 * asym) / group


def _expert_prefix(name: str) -> str:
    """The tensor prefix of the routed expert a matrix belongs to ('model.layers.3.mlp.experts.12')."""
    cut = name.index(".experts.") + len(".experts.")
    return name[: name.index(".", cut)]


def plan_work(spec: ModelSpec, plan: Plan, experts: frozenset[str], cache_share: float, measured_routing: bool) -> Work:
    """The Work of a plan whose routed experts are `experts`, `cache_share` of their bytes held in memory.

    An expert's usage is its TensorPlan.usage normalised to top_k picks per layer (uniform when all
    usages are equal, as in a plan from config.json alone); the most used experts are the cached ones.
    """
    head_name = EMBED if spec.tie_embeddings else HEAD
    dense: Counter = Counter()
    head: Counter = Counter()
    formats: dict[int, Counter] = defaultdict(Counter)
    dense_in: Counter = Counter()
    expert_shapes: Counter = Counter()
    float_bytes = plan.other_bytes
    groups: dict[str, list] = defaultdict(list)
    quantized = True
    for name, t in plan.tensors.items():
        w = t.shape[0] * t.shape[1]
        if t.bits == FLOAT_BITS:
            float_bytes += 0 if name == EMBED and name != head_name else w * 4
            quantized = quantized and name == EMBED and name != head_name
            continue
        formats[t.bits][(t.group, bool(t.asymmetric if t.asymmetric is not None else t.bits == 2))] += w
        if name in experts:
            groups[_expert_prefix(name)].append(t)
            expert_shapes[t.shape] += w
        elif name != EMBED or name == head_name:            # an untied embedding: a token reads one row
            (head if name == head_name else dense)[t.bits] += w
            dense_in[t.shape[1]] += w
    fmts = {b: c.most_common(1)[0][0] for b, c in formats.items()}
    # routed experts: usage normalised to top_k picks per layer; the most used fill the cache
    by_layer: dict[int, list[str]] = defaultdict(list)
    for prefix in groups:
        by_layer[int(prefix.split(".")[2])].append(prefix)
    usage, nbytes = [], []
    expert_w: Counter = Counter()
    for layer, prefixes in sorted(by_layer.items()):
        raw = np.array([max(t.usage for t in groups[k]) for k in prefixes], np.float64)
        raw = raw if raw.sum() > 0 else np.ones_like(raw)
        u = spec.layers[layer].ffn.top_k * raw / raw.sum()                              # [E]
        usage.extend(u)
        for share, k in zip(u, prefixes):
            nbytes.append(sum(t.nbytes for t in groups[k]))
            for t in groups[k]:
                expert_w[t.bits] += share * t.shape[0] * t.shape[1]
    usage_a, bytes_a = np.array(usage, np.float64), np.array(nbytes, np.float64)
    order = np.argsort(-usage_a, kind="stable")
    held = np.cumsum(bytes_a[order]) <= cache_share * bytes_a.sum() + 0.5
    cold = order[~held] if cache_share < 1.0 else order[:0]
    mats = {n: (t.shape, t.bits) for n, t in plan.tensors.items()}
    layer_calls, head_call = decode_calls(spec, mats)
    token_bytes = int(sum(w * bytes_per_weight(b, fmts) for b, w in (dense + head + expert_w).items()) + float_bytes)
    return Work(spec, tuple(layer_calls), head_call, dict(dense), dict(head), dict(expert_w), int(float_bytes), fmts,
                dense_in.most_common(1)[0][0] if dense_in else spec.hidden_size,
                expert_shapes.most_common(1)[0][0] if expert_shapes else None, token_bytes,
                usage_a[cold], bytes_a[cold], "measured on calibration text" if measured_routing else "uniform", quantized)


# ---- this machine's constants (measured by app.plan.speed_probe) -------------------------------------


@dataclass(frozen=True)
class Rates:
    """The measured constants of the time model (see the module header); seconds unless named otherwise."""

    threads: int
    chunk: int                     # tokens per prompt chunk (PREFILL_CHUNK, or --ctx when smaller)
    token_s: float                 # per decoded token, outside the layers and kernels
    layer_s: float                 # per layer per decoded token, besides attention and kernels
    chunk_s: float                 # per prompt chunk, outside the layers and kernels
    chunk_layer_s: float           # per layer per prompt chunk, besides attention and kernels
    key_s: float                   # per layer per key one decoded token attends to
    pair_s: float                  # per layer per (query, key) pair of a prompt chunk
    fused: bool                    # the engine decodes this model in one fused step (no per-call cost)
    call_s: dict[Call, float]      # per kernel call of a decode step not fused, each call of the plan
    decode_wps: dict[int, float]   # weights per second of one large matvec call, by width
    prompt_wps: dict[int, float]   # weights x tokens per second on a prompt chunk, by width
    expert_wps: dict[int, float]   # the same through the fused experts, on the tokens one expert gets
    ram_gbs: float
    disk_gbs: float | None         # measured only when experts stream
    seconds: float                 # how long measuring took


def _rate(rates: Mapping[int, float], bits: int) -> float:
    """The rate at a width, or at the nearest width measured."""
    return rates[bits] if bits in rates else rates[min(rates, key=lambda b: abs(b - bits))]


def call_seconds(call: Call, rates: Rates) -> float:
    """A decode kernel call as measured (or, for a call not measured, its weights at the large-call rate)."""
    if call in rates.call_s:
        return rates.call_s[call]
    return sum(o * i / _rate(rates.decode_wps, b) for (o, i), b in zip(call.shapes, call.bits))


# ---- the time model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """Seconds of one decode step or prompt chunk, by term."""

    fixed: float         # per token and per layer overhead
    attention: float
    kernels: float       # quantized weights (and float32 bytes)
    disk: float          # expert reads, overlapping the layers
    layers: float        # the part of fixed + attention + kernels inside the layers (what reads overlap)
    tokens: int

    @property
    def seconds(self) -> float:
        """The step, reads overlapping the layers' compute."""
        return self.fixed + self.attention + self.kernels - self.layers + max(self.layers, self.disk)

    @property
    def tok_s(self) -> float:
        """Tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def index_share(attn: MLASpec) -> float:
    """The indexer's multiply-adds per key scored over latent attention's per key attended (scores against the
    latent and rotary key, then the latent weighted into the output): what one scored key costs in keys."""
    ix = attn.indexer
    return ix.n_heads * ix.head_dim / (attn.n_heads * (2 * attn.kv_lora_rank + attn.qk_rope_dim))


def _window_keys(spec: ModelSpec, start: int, tokens: int) -> float:
    """Query-key pairs over all layers of `tokens` queries at positions start.. (each sees itself and before).

    A recurrent layer attends to no keys; a sparse-attention layer to its top-k, after its indexer (a shared
    one reuses another layer's choice) scored every key it sees, counted at `index_share`."""
    pos = np.arange(start, start + tokens, dtype=np.float64) + 1.0
    total = 0.0
    for layer in spec.layers:
        a = layer.attn
        if isinstance(a, GatedDeltaNetSpec):
            continue
        if isinstance(a, MLASpec) and a.indexer is not None:
            total += float(np.minimum(pos, a.indexer.topk).sum())
            total += 0.0 if a.indexer.shared else float(pos.sum()) * index_share(a)
            continue
        window = getattr(a, "sliding_window", None)
        total += float(np.minimum(pos, window).sum() if window else pos.sum())
    return total


def _disk_seconds(nbytes: float, rates: Rates) -> float:
    return nbytes / (rates.disk_gbs * 1e9) if nbytes and rates.disk_gbs else 0.0


def decode_step(work: Work, rates: Rates, position: int) -> StepTime:
    """One token decoded after `position` tokens of context."""
    n = work.spec.n_layers
    attention = rates.key_s * _window_keys(work.spec, position, 1)
    if rates.fused:                                   # one parallel region: the weights at the large-call rate
        inner = sum(w / _rate(rates.decode_wps, b) for b, w in (Counter(work.dense) + Counter(work.experts)).items())
        head = sum(w / _rate(rates.decode_wps, b) for b, w in work.head.items())
    else:
        inner = sum(k * call_seconds(c, rates) for c, k in work.calls.items())
        head = call_seconds(work.head_call, rates) if work.head_call is not None else 0.0
    inner += work.float_bytes / (rates.ram_gbs * 1e9)
    layers = n * rates.layer_s + attention + inner
    return StepTime(rates.token_s + n * rates.layer_s, attention, head + inner,
                    _disk_seconds(work.miss_bytes(1), rates), layers, 1)


def chunk_step(work: Work, rates: Rates, start: int, tokens: int) -> StepTime:
    """A prompt chunk of `tokens` tokens after `start` tokens of context."""
    n = work.spec.n_layers
    attention = rates.pair_s * _window_keys(work.spec, start, tokens)
    head = call_seconds(work.head_call, rates) if work.head_call is not None else 0.0   # the last token's logits
    inner = (tokens * (sum(w / _rate(rates.prompt_wps, b) for b, w in work.dense.items())
                       + sum(w / _rate(rates.expert_wps, b) for b, w in work.experts.items()))
             + work.float_bytes / (rates.ram_gbs * 1e9))
    layers = n * rates.chunk_layer_s + attention + inner
    return StepTime(rates.chunk_s + n * rates.chunk_layer_s, attention, head + inner,
                    _disk_seconds(work.miss_bytes(tokens), rates), layers, tokens)


def prompt_seconds(work: Work, rates: Rates, tokens: int) -> float:
    """A prompt of `tokens` tokens, in chunks of rates.chunk."""
    return sum(chunk_step(work, rates, s, min(rates.chunk, tokens - s)).seconds for s in range(0, tokens, rates.chunk))


@dataclass(frozen=True)
class Speeds:
    """The predicted speeds with the breakdown and constants they rest on."""

    prompt_tokens: int             # the short prompt (one chunk)
    prompt_tok_s: float
    full_prompt_tok_s: float       # a prompt as long as the context
    decode_tok_s: float            # after the short prompt
    full_decode_tok_s: float       # with the context full
    ctx: int
    step: StepTime                 # the decode step after the short prompt
    work: Work = field(repr=False)
    rates: Rates = field(repr=False)


def predict_speeds(work: Work, rates: Rates, ctx: int) -> Speeds:
    """Prompt and decode speed at the start of a chat (a one-chunk prompt) and with the context full."""
    short = min(rates.chunk, ctx)
    step = decode_step(work, rates, short)
    return Speeds(short, short / prompt_seconds(work, rates, short), ctx / prompt_seconds(work, rates, ctx),
                  step.tok_s, decode_step(work, rates, max(0, ctx - 1)).tok_s, ctx, step, work, rates)


def describe_speeds(s: Speeds) -> list[str]:
    """The predicted speeds, what a decoded token's time goes to, what was measured and what assumed."""
    from app.config.sizes import format_size

    w, r, st = s.work, s.rates, s.step
    widths = "/".join(str(b) for b in sorted(set(w.dense) | set(w.head) | set(w.experts)))
    full = s.ctx > s.prompt_tokens
    lines = [f"predicted prompt {s.prompt_tok_s:.1f} tok/s for a {s.prompt_tokens}-token prompt"
             + (f", {s.full_prompt_tok_s:.1f} tok/s for one of {s.ctx} tokens" if full else "")]
    n_calls = sum(w.calls.values()) + (w.head_call is not None)
    how = "one fused step" if r.fused else f"{n_calls:.0f} calls"
    terms = [f"{st.kernels * 1e3:.1f} ms in {how} of the {widths}-bit kernels ({format_size(w.token_bytes)} of weights)",
             f"{st.fixed * 1e3:.1f} ms fixed ({w.spec.n_layers} layers x {r.layer_s * 1e3:.2f} ms + "
             f"{r.token_s * 1e3:.2f} ms)",
             f"{st.attention * 1e3:.1f} ms attention"]
    if w.streams:
        terms.append(f"{st.disk * 1e3:.1f} ms reading {format_size(w.miss_bytes())} of experts from disk "
                     f"(hit rate {w.hit_rate * 100:.0f}%) while the layers compute ({st.layers * 1e3:.1f} ms)")
    lines.append(f"predicted decode {s.decode_tok_s:.1f} tok/s after {s.prompt_tokens} tokens"
                 + (f", {s.full_decode_tok_s:.1f} tok/s at {s.ctx}" if full else "") + ": per token "
                 + ", ".join(terms))
    measured = (f"measured now ({r.seconds:.1f} s, {r.threads} thread{'s' if r.threads != 1 else ''}): the engine's "
                "kernels on random weights of these shapes and widths, its forward pass on tiny models of this "
                f"structure (fixed costs, attention per key), RAM {r.ram_gbs:.1f} GB/s"
                + (f", disk {r.disk_gbs:.2f} GB/s cold reads" if r.disk_gbs else ""))
    assumed = ["the machine as busy as it is now"]
    if w.streams:
        assumed.insert(0, "the expert cache holding the most used experts, routing "
                       + ("as on the calibration text" if w.routing != "uniform" else
                          "uniform (planned without weights; trained routers reuse experts more: a floor)"))
    lines.append(f"{measured}; assumed: {', '.join(assumed)}")
    return lines
