"""Benchmark of the quantized kernels on the matrices of `mixtral-1.7b` (not a test: run it by hand).

    .venv/bin/python tests/kernels/bench_kernels.py [--bits 4 8] [--repeat 9] [--threads 2] [--skip-prefill] [--separate-qkv]

A whole model's worth of distinct random weights (16 layers: q, k, v, o, router, 64 experts;
lm_head), so that decode reads from RAM as it would in a model that does not fit in cache.
Reports per decoded token (T=1) the matmul time, the weight bytes it reads, the GB/s that makes
and the tokens/s it implies (matmuls only), then prefill of 128 tokens, matmul_f32 against BLAS,
and the quantized GEMM against BLAS on dequantized weights. Medians of --repeat runs; a run during
which another process used the CPUs is thrown away and repeated (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("NUMBA_CACHE_DIR", str(REPO / ".cache" / "numba"))

import numba  # noqa: E402
import numpy as np  # noqa: E402

from engine.blocks.ffn import ExpertWeights  # noqa: E402
from engine.kernels.experts import moe_experts  # noqa: E402
from engine.kernels.fp32 import matmul_f32  # noqa: E402
from engine.kernels.layout import FORMATS, f16_bits  # noqa: E402
from engine.quant import QuantizedTensor, matmul_many  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 1024, 16, 16, 4, 64
EXPERTS, TOP_K, EXPERT_FFN, VOCAB = 64, 8, 512, 32000


class CleanClock:
    """Times a run and says whether another process used the CPUs meanwhile (the machine is shared).

    Compares the busy time of all CPUs (/proc/stat) with this process's own CPU time (os.times):
    a sample during which others used more than `tolerance` of one CPU is thrown away.
    """

    def __init__(self, tolerance: float = 0.05):
        self.tolerance = tolerance
        self.tick = os.sysconf("SC_CLK_TCK")
        self.clean = self.disturbed = 0

    def _busy(self) -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(t) for t in f.readline().split()[1:]]
        except OSError:
            return 0.0
        return (sum(v) - v[3] - v[4]) / self.tick          # all but idle and iowait, in seconds

    def run(self, fn, tries: int = 60):
        """(seconds, result) of fn() the first time it runs undisturbed (the last try's when none does)."""
        for _ in range(tries):
            busy0, own0, t0 = self._busy(), sum(os.times()[:2]), time.perf_counter()
            result = fn()
            wall = time.perf_counter() - t0
            others = (self._busy() - busy0) - (sum(os.times()[:2]) - own0)
            if others <= self.tolerance * wall + 1.0 / self.tick:
                self.clean += 1
                return wall, result
            self.disturbed += 1
            time.sleep(0.5)
        return wall, result

    def report(self) -> str:
        """How many samples were kept and thrown away since the last report."""
        text = f"[{self.clean} undisturbed samples, {self.disturbed} thrown away]"
        self.clean = self.disturbed = 0
        return text


CLOCK = CleanClock()
SEPARATE_QKV = False  # --separate-qkv: three matmul calls instead of one matmul_many


def random_tensor(rng: np.random.Generator, rows: int, cols: int, bits: int, group: int) -> QuantizedTensor:
    """Random codes and plausible fp16 scales in the real layout (speed does not depend on values)."""
    fmt = FORMATS[bits]
    nb, ng = cols // 32, cols // group
    a = rng.integers(0, 256, (rows, nb * fmt.a_bytes), dtype=np.uint8)
    b = rng.integers(0, 256, (rows, nb * fmt.b_bytes), dtype=np.uint8)
    scales = f16_bits(rng.uniform(0.001, 0.01, (rows, ng)))
    mins = f16_bits(rng.uniform(-0.05, 0.0, (rows, ng))) if fmt.asymmetric else np.zeros((rows, 0), np.uint16)
    return QuantizedTensor((rows, cols), bits, group, fmt.asymmetric, a, b, scales, mins)


@dataclass
class Layer:
    q: QuantizedTensor
    k: QuantizedTensor
    v: QuantizedTensor
    o: QuantizedTensor
    router: np.ndarray                 # [E, hidden] float32
    experts: list[ExpertWeights]


@dataclass
class Model:
    layers: list[Layer]
    lm_head: QuantizedTensor

    def decode_bytes(self) -> int:
        """Weight bytes one decoded token reads (top-k experts per layer, router, lm_head)."""
        lay = self.layers[0]
        per_layer = sum(m.nbytes for m in (lay.q, lay.k, lay.v, lay.o)) + lay.router.nbytes + TOP_K * lay.experts[0].nbytes
        return LAYERS * per_layer + self.lm_head.nbytes

    def decode_weights(self) -> int:
        """Weights one decoded token multiplies (quantized ones)."""
        per_layer = HIDDEN * HIDDEN * 2 + 2 * KV_HEADS * HEAD_DIM * HIDDEN + TOP_K * 3 * EXPERT_FFN * HIDDEN
        return LAYERS * per_layer + VOCAB * HIDDEN


def build_model(bits: int, group: int, seed: int = 0) -> Model:
    """A full mixtral-1.7b's worth of distinct quantized matrices."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(LAYERS):
        experts = [ExpertWeights(random_tensor(rng, EXPERT_FFN, HIDDEN, bits, group),
                                 random_tensor(rng, EXPERT_FFN, HIDDEN, bits, group),
                                 random_tensor(rng, HIDDEN, EXPERT_FFN, bits, group)) for _ in range(EXPERTS)]
        kv = KV_HEADS * HEAD_DIM
        layers.append(Layer(random_tensor(rng, HIDDEN, HIDDEN, bits, group), random_tensor(rng, kv, HIDDEN, bits, group),
                            random_tensor(rng, kv, HIDDEN, bits, group), random_tensor(rng, HIDDEN, HIDDEN, bits, group),
                            (rng.standard_normal((EXPERTS, HIDDEN)) * 0.05).astype(np.float32), experts))
    return Model(layers, random_tensor(rng, VOCAB, HIDDEN, bits, group))


def routing(rng: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Random top-k routing: distinct experts per token, weights summing to 1."""
    ids = np.argsort(rng.random((t, EXPERTS)), axis=1)[:, :TOP_K].astype(np.int64)
    w = rng.random((t, TOP_K)).astype(np.float32)
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def run_step(model: Model, x: np.ndarray, rng: np.random.Generator, logits_tokens: int) -> dict[str, float]:
    """The matmuls of one forward step over x [T, hidden] (no attention or norms); seconds by part.

    q, k, v go through one matmul_many call (as the engine should call them), o alone, the router through
    matmul_f32, the routed experts through one moe_experts call per layer."""
    t = {"dense": 0.0, "router": 0.0, "experts": 0.0, "lm_head": 0.0}
    for lay in model.layers:
        ids, w = routing(rng, x.shape[0])
        c = time.perf_counter()
        if SEPARATE_QKV:
            lay.q.matmul(x)
            lay.k.matmul(x)
            lay.v.matmul(x)
        else:
            matmul_many(x, (lay.q, lay.k, lay.v))   # one parallel call for the three that share x
        lay.o.matmul(x)
        c1 = time.perf_counter()
        matmul_f32(x, lay.router)
        c2 = time.perf_counter()
        moe_experts(x, ids, w, lay.experts)
        c3 = time.perf_counter()
        t["dense"] += c1 - c
        t["router"] += c2 - c1
        t["experts"] += c3 - c2
    c = time.perf_counter()
    model.lm_head.matmul(x[-logits_tokens:])
    t["lm_head"] = time.perf_counter() - c
    return t


def median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median of the total, and the parts of the run with the median total."""
    totals = [sum(r.values()) for r in runs]
    mid = runs[int(np.argsort(totals)[len(totals) // 2])]
    return {**mid, "total": float(np.median(totals))}


def bench_decode(model: Model, repeat: int, per_sample: int = 4) -> dict[str, float]:
    """One decoded token's matmuls, T = 1, fresh routing each token; a sample is `per_sample` tokens (long
    enough for the disturbance check's 10 ms clock), undisturbed samples only."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
    run_step(model, x, rng, 1)                                            # warm-up (and first compile)

    def sample() -> dict[str, float]:
        parts = [run_step(model, x, rng, 1) for _ in range(per_sample)]
        return {k: sum(p[k] for p in parts) / per_sample for k in parts[0]}
    return median_parts([CLOCK.run(sample)[1] for _ in range(repeat)])


def bench_prefill(model: Model, repeat: int, tokens: int = 128) -> dict[str, float]:
    """A prompt's matmuls over `tokens` tokens (logits for the last token only, as llama-bench does)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    run_step(model, x, rng, 1)
    return median_parts([CLOCK.run(lambda: run_step(model, x, rng, 1))[1] for _ in range(max(3, repeat // 3))])


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` undisturbed runs after one warm-up."""
    fn()
    return float(np.median([CLOCK.run(fn)[0] for _ in range(repeat)]))


def bench_f32(repeat: int) -> list[str]:
    """matmul_f32 against numpy/BLAS x @ w.T."""
    rng = np.random.default_rng(3)
    lines = []
    for rows in (1024, 32000):
        w = (rng.standard_normal((rows, HIDDEN)) * 0.05).astype(np.float32)
        for t in (1, 128):
            x = rng.standard_normal((t, HIDDEN)).astype(np.float32)
            ours = timed(lambda: matmul_f32(x, w), repeat)
            blas = timed(lambda: x @ w.T, repeat)
            lines.append(f"  {rows:>5}x{HIDDEN} T={t:<3}  matmul_f32 {ours * 1e3:8.3f} ms   BLAS {blas * 1e3:8.3f} ms   "
                         f"ratio {ours / blas:5.2f}   ({2 * rows * HIDDEN * t / ours / 1e9:6.1f} GFLOP/s)")
    return lines


def bench_gemm_vs_blas(bits: int, group: int, repeat: int) -> list[str]:
    """Quantized GEMM (invariant) against BLAS on the same weights already dequantized (not invariant)."""
    rng = np.random.default_rng(4)
    lines = []
    for rows, cols, t in ((HIDDEN, HIDDEN, 128), (EXPERT_FFN, HIDDEN, 16), (VOCAB, HIDDEN, 128)):
        q = random_tensor(rng, rows, cols, bits, group)
        wd = q.dequantize()
        x = rng.standard_normal((t, cols)).astype(np.float32)
        ours = timed(lambda: q.matmul(x), repeat)
        blas = timed(lambda: x @ wd.T, repeat)
        deq = timed(q.dequantize, max(3, repeat // 3))
        lines.append(f"  {rows:>5}x{cols} T={t:<3}  q{bits}.matmul {ours * 1e3:8.3f} ms   BLAS on dequantized {blas * 1e3:8.3f} ms "
                     f"(ratio {ours / blas:4.2f}; numpy dequantize alone {deq * 1e3:.1f} ms)")
    return lines


def report(bits: int, group: int, repeat: int, prefill: bool) -> None:
    """Build the model at one width, run decode and prefill, print the figures."""
    c = time.perf_counter()
    model = build_model(bits, group)
    print(f"\n== {bits}-bit, group {group}: model built in {time.perf_counter() - c:.1f} s; "
          f"{model.decode_bytes() / 1e6:.1f} MB of weights per decoded token "
          f"({model.decode_bytes() * 8 / model.decode_weights():.2f} bits/weight incl. the fp32 router)")
    d = bench_decode(model, repeat)
    gbs = model.decode_bytes() / d["total"] / 1e9
    print(f"decode T=1: {d['total'] * 1e3:.2f} ms/token -> {1 / d['total']:.1f} tok/s (matmuls only), {gbs:.1f} GB/s of weights "
          f"{CLOCK.report()}")
    print("   parts (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in d.items() if k != "total"))
    if prefill:
        p = bench_prefill(model, repeat)
        print(f"prefill T=128: {p['total'] * 1e3:.1f} ms -> {128 / p['total']:.0f} tok/s (matmuls only) {CLOCK.report()}")
        print("   parts (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.items() if k != "total"))
    del model
    print("quantized GEMM against BLAS on dequantized weights:")
    print("\n".join(bench_gemm_vs_blas(bits, group, repeat)) + " " + CLOCK.report())


def main() -> None:
    """Parse arguments and print every benchmark."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--separate-qkv", action="store_true", help="q, k, v as three calls instead of matmul_many")
    args = ap.parse_args()
    global SEPARATE_QKV
    SEPARATE_QKV = args.separate_qkv
    numba.set_num_threads(args.threads)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads)
    except ImportError:
        pass
    print(f"threads {args.threads}; load average {os.getloadavg()[0]:.2f} (quiet machine: < 0.5)")
    for bits in args.bits:
        report(bits, args.group, args.repeat, not args.skip_prefill)
    print("\nmatmul_f32 against BLAS:")
    print("\n".join(bench_f32(args.repeat)) + " " + CLOCK.report())


if __name__ == "__main__":
    main()
