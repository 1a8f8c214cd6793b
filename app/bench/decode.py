"""Measuring a loaded model: prompt and decode speed, weight bytes read per token, the RAM roofline.

Functions rather than a command, so that `colibri bench`, `colibri plan` and the GUI share them:
`measure_bandwidth` times a parallel read of a large array, `decode_bytes_per_token` counts what
one decode step reads from the model's weights, `bench_model` times prompt and decode runs.
Thread counts (numba and BLAS) are set only for the duration of a call and restored after.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from engine.errors import ColibriError

BANDWIDTH_BYTES = 1 << 30   # read by measure_bandwidth: far larger than any cache
DEFAULT_THREADS = 2


@dataclass(frozen=True)
class BenchResult:
    """What `bench_model` measured; speeds are medians over the runs."""

    model: str
    architecture: str
    threads: int
    prompt_tokens: int                     # tokens per prompt run
    gen_tokens: int                        # greedy decode steps per run
    runs: int
    prompt_tok_s: float
    decode_tok_s: float
    prompt_tok_s_runs: tuple[float, ...]
    decode_tok_s_runs: tuple[float, ...]
    weight_bytes: int                      # every resident weight
    bytes_per_token: int                   # weight bytes one decode step reads
    achieved_gb_s: float                   # bytes_per_token x decode_tok_s
    ram_gb_s: float                        # RAM read bandwidth measured with the same threads
    roofline_fraction: float               # achieved_gb_s / ram_gb_s
    roofline_decode_tok_s: float           # ram_gb_s / bytes_per_token: decode if only reads cost
    kv_bits: int = 32                      # how the KV cache stored keys and values (32, 16 or 8)
    rss: int = 0                           # the process's resident bytes after the timed runs, the largest (0: unknown)
    model_bytes: int = 0                   # the model's bytes on disk (0: unknown)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}


# ---- threads --------------------------------------------------------------------------------


def check_threads(threads: int) -> None:
    """Refuse a thread count numba cannot run."""
    import numba

    if threads < 1:
        raise ColibriError(f"--threads {threads}: must be at least 1")
    most = numba.config.NUMBA_NUM_THREADS
    if threads > most:
        raise ColibriError(f"--threads {threads}: numba was started with at most {most} threads; "
                           f"pass --threads {most} or less, or set NUMBA_NUM_THREADS={threads} before starting")


@contextmanager
def thread_limits(threads: int) -> Iterator[None]:
    """Run the body with `threads` numba threads and BLAS threads; restore both after."""
    import numba
    from threadpoolctl import threadpool_limits

    check_threads(threads)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads, user_api="blas"):
            yield
    finally:
        numba.set_num_threads(before)


# ---- RAM bandwidth --------------------------------------------------------------------------

_sum_kernel = None


def reduction_kernel():
    """The numba reduction, compiled (or read from numba's cache) on first use, not at import."""
    global _sum_kernel
    if _sum_kernel is None:
        from numba import njit, prange

        @njit(parallel=True, fastmath=True, cache=True)
        def read_all(a):  # pragma: no cover - compiled
            total = np.float32(0.0)
            for i in prange(a.size):
                total += a[i]
            return total

        _sum_kernel = read_all
    return _sum_kernel


def measure_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 5, threads: int | None = None) -> float:
    """RAM read bandwidth in GB/s (1e9 bytes): the best of `repeats` parallel sums over `nbytes`."""
    if nbytes < 4096 or repeats < 1:
        raise ColibriError("measure_bandwidth needs at least 4 KiB and one repeat")
    if threads is not None:
        with thread_limits(threads):
            return measure_bandwidth(nbytes, repeats)
    kernel = reduction_kernel()
    data = np.ones(nbytes // 4, np.float32)   # [N]; writing it maps every page before timing
    kernel(data[:1024])                       # compile outside the timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        kernel(data)
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 1e9


# ---- bytes per token ------------------------------------------------------------------------


def _is_weight(value: Any) -> bool:
    # float32 arrays, and quantized tensors (which bring their own matmul and nbytes)
    return isinstance(value, np.ndarray) or (hasattr(value, "matmul") and hasattr(value, "nbytes"))


def _block_bytes(block: Any) -> int:
    """Bytes of the weights a block holds directly (arrays, quantized tensors, shared experts)."""
    from engine.blocks.ffn import ExpertWeights

    total = 0
    for f in dataclasses.fields(block):
        value = getattr(block, f.name)
        if isinstance(value, ExpertWeights) or _is_weight(value):
            total += int(value.nbytes)
    return total


def _routed_expert_bytes(model: Any, layer: int, n_experts: int) -> float:
    """The average bytes of one routed expert of a layer."""
    held = model.experts.experts(layer, list(range(n_experts)))
    return sum(int(e.nbytes) for e in held.values()) / n_experts


def decode_bytes_per_token(model: Any) -> int:
    """Weight bytes one decode step reads: dense blocks, top_k average routed experts, lm_head, one embedding row."""
    from engine.blocks.ffn import MoE

    total = int(model.norm.nbytes) + int(model.lm_head.nbytes) + int(model.embed.nbytes) // model.spec.vocab_size
    for i, layer in enumerate(model.layers):
        total += layer.norm_bytes + _block_bytes(layer.attn)
        total += _block_bytes(layer.ffn)
        if isinstance(layer.ffn, MoE):
            s = layer.ffn.spec
            total += round(s.top_k * _routed_expert_bytes(model, i, s.n_experts))
    return total


def model_weight_bytes(model: Any) -> int:
    """Bytes of every weight the model holds (the tied head counted once)."""
    from engine.blocks.ffn import MoE

    total = int(model.norm.nbytes) + int(model.embed.nbytes)
    if model.lm_head is not model.embed:
        total += int(model.lm_head.nbytes)
    for i, layer in enumerate(model.layers):
        total += layer.norm_bytes
        total += _block_bytes(layer.attn) + _block_bytes(layer.ffn)
        if isinstance(layer.ffn, MoE):
            total += round(layer.ffn.spec.n_experts * _routed_expert_bytes(model, i, layer.ffn.spec.n_experts))
    return total


# ---- timing ---------------------------------------------------------------------------------


def random_prompt(loaded: Any, n: int, seed: int = 0) -> list[int]:
    """n seeded random token ids from the model's vocabulary, never a special or end-of-sequence id."""
    spec = loaded.spec
    special = set(loaded.stop_ids) | set(spec.eos_token_ids)
    if spec.bos_token_id is not None:
        special.add(spec.bos_token_id)
    if loaded.tokenizer is not None:
        special |= set(loaded.tokenizer.special_ids)
    candidates = np.setdiff1d(np.arange(spec.vocab_size), np.fromiter(special, np.int64, len(special)))
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(candidates, size=n)]


def _one_run(model: Any, prompt: list[int], gen: int, kv_bits: int = 32) -> tuple[float, float]:
    """(prompt tok/s, decode tok/s) of one prompt pass and `gen` greedy single-token steps."""
    from engine.generation.prefill import prefill
    from engine.kv import KVCache, KVPool, blocks_for

    n = len(prompt) + gen
    cache = KVCache(model.spec, n, pool=KVPool(model.spec, blocks_for(n) + 1, bits=kv_bits, prefix_cache=False))
    t0 = time.perf_counter()
    logits = prefill(model, prompt, cache)                    # [V]
    t1 = time.perf_counter()
    token = int(np.argmax(logits))
    for _ in range(gen):
        token = int(np.argmax(model.forward([token], cache)[-1]))
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), gen / (t2 - t1)


def bench_model(
    loaded: Any,
    *,
    prompt: int = 128,
    gen: int = 64,
    runs: int = 3,
    threads: int = DEFAULT_THREADS,
    seed: int = 0,
    ram_gb_s: float | None = None,
    on_run: Callable[[int, int], None] | None = None,
    kv_bits: int = 32,
) -> BenchResult:
    """Time a warm-up and `runs` runs of a `prompt`-token prompt plus `gen` decode steps on a LoadedModel.

    `ram_gb_s` skips the bandwidth measurement when the caller already has the figure;
    `on_run(done, total)` is called before each run (the warm-up is run 0).
    """
    for flag, value in (("--prompt", prompt), ("--gen", gen), ("--runs", runs)):
        if value < 1:
            raise ColibriError(f"{flag} {value}: must be at least 1")
    limit = loaded.spec.max_position
    if prompt + gen > limit:
        raise ColibriError(f"--prompt {prompt} plus --gen {gen} is {prompt + gen} tokens but the model's context "
                           f"holds {limit}; ask for fewer tokens")
    ids = random_prompt(loaded, prompt, seed)
    from app.library import disk_size
    from app.plan.budget import process_rss

    rss = 0
    with thread_limits(threads):
        speeds = []
        for r in range(runs + 1):
            if on_run is not None:
                on_run(r, runs)
            speed = _one_run(loaded.model, ids, gen, kv_bits)
            if r:  # run 0 is the warm-up: compiles kernels (the compiler's memory is not the model's), fills caches
                speeds.append(speed)
                rss = max(rss, process_rss())
        if ram_gb_s is None:
            ram_gb_s = measure_bandwidth()
    prompt_runs = tuple(p for p, _ in speeds)
    decode_runs = tuple(d for _, d in speeds)
    decode = statistics.median(decode_runs)
    per_token = decode_bytes_per_token(loaded.model)
    achieved = per_token * decode / 1e9
    return BenchResult(
        model=loaded.name, architecture=loaded.spec.architecture, threads=threads,
        prompt_tokens=prompt, gen_tokens=gen, runs=runs,
        prompt_tok_s=statistics.median(prompt_runs), decode_tok_s=decode,
        prompt_tok_s_runs=prompt_runs, decode_tok_s_runs=decode_runs,
        weight_bytes=model_weight_bytes(loaded.model), bytes_per_token=per_token,
        achieved_gb_s=achieved, ram_gb_s=ram_gb_s, roofline_fraction=achieved / ram_gb_s,
        roofline_decode_tok_s=ram_gb_s * 1e9 / per_token, kv_bits=kv_bits,
        rss=rss, model_bytes=disk_size(loaded.path),
    )

