"""Measuring the constants of app.plan.speed_model on this machine, in one to three seconds; nothing cached.

- Fixed costs and attention: the engine's own forward pass (engine.models.transformer) on tiny
  models of the planned model's structure: its layer kinds, attention kind, head width, expert
  count, top_k and widths, with hidden width 64, feed-forward and experts 64 wide and random
  weights. One-head models of 1 and 5 layers per kind give the per-token and per-layer costs of a
  decoded token (each tiny layer running amid one real layer's kernel calls, whose time alone is
  then taken out, as are the tiny kernels') and of a prompt chunk. A one-layer model with every
  head gives the cost per key of a decoded token (8 against 2048 keys, read cold: in turn over
  caches larger together than the last-level cache, as in a real step, where the weights pass
  between two uses of a layer's cache) and per query-key pair of a prompt (64 queries at 0 and at
  half the context: the cost per pair grows with the keys a query sees).
- Kernel calls: each distinct call of a decode step (app.plan.speed_model.decode_calls) timed on random
  codes of its shapes and widths, in turn over copies filling a working set as large as one
  token's weights (at most 64 MB, in ordinary pages as mapped weights are), so the weights come
  from memory as the real ones do.
- Prompt rates: the quantized matmul on a prompt chunk at each width; routed experts through
  the fused expert call with the tokens one expert gets from a chunk.
- RAM bandwidth (a parallel sum over 128 MB) and, only when experts stream, cold disk reads
  where the experts lie (the container's experts file, else a scratch file in its folder).

Timings are means or medians of means, never the best run: on a busy machine its delays are part
of the speed. Runs that are compared take turns, so a passing load weighs on both alike.
"""

from __future__ import annotations

import mmap
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from app.plan.speed_model import Call, Rates, Work, bytes_per_weight, decode_calls
from engine.generation.prefill import PREFILL_CHUNK
from engine.offload.budget import kv_bytes
from engine.plan.planner import group_for
from engine.spec import AttentionSpec, GatedDeltaNetSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec

TINY_HIDDEN = 64           # the tiny models' widths (their own kernel time is taken out)
TINY_FFN = 64
TINY_VOCAB = 256
MANY = 5                   # layers per kind of the deeper tiny model (the shallow one has 1)
LONG_CONTEXT = 2048        # keys of the long-context attention probe (fewer when the model holds fewer)
SET_MAX = 64 << 20         # working set of the decode probes: one token's weight bytes, within these bounds
SET_MIN = 4 << 20
RAM_PROBE_BYTES = 128 << 20
DISK_PROBE_BYTES = 128 << 20


def _mean_time(fn: Callable[[], object], reps: int) -> float:
    """Mean seconds of `reps` calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _interleaved(runs: dict[str, Callable[[], object]], batches: int, per_batch: int) -> dict[str, float]:
    """Seconds per call of each run: the median over `batches` of the mean of `per_batch` consecutive calls,
    the runs taking turns batch by batch (a passing load weighs on all alike, a single stall on none)."""
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(batches):
        for label, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(per_batch):
                run()
            times[label].append((time.perf_counter() - t0) / per_batch)
    return {k: statistics.median(v) for k, v in times.items()}


# ---- random quantized weights -----------------------------------------------------------------


class CodePool:
    """Random code bytes handed out as consecutive, wrapping views: many tensors over one working set.

    The bytes live in an anonymous mapping of ordinary pages, as a model's weights do (memory maps of its
    files): numpy backs large arrays with huge pages, whose fewer TLB misses made the kernels measure
    up to twice as fast as on a real model's experts.
    """

    def __init__(self, nbytes: int, rng: np.random.Generator):
        self._map = mmap.mmap(-1, max(nbytes, 1))
        self.data = np.frombuffer(self._map, np.uint8, count=nbytes)
        step = 8 << 20
        for at in range(0, nbytes, step):
            self.data[at:at + step] = rng.integers(0, 256, min(step, nbytes - at), dtype=np.uint8)
        self.at = 0

    def take(self, n: int) -> np.ndarray:
        """n bytes of codes (a view; fresh bytes when n exceeds the pool)."""
        if n > self.data.size:
            return np.resize(self.data, n)
        if self.at + n > self.data.size:
            self.at = 0
        view = self.data[self.at:self.at + n]
        self.at += n
        return view


def random_quantized(shape: tuple[int, int], bits: int, group: int, asymmetric: bool, codes: CodePool):
    """A QuantizedTensor of random codes with scales that keep outputs near unit size, in the layout a conversion
    gives it (speed probes only)."""
    from engine.kernels.layout import BLOCK, FORMATS, rows16_allowed
    from engine.quant import QuantizedTensor

    out, n_in = shape
    fmt = FORMATS[bits]
    blocks, groups = n_in // BLOCK, n_in // group
    d = 1.0 / (np.sqrt(n_in) * 2**bits / np.sqrt(12.0))        # uniform codes: weights of std about 1/sqrt(in)
    scales = np.full((out, groups), np.float16(d).view(np.uint16), np.uint16)
    mins = (np.full((out, groups), np.float16(-(2 ** (bits - 1)) * d).view(np.uint16), np.uint16) if asymmetric
            else np.zeros((out, 0), np.uint16))
    layout = "rows16" if rows16_allowed(bits, asymmetric, out) else "planes"     # what quantize() would choose
    return QuantizedTensor((out, n_in), bits, group, asymmetric, codes.take(out * blocks * fmt.a_bytes),
                           codes.take(out * blocks * fmt.b_bytes), scales, mins, layout)


def _matrix(work: Work, shape: tuple[int, int], bits: int, codes: CodePool):
    group, asym = work.formats.get(bits, (32, bits == 2))
    return random_quantized(shape, bits, group_for(shape[1], group), asym, codes)


# ---- kernels ------------------------------------------------------------------------------------


def _run_call(mats: list, x: np.ndarray) -> None:
    from engine.quant import matmul_many

    if len(mats) == 1:
        mats[0].matmul(x)
    else:
        matmul_many(x, mats)


def measure_calls(work: Work, calls: list[Call], set_bytes: int, codes: CodePool) -> dict[Call, float]:
    """Mean seconds of each decode kernel call, in turn over copies that fill `set_bytes` (read from memory)."""
    rng = np.random.default_rng(1)
    out = {}
    for call in calls:
        nbytes = sum(o * i * bytes_per_weight(b, work.formats) if b in work.formats else o * i
                     for (o, i), b in zip(call.shapes, call.bits))
        if nbytes > set_bytes // 2:
            continue                            # too large to copy: its weights at the large-call rate
        copies = [[_matrix(work, s, b, codes) for s, b in zip(call.shapes, call.bits)]
                  for _ in range(max(2, min(256, int(set_bytes // nbytes))))]
        x = rng.standard_normal((1, call.shapes[0][1]), dtype=np.float32)
        _run_call(copies[0], x)                                                 # compile (or load) first
        out[call] = _mean_time(lambda: [_run_call(c, x) for c in copies], 3) / len(copies)
    return out


def _decode_rates(work: Work, set_bytes: int, codes: CodePool) -> dict[int, float]:
    """Weights per second of one large matvec call over the working set, at each width the plan uses."""
    rng = np.random.default_rng(2)
    rates = {}
    for bits in sorted({b for c in (*work.calls, work.head_call) if c is not None for b in c.bits}):
        k = work.dense_in
        rows = max(64, (1 << 20) // k)
        one_bytes = rows * k * bytes_per_weight(bits, work.formats)
        mats = [_matrix(work, (rows, k), bits, codes) for _ in range(max(1, int(set_bytes // one_bytes)))]
        x = rng.standard_normal((1, k), dtype=np.float32)
        _run_call(mats, x)
        rates[bits] = len(mats) * rows * k / _mean_time(lambda: _run_call(mats, x), 4)
    return rates


def _prompt_rates(work: Work, chunk: int, codes: CodePool) -> tuple[dict[int, float], dict[int, float]]:
    """Weights x tokens per second on a prompt chunk (dense matrices) and through the fused experts, by width."""
    rng = np.random.default_rng(3)
    prompt, expert = {}, {}
    for bits in {*work.dense, *work.head}:
        k = work.dense_in
        one = _matrix(work, (max(64, (1 << 20) // k), k), bits, codes)
        x = rng.standard_normal((chunk, k), dtype=np.float32)                           # [T, k]
        one.matmul(x)
        prompt[bits] = chunk * one.shape[0] * k / _mean_time(lambda: one.matmul(x), 3)
    for bits in work.experts:
        expert[bits] = _expert_rate(work, bits, chunk, codes)
    return prompt or dict(expert), expert or dict(prompt)


def _expert_rate(work: Work, bits: int, chunk: int, codes: CodePool) -> float:
    """Weights x tokens per second of the engine's fused routed experts: a chunk's tokens over up to 16
    experts of this model's shape, each getting the tokens it would get from the chunk."""
    from engine.blocks.ffn import ExpertWeights
    from engine.kernels.experts import moe_experts

    rng = np.random.default_rng(4)
    moe = next(layer.ffn for layer in work.spec.layers if isinstance(layer.ffn, MoESpec))
    n = min(16, moe.n_experts)
    k = max(1, min(n, round(moe.top_k * n / moe.n_experts)))                 # picks per token among the n
    inter, hidden = work.expert_shape
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))                       # gate, up, down
    experts = [ExpertWeights(*(_matrix(work, s, bits, codes) for s in shapes)) for _ in range(n)]
    ids = np.argsort(rng.random((chunk, n)), axis=1)[:, :k]                              # [T, k] distinct per token
    weights = np.full((chunk, k), 1.0 / k, np.float32)
    x = rng.standard_normal((chunk, hidden), dtype=np.float32)                           # [T, hidden]
    moe_experts(x, ids, weights, experts)
    return chunk * k * 3 * inter * hidden / _mean_time(lambda: moe_experts(x, ids, weights, experts), 3)


# ---- tiny models: fixed costs and attention --------------------------------------------------------


class _Tensors:
    """A TensorSource over tensors made here (the tiny models')."""

    path = "<speed probe>"

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def names(self):
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def load(self, name: str):
        return self.tensors[name]

    def location(self, name: str) -> str:
        return self.path


def _tiny_layer(layer: LayerSpec, heads: bool) -> LayerSpec:
    """The layer with narrow feed-forward blocks; its attention heads kept (`heads`) or cut to one."""
    ffn = layer.ffn
    if isinstance(ffn, MLPSpec):
        ffn = replace(ffn, intermediate=TINY_FFN)
    else:
        ffn = replace(ffn, expert_ffn=TINY_FFN, shared_ffn=TINY_FFN if ffn.shared_ffn else 0)
    attn = layer.attn
    if isinstance(attn, AttentionSpec):
        attn = replace(attn, sliding_window=None)
        attn = attn if heads else replace(attn, n_heads=1, n_kv_heads=1)
    elif isinstance(attn, GatedDeltaNetSpec):
        # one key head with its group of value heads, so the group's shape (and the kernel's path) stays real
        group = attn.n_v_heads // attn.n_k_heads
        attn = attn if heads else replace(attn, n_k_heads=1, n_v_heads=group)
    elif not heads:
        attn = replace(attn, n_heads=1)
    return LayerSpec(attn, ffn)


def tiny_model(spec: ModelSpec, repeat: int, work: Work, codes: CodePool, heads: bool = False):
    """The engine's Transformer over `repeat` layers of each of this model's layer kinds: narrow, random
    weights at the plan's widths, attention with one head (or all of them with `heads`).

    Returns (model, layer kinds, its quantized matrices as {name: (shape, bits)}).
    """
    from app.hub.convert import classify_spec
    from engine.models.transformer import Transformer, expected_shapes

    rng = np.random.default_rng(5)
    kinds = list(dict.fromkeys(_tiny_layer(layer, heads) for layer in spec.layers))
    tiny = replace(spec, vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, layers=tuple(kinds) * repeat, extra={})
    planned = classify_spec(tiny).planned
    widths = Counter(work.dense) + Counter(work.head)
    dense_bits = max(widths, key=widths.get) if widths else work.main_bits
    expert_bits = max(work.experts, key=work.experts.get) if work.experts else dense_bits
    tensors, mats = {}, {}
    for name, shape in expected_shapes(tiny).items():
        if name in planned:
            bits = expert_bits if ".experts." in name else dense_bits
            tensors[name] = _matrix(work, shape, bits, codes)
            mats[name] = (shape, bits)
        elif len(shape) == 2:
            tensors[name] = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(np.float32)
        else:
            tensors[name] = np.zeros(shape, np.float32) if "bias" in name else np.ones(shape, np.float32)
    return Transformer(tiny, _Tensors(tensors)), len(kinds), mats


def _filled_cache(model, filled: int, room: int):
    """A KV cache holding `filled` positions with `room` more, its memory written (pages never written read
    as the one shared zero page, which always hits the cache)."""
    from engine.kv import KVCache

    cache = KVCache(model.spec, filled + room)
    for arrays in cache.pool.layers:
        for name, a in arrays.items():
            a.fill(1.0 if name.endswith("s") else 0.01)             # ks, vs: row scales; k, v: the rows
    if filled:
        cache.prepare([0] * filled)
        cache.commit(filled)
    return cache


def _pairs(start: int, tokens: int) -> float:
    """Query-key pairs of `tokens` queries at positions start.. (each sees itself and what precedes it)."""
    return tokens * start + tokens * (tokens + 1) / 2


def _tiny_kernels(model, work: Work, mats: dict, codes: CodePool) -> tuple[float, float]:
    """(seconds per layer, seconds outside the layers) of a tiny model's own decode kernel calls."""
    layers, head = decode_calls(model.spec, mats)
    # a small working set: the tiny model's weights stay in the cache while it runs
    timed = measure_calls(work, list({c for layer in layers for c in layer}) + ([head] if head else []), 256 << 10,
                          codes)
    return (sum(timed.get(c, 0.0) for layer in layers for c in layer) / len(layers),
            timed.get(head, 0.0) if head else 0.0)


class _WithRealCalls:
    """An attention block that first runs one real layer's kernel calls (random weights of the planned shapes, in
    turn over copies that fill the working set), so that the tiny layer runs amid the cache traffic of a real one;
    the calls' own time, measured alone, is taken out afterwards."""

    def __init__(self, attn, copies: list[list[tuple[list, np.ndarray]]]):
        self.attn, self.copies, self.turn = attn, copies, 0

    def __call__(self, *args):
        for mats, x in self.copies[self.turn % len(self.copies)]:
            _run_call(mats, x)
        self.turn += 1
        return self.attn(*args)


def _with_real_calls(model, work: Work, call_s: dict[Call, float], set_bytes: int, codes: CodePool) -> float:
    """Wrap each tiny layer's attention in _WithRealCalls for the real layer of its kind; the seconds those calls
    take alone, per layer on average."""
    rng = np.random.default_rng(7)
    real = {}
    for i, layer in enumerate(work.spec.layers):
        real.setdefault(_tiny_layer(layer, False), i)                 # the first real layer of each kind
    kinds = list(real)
    layers, alone = [], []
    for j, layer in enumerate(model.layers):
        calls = work.layer_calls[real[kinds[j % len(kinds)]]]
        nbytes = sum(o * i * bytes_per_weight(b, work.formats) for c in calls for (o, i), b in zip(c.shapes, c.bits))
        copies = [[([_matrix(work, sh, b, codes) for sh, b in zip(c.shapes, c.bits)],
                    rng.standard_normal((1, c.shapes[0][1]), dtype=np.float32)) for c in calls]
                  for _ in range(max(2, min(32, int(set_bytes // max(1.0, nbytes)))))]
        layers.append(replace(layer, attn=_WithRealCalls(layer.attn, copies)))
        alone.append(sum(call_s.get(c, 0.0) for c in calls))
    model.layers = layers
    return statistics.fmean(alone)


def fuses(work: Work, tiny) -> bool:
    """Whether the engine decodes the planned model in one fused step: the engine accepts its structure (asked on
    a tiny model of it), every matrix is quantized and every expert resident."""
    from engine.fused.plan import FusedDecode

    return work.quantized and not work.streams and FusedDecode.for_model(tiny) is not None


def measure_fixed(work: Work, fused: bool, chunk: int, long_ctx: int, prompt_ctx: int, decode_wps: float,
                  prompt_wps: float, call_s: dict[Call, float], set_bytes: int, codes: CodePool) -> dict[str, float]:
    """token_s, layer_s, key_s, chunk_s, chunk_layer_s, pair_s from the engine's forward pass on tiny models.

    Decoded one block at a time (not `fused`), the tiny layers run amid real layers' kernel calls
    (_WithRealCalls): alone, on a tiny model whose data stays in the cache, the interpreter's work between
    the calls came out about half what it is in a real model, whose weights pass through the caches between
    any two of its steps.
    """
    spec = work.spec
    one, kinds, mats = tiny_model(spec, 1, work, codes)
    many, _, _ = tiny_model(spec, MANY, work, codes)
    heads, _, _ = tiny_model(spec, 1, work, codes, heads=True)
    chunk_one, _, _ = tiny_model(spec, 1, work, codes)
    chunk_many, _, _ = tiny_model(spec, MANY, work, codes)
    for model in (one, many, heads):
        model.context.fused_decode = fused                       # decode as the real model will
    injected = 0.0
    if not fused:
        injected = _with_real_calls(one, work, call_s, set_bytes, codes)
        _with_real_calls(many, work, call_s, set_bytes, codes)
    ids = [int(i) for i in np.random.default_rng(6).integers(0, TINY_VOCAB, chunk)]
    probe = min(64, chunk)                                        # queries of the prompt-attention probe
    batches, per_batch = 7, 4
    reps = batches * per_batch
    caches = {"d1": [_filled_cache(one, 8, reps + 2)], "dn": [_filled_cache(many, 8, reps + 2)],
              "a0": [_filled_cache(heads, 8, reps + 2)]}
    # the long context in turns over caches larger together than the last-level cache (see the header)
    kv = kv_bytes(heads.spec, long_ctx)
    caches["al"] = [_filled_cache(heads, long_ctx, reps + 2) for _ in range(max(1, min(32, -(-SET_MAX // kv))))]
    models = {"d1": one, "dn": many, "a0": heads, "al": heads}
    turn: Counter = Counter()

    def step(k: str) -> None:
        models[k].forward([1], caches[k][turn[k] % len(caches[k])])
        turn[k] += 1

    for k in caches:
        step(k)                                                   # compile (or load) the kernels first
    m = _interleaved({k: (lambda k=k: step(k)) for k in caches}, batches, per_batch)
    one, many = chunk_one, chunk_many                            # prompt chunks: kernels dominate, no injection
    chunks = {"p1": (one, _filled_cache(one, 0, chunk), 0, ids), "pn": (many, _filled_cache(many, 0, chunk), 0, ids),
              "pl": (one, _filled_cache(one, prompt_ctx, chunk), prompt_ctx, ids),
              "q0": (heads, _filled_cache(heads, 0, probe), 0, ids[:probe]),
              "ql": (heads, _filled_cache(heads, prompt_ctx, probe), prompt_ctx, ids[:probe])}

    def chunk_run(k: str) -> None:
        model, cache, base, tokens = chunks[k]
        cache.truncate(base)
        model.forward(tokens, cache)

    chunk_run("p1")
    m |= _interleaved({k: (lambda k=k: chunk_run(k)) for k in chunks}, 5, 1)
    key_s = max(0.0, (m["al"] - m["a0"]) / (kinds * (long_ctx - 8)))
    pair_s = max(0.0, (m["ql"] - m["q0"]) / (kinds * probe * prompt_ctx))
    # what the one-head models spend on their one head's attention and on their own tiny kernels
    one_head_pair = max(0.0, (m["pl"] - m["p1"]) / (kinds * chunk * prompt_ctx))
    tiny_weights = sum(s[0] * s[1] for n, (s, _) in mats.items() if n.startswith("model.layers.")) / one.spec.n_layers
    if fused:
        head_weights = sum(s[0] * s[1] for n, (s, _) in mats.items() if not n.startswith("model.layers."))
        layer_kernels, head_kernel = tiny_weights / decode_wps, head_weights / decode_wps
    else:
        layer_kernels, head_kernel = _tiny_kernels(one, work, mats, codes)
    own_decode = (8 + reps / 2) * one_head_pair + layer_kernels
    own_chunk = _pairs(0, chunk) * one_head_pair + chunk * tiny_weights / prompt_wps
    layer_s = max(0.0, (m["dn"] - m["d1"]) / ((MANY - 1) * kinds) - own_decode - injected)
    chunk_layer_s = max(0.0, (m["pn"] - m["p1"]) / ((MANY - 1) * kinds) - own_chunk)
    return {"token_s": max(0.0, m["d1"] - kinds * (layer_s + own_decode + injected) - head_kernel), "layer_s": layer_s,
            "key_s": key_s, "chunk_s": max(0.0, m["p1"] - kinds * (chunk_layer_s + own_chunk)),
            "chunk_layer_s": chunk_layer_s, "pair_s": pair_s}


# ---- disk and the whole measurement ---------------------------------------------------------------


def measure_disk(folder: Path) -> float:
    """Cold read GB/s where the experts will be read from: the container's experts file, else a scratch file."""
    if any(Path(folder).glob("experts-*.bin")):
        from app.bench.offload import disk_bandwidth

        return disk_bandwidth(Path(folder), 1 << 20, 2)
    from app.doctor import measure_disk_read

    return measure_disk_read(Path(folder), DISK_PROBE_BYTES)


def measure_rates(work: Work, ctx: int, threads: int, disk_folder: Path | None) -> Rates:
    """Every constant of the time model, measured now with `threads` compute threads (the disk only when
    experts stream, in `disk_folder`)."""
    from app.bench.decode import measure_bandwidth, thread_limits

    t0 = time.perf_counter()
    chunk = max(1, min(PREFILL_CHUNK, ctx))
    set_bytes = int(min(SET_MAX, max(SET_MIN, work.token_bytes)))
    codes = CodePool(set_bytes, np.random.default_rng(0))
    with thread_limits(threads):
        fused = fuses(work, tiny_model(work.spec, 1, work, codes)[0])
        calls = {} if fused else measure_calls(work, list(work.calls) + ([work.head_call] if work.head_call else []),
                                               set_bytes, codes)
        decode = _decode_rates(work, set_bytes, codes)
        prompt, expert = _prompt_rates(work, chunk, codes)
        long_ctx = max(64, min(LONG_CONTEXT, work.spec.max_position - 64))
        # a prompt's queries see half the context on average: the cost per pair grows with the row's length
        prompt_ctx = max(64, min(long_ctx, ctx // 2))
        fixed = measure_fixed(work, fused, chunk, long_ctx, prompt_ctx, max(decode.values()), max(prompt.values()),
                              calls, set_bytes, codes)
        ram = measure_bandwidth(RAM_PROBE_BYTES, repeats=3)
    disk = measure_disk(disk_folder) if work.streams and disk_folder is not None else None
    return Rates(threads, chunk, fused=fused, call_s=calls, decode_wps=decode, prompt_wps=prompt, expert_wps=expert,
                 ram_gbs=ram, disk_gbs=disk, seconds=time.perf_counter() - t0, **fixed)
