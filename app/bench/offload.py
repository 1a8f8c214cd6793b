"""Benchmarking streaming: cold, warm and page-fault decode against the I/O roofline, and routing traces.

A workload is a few chats: probe prompts from `assets/probes` (topics in turn), each answered with
greedy decode steps. The cold run starts with the page cache dropped and no usage history; the
warm run starts from the history the cold run taught (page cache dropped again, so only learned
pins make it faster); the mmap run is the page-fault baseline. Each reports decode tok/s, the
expert bytes missed per decoded token, and the I/O roofline: the decode speed the disk allows
when every missed byte must be read (bandwidth measured on the spot, same threads and read size).
A resident run of the same chats, when the machine holds every weight, gives the compute bound:
reads overlapped with compute at best, a streamed run decodes as fast as the slower of the two.

A dense container has no experts to cache: under a budget its decoder layers past the first few are
streamed (engine/offload/layers.py), every one read once a token. Its cold run starts with the page cache
dropped, its warm run right after the cold one (the page cache as the cold run left it: with O_DIRECT reads
the two match); the I/O roofline is the disk bandwidth over the bytes a decoded token reads.

A trace is every layer step's distinct experts, recorded during the cold run. Replaying it
through each policy and Belady's optimum at several cache sizes compares the policies on the
same requests: the history of the first half of the chats is the learned policy's prior, and
all policies are scored on the second half.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from engine.errors import ColibriError

Log = Callable[[str], None]
TRACE_FORMAT = "colibri-routing-trace"


@dataclass(frozen=True)
class StreamRun:
    """One pass of the workload under a budget."""

    label: str                      # cold | warm | mmap
    io: str
    policy: str
    prefetch_depth: int
    prompt_tokens: int
    decode_tokens: int
    prompt_tok_s: float
    decode_tok_s: float
    hit_rate: float                 # expert requests served from memory, during decode
    missed_bytes_per_token: float   # bytes of the experts a decoded token asked for and did not find in memory
    read_bytes_per_token: float     # bytes read per decoded token (misses and reads ahead)
    disk_gb_s: float                # measured read bandwidth (the roofline's denominator)
    io_roofline_tok_s: float        # disk bandwidth / missed bytes per token
    roofline_fraction: float        # decode_tok_s / io_roofline_tok_s
    prefetch_recall: float
    prefetch_precision: float
    io_wait_ms: float               # per decoded token
    experts_ms: float
    attention_ms: float
    dense_ms: float
    other_ms: float
    peak_rss: int                   # bytes, this process, at the end of the run
    ttft_s: float = 0.0             # seconds from a chat's prompt to its first token's logits, the chats' mean

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON values."""
        return asdict(self)


@dataclass(frozen=True)
class LayerRun:
    """One pass of the workload over a dense model whose layers past `resident_layers` are streamed."""

    label: str                      # cold | warm
    io: str
    resident_layers: int
    streamed_layers: int
    prefetch_depth: int
    prompt_tokens: int
    decode_tokens: int
    ttft_s: float                   # seconds from a chat's prompt to its first token's logits, the chats' mean
    first_ttft_s: float             # the first chat's: the load's cold start included in nothing but the reads
    prompt_tok_s: float
    decode_tok_s: float
    read_bytes_per_token: float     # layer bytes read from the disk per decoded token
    disk_gb_s: float                # measured read bandwidth (the roofline's denominator)
    io_roofline_tok_s: float        # disk bandwidth / bytes read per token
    roofline_fraction: float        # decode_tok_s / io_roofline_tok_s
    io_wait_ms: float               # per decoded token: the engine waiting for a layer's read
    compute_ms: float               # per decoded token: the rest
    peak_rss: int                   # bytes, this process, at the end of the run

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON values."""
        return asdict(self)


def workload(tokenizer, n_chats: int, vocab: int) -> list[list[int]]:
    """Prompts of `n_chats` chats: one probe prompt per topic in turn, tokenized (no chat template needed)."""
    from app.atlas.probes import load_probes

    topics = load_probes()
    prompts = []
    for i in range(n_chats):
        topic = topics[i % len(topics)]
        text = topic.prompts[(i // len(topics)) % len(topic.prompts)]
        ids = tokenizer.encode(text) if tokenizer is not None else list(range(1, 33))
        prompts.append([t % vocab for t in ids][:256])
    return prompts


def drop_caches(folder: Path) -> None:
    """Evict the container's files from the page cache (the cold start)."""
    from engine.offload.io import drop_file_cache

    for path in sorted(Path(folder).iterdir()):
        if path.suffix == ".bin":
            drop_file_cache(str(path))


DISK_REPEATS = 3   # a virtual disk's speed wanders from one run to the next: the best of a few


def disk_bandwidth(folder: Path, block: int, threads: int, repeats: int = DISK_REPEATS) -> float:
    """Cold read bandwidth of the largest experts file in GB/s, in `block`-byte reads on `threads` threads: the
    best of `repeats` measurements (the roofline is then the fastest the disk was seen to read)."""
    return max(_disk_once(folder, block, threads) for _ in range(max(1, repeats)))


def _disk_once(folder: Path, block: int, threads: int) -> float:
    from engine.offload.io import measure_read_bandwidth

    # a dense container's streamed layers are read from dense.bin
    files = sorted(Path(folder).glob("experts-*.bin"), key=lambda p: p.stat().st_size) or \
        [p for p in [Path(folder) / "dense.bin"] if p.is_file()]
    if not files:
        raise ColibriError(f"{folder}: no experts file nor dense.bin; the streaming bench needs a Colibri container "
                           f"(`colibri convert {folder} OUT --bits 4`)")
    return measure_read_bandwidth(str(files[-1]), nbytes=min(512 << 20, files[-1].stat().st_size), block=block,
                                  threads=threads) / 1e9


def _proc_bytes(path: str, key: str) -> int | None:
    """A 'Key: N kB' line of a Linux /proc file, in bytes (None where there is no such file or line)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss() -> int:
    return _proc_bytes("/proc/self/status", "VmHWM:") or 0


def _reset_peak_rss() -> None:
    try:                                             # peak RSS from here on (Linux: reset the high-water mark)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run_workload(path: Path, offload, prompts: list[list[int]], gen: int, label: str, disk_gb_s: float,
                 trace: list | None = None, log: Log = lambda m: None) -> StreamRun:
    """Load `path` streaming with `offload` (engine.loader.OffloadOptions), answer every prompt, measure."""
    from engine.loader import load_model
    from engine.telemetry import Telemetry

    drop_caches(path)
    _reset_peak_rss()
    telemetry = Telemetry()
    loaded = load_model(path, offload=offload, telemetry=telemetry)
    try:
        store, model = loaded.store, loaded.model
        prompt_s = decode_s = 0.0
        n_prompt = n_decode = 0
        ttfts = []
        hits0 = {"pinned": 0, "cached": 0, "disk": 0}
        decode_hits = dict(hits0)
        decode_bytes = 0
        phases = {k: 0.0 for k in ("io_wait", "experts", "attention", "dense", "other")}
        for c, ids in enumerate(prompts):
            if trace is not None:                    # one list of layer steps per chat
                store.trace = []
                trace.append(store.trace)
            before = None

            def decoding() -> None:
                nonlocal before
                before = store.stats()
                telemetry.reset()
            p_s, d_s = answer(model, ids, gen, decoding)
            prompt_s, decode_s = prompt_s + p_s, decode_s + d_s
            ttfts.append(p_s)
            n_prompt += len(ids)
            n_decode += gen
            after = store.stats()
            for tier in decode_hits:
                decode_hits[tier] += after.hits[tier] - before.hits[tier]
            decode_bytes += after.bytes_read - before.bytes_read
            snap = telemetry.snapshot()
            for k in phases:
                phases[k] += snap.averages.get(k, 0.0) * gen
            log(f"{label}: chat {c + 1}/{len(prompts)}: {gen / max(d_s, 1e-9):.1f} tok/s decode")
        stats = store.stats()
        expert_bytes = sum(r.length for r in store.recipes.values()) / len(store.recipes)
    finally:
        loaded.close()
    total = sum(decode_hits.values())
    hit_rate = (decode_hits["pinned"] + decode_hits["cached"]) / total if total else 0.0
    read = decode_bytes / n_decode
    missed = decode_hits["disk"] * expert_bytes / n_decode
    roof = disk_gb_s * 1e9 / missed if missed else float("inf")
    decode_tok_s = n_decode / decode_s
    ms = lambda k: phases[k] / n_decode * 1e3  # noqa: E731
    return StreamRun(label, offload.store.io, offload.store.policy, offload.prefetch_depth, n_prompt, n_decode,
                     n_prompt / prompt_s, decode_tok_s, hit_rate, missed, read, disk_gb_s, roof,
                     decode_tok_s / roof if roof != float("inf") else 0.0, stats.prefetch.recall,
                     stats.prefetch.precision, ms("io_wait"), ms("experts"), ms("attention"), ms("dense"),
                     ms("other"), _rss(), float(np.mean(ttfts)))


def run_layer_workload(path: Path, offload, prompts: list[list[int]], gen: int, label: str, disk_gb_s: float,
                       cold: bool = True, log: Log = lambda m: None) -> LayerRun:
    """Load the dense container at `path` with its layers streamed under `offload` (engine.loader.OffloadOptions),
    answer every prompt, measure; `cold`: drop the container's pages from the page cache first."""
    from engine.loader import load_model

    if cold:
        drop_caches(path)
    _reset_peak_rss()
    loaded = load_model(path, offload=offload)
    try:
        store, model = loaded.store, loaded.model
        if store is None or not hasattr(store, "streamed"):
            raise ColibriError(f"{path}: the budget holds every layer, nothing is streamed; give a smaller "
                               "--max-memory (or --resident-layers) to measure streaming")
        prompt_s = decode_s = wait_s = 0.0
        n_prompt = n_decode = read = 0
        ttfts = []
        for c, ids in enumerate(prompts):
            before = None

            def decoding() -> None:
                nonlocal before
                before = store.stats()
            p_s, d_s = answer(model, ids, gen, decoding)
            after = store.stats()
            prompt_s, decode_s = prompt_s + p_s, decode_s + d_s
            ttfts.append(p_s)
            n_prompt += len(ids)
            n_decode += gen
            read += after.bytes_read - before.bytes_read
            wait_s += after.wait_seconds - before.wait_seconds
            log(f"{label}: chat {c + 1}/{len(prompts)}: TTFT {p_s:.1f} s, {gen / max(d_s, 1e-9):.3f} tok/s decode")
        resident, streamed = store.resident_layers, len(store.streamed)
    finally:
        loaded.close()
    per_token = read / n_decode
    roof = disk_gb_s * 1e9 / per_token if per_token else float("inf")
    decode_tok_s = n_decode / decode_s
    return LayerRun(label, offload.store.io, resident, streamed, offload.prefetch_depth, n_prompt, n_decode,
                    float(np.mean(ttfts)), ttfts[0], n_prompt / prompt_s, decode_tok_s, per_token, disk_gb_s, roof,
                    decode_tok_s / roof if roof != float("inf") else 0.0, wait_s / n_decode * 1e3,
                    (decode_s - wait_s) / n_decode * 1e3, _rss())


def format_layer_runs(runs: list[LayerRun]) -> str:
    """The report of a dense model streamed layer by layer."""
    lines = []
    for r in runs:
        lines.append(
            f"  {r.label:5s} io={r.io:5s} {r.resident_layers} layers held, {r.streamed_layers} streamed, depth "
            f"{r.prefetch_depth}: decode {r.decode_tok_s:6.3f} tok/s, TTFT {r.ttft_s:5.1f} s (first chat "
            f"{r.first_ttft_s:.1f} s), prompt {r.prompt_tok_s:6.1f} tok/s, {r.read_bytes_per_token / 1e9:.2f} GB "
            f"read/token, I/O roofline {r.io_roofline_tok_s:6.3f} tok/s at {r.disk_gb_s:.2f} GB/s -> "
            f"{r.roofline_fraction * 100:5.1f}%; per token io wait {r.io_wait_ms:.0f} ms, compute {r.compute_ms:.0f} "
            f"ms; peak RSS {r.peak_rss / 1e6:.0f} MB")
    by = {r.label: r for r in runs}
    if "cold" in by and "warm" in by:
        lines.append(f"  warm/cold decode: {by['warm'].decode_tok_s / by['cold'].decode_tok_s:.2f}x")
    return "\n".join(lines)


def answer(model, ids: list[int], gen: int, decoding: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """One chat: the prompt `ids`, then `gen` greedy tokens (`decoding()` called in between); (prompt seconds,
    decode seconds)."""
    from engine.kv import KVCache

    cache = KVCache(model.spec, len(ids) + gen + 1)
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)[-1]
    prompt_s = time.perf_counter() - t0
    decoding()
    token = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(gen):
        token = int(np.argmax(model.forward([token], cache)[-1]))
    return prompt_s, time.perf_counter() - t0


RESIDENT_PASSES = 3   # the resident run's passes over the chats, its figure their median


def resident_decode(path: Path, prompts: list[list[int]], gen: int, log: Log = lambda m: None,
                    passes: int = RESIDENT_PASSES) -> float | None:
    """Decode tok/s of the same chats with every weight in memory (the compute bound): the median of `passes`
    passes over them in one load, or None when the weights take more than half the memory the system has
    available (a resident run would page).

    One pass is about a second, short enough for a neighbour on a shared machine to slow it alone; a median
    over passes stands against such a disturbance of one pass (the streamed runs, of a minute each, average
    theirs out)."""
    from engine.loader import load_model

    size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    available = _available_memory()
    if available is None or size > available // 2:
        log(f"resident: skipped ({size / 1e9:.1f} GB of weights, {0 if available is None else available / 1e9:.1f} "
            "GB available)")
        return None
    # from a cold page cache, as a fresh load: the load reads (checks) every weight through maps on 2 MB pages, where
    # pages an earlier run left in the cache would stay 4 KB ones (the `--io mmap` run's faults), slower to compute on
    drop_caches(path)
    loaded = load_model(path)
    try:
        rates = [len(prompts) * gen / sum(answer(loaded.model, ids, gen)[1] for ids in prompts)
                 for _ in range(max(1, passes))]
    finally:
        loaded.close()
    rate = float(np.median(rates))
    log(f"resident: {rate:.1f} tok/s decode (the median of {len(rates)} passes: "
        f"{', '.join(f'{r:.1f}' for r in rates)})")
    return rate


def _available_memory() -> int | None:
    return _proc_bytes("/proc/meminfo", "MemAvailable:")


# ---- traces -----------------------------------------------------------------------------------


def save_trace(path: Path, model_hash: str, n_layers: int, n_experts: int, chats: list[list]) -> None:
    """Write a trace (per chat: the layer steps) as JSON, atomically."""
    data = {"format": TRACE_FORMAT, "version": 1, "model_hash": model_hash, "n_layers": n_layers,
            "n_experts": n_experts, "chats": [[[layer, list(ids)] for layer, ids in chat] for chat in chats]}
    from engine.atomic import atomic_file

    with atomic_file(path) as f:
        json.dump(data, f)


def load_trace(path: Path) -> dict:
    """Read a trace written by save_trace; ColibriError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ColibriError(f"{path}: not a readable routing trace ({exc}); record one with `colibri bench --trace FILE`") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise ColibriError(f"{path}: not a Colibri routing trace; record one with `colibri bench --trace FILE`")
    data["chats"] = [[(int(layer), tuple(int(i) for i in ids)) for layer, ids in chat] for chat in data["chats"]]
    return data


@dataclass(frozen=True)
class ReplayRow:
    """Hit rates of every policy at one cache size."""

    fraction: float                 # cache size as a share of all experts
    capacity: int                   # experts
    lru: float
    lfru: float
    learned: float
    belady: float
    half_life: float = 0.0          # tokens: the learned policy's, learned on the first half


def replay(trace: dict, fractions=(0.1, 0.25, 0.5), pin_fraction: float | None = None) -> list[ReplayRow]:
    """Hit rates on the second half of the chats. The learned policy learns from the first half only, as the
    store does from earlier sessions: its prior (usage counts), its pins, and its half-life (the one that
    served the first half best, `tune_half_life`)."""
    from engine.offload.policy import (
        DEFAULT_HALF_LIFE_TOKENS,
        belady,
        make_policy,
        simulate,
        tune_half_life,
        wants_admission,
    )
    from engine.offload.store_types import StoreSettings

    pin_fraction = StoreSettings(0).pin_fraction if pin_fraction is None else pin_fraction
    chats = trace["chats"]
    if len(chats) < 2:
        raise ColibriError("a trace needs at least two chats to replay (one teaches, one is scored)")
    n_layers, n_experts = trace["n_layers"], trace["n_experts"]
    half = len(chats) // 2
    prior = np.zeros((n_layers, n_experts))
    for chat in chats[:half]:
        for layer, ids in chat:
            prior[layer, list(ids)] += 1
    teach = [step for chat in chats[:half] for step in chat]
    test = [step for chat in chats[half:] for step in chat]
    total = n_layers * n_experts
    per_token = max(sum(len(ids) for _, ids in chat[-n_layers:]) for chat in chats)   # a decode token's experts
    rows = []
    for f in fractions:
        cap = max(1, int(round(f * total)))
        n_pin = int(cap * pin_fraction)
        order = np.argsort(-prior, axis=None, kind="stable")[:n_pin]
        pinned = frozenset((int(i // n_experts), int(i % n_experts)) for i in order if prior.flat[i] > 0)
        admission = wants_admission(cap, per_token)
        rate = lambda r: r.hit_rate  # noqa: E731
        tokens = tune_half_life(teach, cap, n_layers, prior, pinned, admission)
        # pins are read from disk once too (at start): their first use counts as a miss, as every policy's does
        learned = simulate(test, cap, make_policy("learned", prior, half_life=tokens * n_layers, admission=admission),
                           pinned)
        first_uses = len(pinned & {(layer, i) for layer, ids in test for i in ids})
        rows.append(ReplayRow(
            f, cap,
            rate(simulate(test, cap, make_policy("lru"))),
            rate(simulate(test, cap, make_policy("lfru", half_life=DEFAULT_HALF_LIFE_TOKENS * n_layers,
                                                 admission=admission))),
            (learned.hits - first_uses) / learned.accesses if learned.accesses else 0.0,
            rate(belady(test, cap)),
            tokens,
        ))
    return rows


def format_replay(rows: list[ReplayRow]) -> str:
    """The replay table."""
    lines = ["cache          LRU    LFRU   learned  Belady   learned/Belady  learned half-life"]
    for r in rows:
        lines.append(f"{r.fraction * 100:4.0f}% {r.capacity:6d}  {r.lru * 100:5.1f}%  {r.lfru * 100:5.1f}%  "
                     f"{r.learned * 100:6.1f}%  {r.belady * 100:5.1f}%   {r.learned / r.belady * 100 if r.belady else 0:5.1f}%"
                     f"          {r.half_life:g} tokens")
    return "\n".join(lines)


def format_runs(runs: list[StreamRun], resident_tok_s: float | None = None) -> str:
    """The streaming report."""
    lines = []
    if resident_tok_s:
        bound = lambda r: min(r.io_roofline_tok_s, resident_tok_s)  # noqa: E731
        lines.append(f"  resident (every weight in memory): decode {resident_tok_s:6.2f} tok/s; against the slower of "
                     "it and the I/O roofline: " + ", ".join(f"{r.label} {r.decode_tok_s / bound(r) * 100:.1f}%"
                                                              for r in runs))
    for r in runs:
        lines.append(
            f"  {r.label:5s} io={r.io:5s} {r.policy:7s} depth {r.prefetch_depth}: decode {r.decode_tok_s:6.2f} tok/s, "
            f"prompt {r.prompt_tok_s:6.1f} tok/s, hit rate {r.hit_rate * 100:5.1f}%, {r.missed_bytes_per_token / 1e6:6.1f} MB "
            f"missed/token, I/O roofline {r.io_roofline_tok_s:6.2f} tok/s at {r.disk_gb_s:.2f} GB/s "
            f"-> {r.roofline_fraction * 100:5.1f}% ({r.read_bytes_per_token / 1e6:.1f} MB read/token with reads ahead); "
            f"lookahead recall {r.prefetch_recall * 100:4.1f}% precision "
            f"{r.prefetch_precision * 100:4.1f}%; per token io wait {r.io_wait_ms:.1f} ms, experts {r.experts_ms:.1f} ms, "
            f"attention {r.attention_ms:.1f} ms, dense {r.dense_ms:.1f} ms; TTFT {r.ttft_s:.1f} s; "
            f"peak RSS {r.peak_rss / 1e6:.0f} MB")
    by = {r.label: r for r in runs}
    if "cold" in by and "mmap" in by and by["mmap"].decode_tok_s:
        lines.append(f"  pread/mmap decode: {by['cold'].decode_tok_s / by['mmap'].decode_tok_s:.1f}x")
    if "cold" in by and "warm" in by:
        lines.append(f"  warm/cold decode: {by['warm'].decode_tok_s / by['cold'].decode_tok_s:.2f}x")
    return "\n".join(lines)
