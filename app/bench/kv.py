"""`colibri bench MODEL --kv`: what the paged KV cache buys, measured.

- prefix reuse: time to first token of 50-token questions after an 800-token system prompt, with
  the prompt's blocks cached against computed afresh, and each run against the ideal (the ratio of
  tokens prefilled);
- batching: throughput (prompt and answer) of 1, 2, 4, 8 chats together against the same chats one
  after another;
- block size: the attention kernel's decode and prefill time at a long context for each block size;
- int8 KV: its error against float32 on held-out text (KL divergence and top-1 agreement);
- retention: a fact stated early in a document longer than the context, asked about at the end,
  with `--overflow retain` against `slide` (and the full context as the reference).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from app.bench.decode import random_prompt
from engine.generation.generate import GenerationRequest
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import Scheduler
from engine.kv import BLOCK_SIZE, KVCache, KVPool, blocks_for

Log = Callable[[str], None]


@dataclass
class KVReport:
    """Every figure of the KV bench (None where a part was skipped)."""

    ttft_uncached_s: float = 0.0
    ttft_cached_s: float = 0.0
    ideal_fraction: float = 0.0          # prefilled tokens cached / uncached
    ttft_runs: list[tuple[float, float]] = field(default_factory=list)    # each run's (uncached, cached) TTFT
    batch: dict[int, tuple[float, float]] = field(default_factory=dict)   # chats -> (sequential, batched) tok/s
    # chats -> the union's bound (experts): one sequence's decoded weight bytes times n over a batched step's, with
    # dense weights read once and each expert the step's rows chose once (the experts its steps chose, measured)
    batch_bound: dict[int, float] = field(default_factory=dict)
    # chats -> (seconds per decoded row one after another, together): the decode steps alone, which the union's
    # bound is about (a prompt's rows cost the same together or apart)
    batch_decode: dict[int, tuple[float, float]] = field(default_factory=dict)
    # chats -> how many ran at once, where fewer than all (streamed experts: the cache holds a step of so many)
    batch_room: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, tuple[float, float]] = field(default_factory=dict)  # block size -> (decode us, prefill ms)
    int8_kl: float | None = None
    int8_top1: float | None = None
    int8_bytes_ratio: float | None = None
    retention: dict[str, tuple[int, int]] = field(default_factory=dict)  # mode -> (found, trials)
    retention_ppl: dict[str, float] = field(default_factory=dict)        # mode -> perplexity past the context

    @property
    def ttft_ideal_s(self) -> float:
        return self.ttft_uncached_s * self.ideal_fraction

    @property
    def ideal_shares(self) -> list[float]:
        """Each run's share of the ideal: its uncached TTFT times the prefill ratio over its cached TTFT."""
        return [fresh * self.ideal_fraction / cached for fresh, cached in self.ttft_runs if cached]

    def lines(self) -> list[str]:
        out = []
        if self.ttft_uncached_s:
            share = self.ttft_ideal_s / self.ttft_cached_s if self.ttft_cached_s else 0.0
            runs = " ".join(f"{s * 100:.0f}%" for s in self.ideal_shares)
            out.append(f"prefix reuse  TTFT {self.ttft_uncached_s:.3f} s uncached -> {self.ttft_cached_s:.3f} s cached "
                       f"(medians); ideal {self.ttft_ideal_s:.3f} s (prefill ratio {self.ideal_fraction:.3f}): "
                       f"{share * 100:.0f}% of the ideal; each run {runs}")
        for n, (seq, bat) in sorted(self.batch.items()):
            bound = self.batch_bound.get(n)
            against = f"; the union's bound {bound:.2f}x ({bat / seq / bound * 100:.0f}%)" if bound else ""
            if n in self.batch_decode:
                alone, together = self.batch_decode[n]
                gain = alone / together
                against += f"; decode steps {gain:.2f}x" + (f" ({gain / bound * 100:.0f}% of the bound)" if bound else "")
            room = self.batch_room.get(n)
            at_once = f" ({room} at once: the expert cache holds the steps of so many)" if room else ""
            out.append(f"batching      {n} chats: {seq:6.1f} tok/s one after another, {bat:6.1f} tok/s together "
                       f"= {bat / seq:.2f}x (prompt and answer){against}{at_once}")
        for b, (dec, pre) in sorted(self.blocks.items()):
            out.append(f"block size    {b:4d}: decode attention {dec:8.1f} us/layer, prefill chunk {pre:7.2f} ms/layer")
        if self.int8_kl is not None:
            out.append(f"int8 KV       KL {self.int8_kl:.5f} nats/token, top-1 agreement {self.int8_top1 * 100:.1f}%, "
                       f"{self.int8_bytes_ratio * 100:.0f}% of the float32 bytes")
        for mode, (found, trials) in self.retention.items():
            out.append(f"retention     {mode:6s}: the early fact recalled in {found}/{trials} long documents")
        for mode, ppl in self.retention_ppl.items():
            out.append(f"retention     {mode:6s}: perplexity {ppl:.2f} on text four times the context")
        return out


def _ttft(loaded, pool: KVPool, prompt: list[int], ctx: int) -> float:
    sched = Scheduler(loaded.model, pool, max_len=ctx)
    t0 = time.perf_counter()
    seq = sched.submit(GenerationRequest(prompt=tuple(prompt), max_tokens=1))
    sched.run()
    assert seq.done
    return time.perf_counter() - t0


def prefix_ttft(loaded, report: KVReport, system: int = 800, question: int = 50, trials: int = 5,
                block: int = BLOCK_SIZE, log: Log = print) -> None:
    """TTFT of question after system prompt: computed afresh each time against with the system prompt cached,
    `trials` runs each, taking turns (run i of each is paired for its share of the ideal).

    Skipped (and said so) for a model with recurrent layers: its blocks cannot rebuild their state, so engine.kv
    neither publishes nor adopts them and there is no reuse to measure."""
    if loaded.spec.is_recurrent:
        log("prefix reuse  (skipped: recurrent layers keep a state that cached blocks cannot rebuild)")
        return
    ctx = system + question + 8
    sys_ids = random_prompt(loaded, system, seed=1)
    questions = [random_prompt(loaded, question, seed=10 + i) for i in range(trials + 1)]
    pool = KVPool(loaded.spec, 4 * (blocks_for(ctx, block) + 2), block)
    _ttft(loaded, pool, sys_ids + questions[0], ctx)           # the first question computes the system prompt
    fresh, cached = [], []
    for q in questions[1:]:     # in turns, so that a change of the machine's load falls on both alike
        fresh.append(_ttft(loaded, KVPool(loaded.spec, blocks_for(ctx, block) + 2, block), sys_ids + q, ctx))
        cached.append(_ttft(loaded, pool, sys_ids + q, ctx))
    held = (system // block) * block
    report.ttft_runs = list(zip(fresh, cached))
    report.ttft_uncached_s = float(np.median(fresh))
    report.ttft_cached_s = float(np.median(cached))
    report.ideal_fraction = (system + question - held) / (system + question)
    log(report.lines()[0])


def batching(loaded, report: KVReport, counts=(1, 2, 4, 8), prompt: int = 32, gen: int = 32, log: Log = print) -> None:
    """Throughput (prompt and answer tokens) of n chats together against one after another (greedy, distinct
    prompts of `prompt` tokens, `gen` tokens each)."""
    ctx = prompt + gen + 8
    for batch in (1, 2):                    # compile every kernel shape (one chat's and a batch's steps) and fill
        warm = Scheduler(loaded.model, KVPool(loaded.spec, 2 * (blocks_for(ctx) + 2), prefix_cache=False),  # caches
                         max_len=ctx, max_batch=batch)
        for seed in (98, 99):
            warm.submit(GenerationRequest(prompt=tuple(random_prompt(loaded, prompt, seed=seed)), max_tokens=4))
        warm.run()
    for n in counts:
        prompts = [random_prompt(loaded, prompt, seed=100 + i) for i in range(n)]
        rates, per_row = [], []
        for together in (False, True):
            pool = KVPool(loaded.spec, n * (blocks_for(ctx) + 2), prefix_cache=False)
            sched = Scheduler(loaded.model, pool, max_len=ctx, max_batch=n if together else 1)
            if together and sched.room < n:
                report.batch_room[n] = sched.room
            for p in prompts:
                sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=gen, stop_ids=frozenset()))
            t0 = time.perf_counter()
            sched.run()
            rates.append(n * (prompt + gen) / (time.perf_counter() - t0))
            per_row.append(sched.decode_seconds / sched.decode_rows if sched.decode_rows else 0.0)
        report.batch[n] = (rates[0], rates[1])
        if all(per_row):
            report.batch_decode[n] = (per_row[0], per_row[1])
        bound = _union_bound(loaded.model, n)
        if bound is not None:
            report.batch_bound[n] = bound
        log(report.lines()[-1])


def _union_bound(model, n: int) -> float | None:
    """For a model of routed experts whose batched steps of n ran: n sequences' decoded weight bytes over those a
    step of all n reads, dense weights once and each expert the rows chose once (the mean of the steps run)."""
    from app.bench.decode import _routed_expert_bytes, decode_bytes_per_token
    from engine.blocks.ffn import MoE

    batched = model.context.batched
    steps, experts = batched.reads.get(n, (0, 0)) if batched is not None else (0, 0)
    if not steps:
        return None
    solo = decode_bytes_per_token(model)
    moe = [(i, layer.ffn.spec) for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
    per = sum(_routed_expert_bytes(model, i, s.n_experts) for i, s in moe) / len(moe)    # one expert, on average
    dense = solo - sum(s.top_k for _, s in moe) * per
    return n * solo / (dense + experts / steps * per)


def block_sizes(loaded, report: KVReport, sizes=(8, 16, 32, 64, 128), context: int = 2048, chunk: int = 256,
                log: Log = print) -> None:
    """The attention kernel alone, on the shapes of the model's first attention layer (recurrent layers have no
    blocks), at `context` positions."""
    from engine.kernels.attention import attend_paged
    from engine.spec import GatedDeltaNetSpec, MLASpec

    attn = next((layer.attn for layer in loaded.spec.layers if not isinstance(layer.attn, GatedDeltaNetSpec)), None)
    if attn is None:
        log("block size    (skipped: no attention layer, nothing is stored in blocks)")
        return
    if isinstance(attn, MLASpec):
        log("block size    (skipped: latent attention)")
        return
    rng = np.random.default_rng(0)
    h, hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    for b in sizes:
        n = blocks_for(context, b)
        kb = rng.standard_normal((n, hkv, b, d)).astype(np.float32)
        vb = rng.standard_normal((n, hkv, b, d)).astype(np.float32)
        ones = np.ones((n, hkv, b), np.float32)
        table = rng.permutation(n).astype(np.int32)
        q1 = rng.standard_normal((1, h, d)).astype(np.float32)
        qc = rng.standard_normal((chunk, h, d)).astype(np.float32)
        attend_paged(q1, kb, ones, vb, ones, table, np.array([context - 1]), 0.1)
        t0 = time.perf_counter()
        for _ in range(50):
            attend_paged(q1, kb, ones, vb, ones, table, np.array([context - 1]), 0.1)
        dec = (time.perf_counter() - t0) / 50 * 1e6
        pos = np.arange(context - chunk, context)
        t0 = time.perf_counter()
        for _ in range(3):
            attend_paged(qc, kb, ones, vb, ones, table, pos, 0.1)
        report.blocks[b] = (dec, (time.perf_counter() - t0) / 3 * 1e3)
        log(report.lines()[-1])


def int8_error(loaded, report: KVReport, text: str, tokens: int = 512, log: Log = print) -> None:
    """KL(float32 KV || int8 KV) per token and top-1 agreement over `tokens` positions of text."""
    ids = loaded.tokenizer.encode(text)[:tokens] if loaded.tokenizer is not None else random_prompt(loaded, tokens)
    exact = loaded.model.forward(ids, KVCache(loaded.spec, len(ids)), all_logits=True).astype(np.float64)
    pool = KVPool(loaded.spec, blocks_for(len(ids)) + 1, bits=8)
    approx = loaded.model.forward(ids, KVCache(loaded.spec, len(ids), pool=pool), all_logits=True).astype(np.float64)

    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    p, q = log_softmax(exact), log_softmax(approx)
    report.int8_kl = float((np.exp(p) * (p - q)).sum(axis=1).mean())
    report.int8_top1 = float((exact.argmax(1) == approx.argmax(1)).mean())
    report.int8_bytes_ratio = pool.block_bytes / KVPool(loaded.spec, 1).block_bytes
    log(report.lines()[-1])


def _overflow_refused(loaded, log: Log) -> bool:
    """Whether the model's recurrent layers rule out `--overflow retain|slide` (said in the log)."""
    if loaded.spec.is_recurrent:
        log("retention     (skipped: recurrent layers hold the whole past in their state; overflow is refused)")
    return loaded.spec.is_recurrent


FILLER = ("The committee met again on Tuesday to review the quarterly figures. Sales in the northern region were "
          "flat, while the southern offices reported a modest rise. Several members asked for clearer charts, and "
          "the chair promised a revised format for the next meeting. The discussion then turned to travel budgets, "
          "office supplies and the schedule for the summer holidays. ")
NAMES = ("Marlow", "Quince", "Ardent", "Bellweather", "Corvid", "Dunmore", "Elsworth", "Fennick")


def retention(loaded, report: KVReport, ctx: int = 512, doc_tokens: int = 1400, trials: int = 8,
              log: Log = print) -> None:
    """A fact in the first lines of a document longer than the context, asked about at its end: is it recalled?

    Greedy answers of 12 tokens; a trial counts when the answer contains the secret word. The full
    context (no eviction) is the reference of what the model can do at all. Skipped for a model with recurrent
    layers, whose overflow engine.kv refuses.
    """
    if _overflow_refused(loaded, log):
        return
    tok = loaded.tokenizer
    filler = tok.encode(FILLER, add_special_tokens=False)
    found: dict[str, int] = {"full": 0, "retain": 0, "slide": 0}
    for i in range(trials):
        word = NAMES[i % len(NAMES)] + str(17 + 7 * i)
        fact = f" Remember this: the password for the archive is {word}. "
        body = []
        while len(body) < doc_tokens:
            body += filler
        lead = 100 + 40 * i                              # the fact sits past the sinks, at varying depth
        doc = tok.decode(body[:lead]) + fact + tok.decode(body[lead:doc_tokens])
        messages = [{"role": "user", "content": doc + "\n\nWhat is the password for the archive?"}]
        ids = tok.encode_chat(messages, add_generation_prompt=True)
        for mode in found:
            size = len(ids) + 16 if mode == "full" else ctx
            pool = KVPool(loaded.spec, blocks_for(size) + 2)
            cache = KVCache(loaded.spec, size, pool=pool, overflow="error" if mode == "full" else mode,
                            sink_tokens=32, recent_tokens=ctx // 4)
            sched = Scheduler(loaded.model, pool, max_len=size, tokenizer=tok, stop_ids=loaded.stop_ids)
            seq = sched.submit(GenerationRequest(prompt=tuple(ids), max_tokens=12,
                                                 sampling=SamplingParams(temperature=0.0)), cache=cache)
            sched.run()
            text = "".join(getattr(e, "text", "") for e in seq.drain())
            found[mode] += word.lower() in text.lower()
    for mode, n in found.items():
        report.retention[mode] = (n, trials)
        log(report.lines()[-1])


def retention_perplexity(loaded, report: KVReport, text: str, ctx: int = 256, chunk: int = 32,
                         log: Log = print) -> None:
    """Perplexity of held-out text read `chunk` tokens at a time through a context of `ctx` tokens,
    with each overflow mode, against the whole text in context (StreamingLLM's measure). Skipped for a model with
    recurrent layers, whose overflow engine.kv refuses."""
    if _overflow_refused(loaded, log):
        return
    ids = loaded.tokenizer.encode(text)[: 4 * ctx]
    for mode in ("full", "retain", "slide"):
        size = len(ids) + 1 if mode == "full" else ctx
        cache = KVCache(loaded.spec, size, pool=KVPool(loaded.spec, blocks_for(size) + 2),
                        overflow="error" if mode == "full" else mode, sink_tokens=16, recent_tokens=ctx // 4)
        nll, n = 0.0, 0
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : start + chunk]
            logits = loaded.model.forward(piece, cache, all_logits=True).astype(np.float64)
            targets = ids[start + 1 : start + 1 + len(piece)]
            rows = logits[: len(targets)]
            rows = rows - rows.max(axis=1, keepdims=True)
            logp = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            n += len(targets)
        report.retention_ppl[mode] = float(np.exp(nll / n))
        log(report.lines()[-1])


def run_kv_bench(loaded: Any, parts: set[str], heldout: str, log: Log = print, *, prompt: int = 32, gen: int = 32,
                 runs: int = 5) -> KVReport:
    """The parts asked for (prefix, batch, blocks, int8, retention) on a loaded model: `runs` runs of the prefix
    part, chats of `prompt` + `gen` tokens in the batch part."""
    report = KVReport()
    if "prefix" in parts:
        prefix_ttft(loaded, report, trials=runs, log=log)
    if "batch" in parts:
        batching(loaded, report, prompt=prompt, gen=gen, log=log)
    if "blocks" in parts:
        block_sizes(loaded, report, log=log)
    if "int8" in parts:
        int8_error(loaded, report, heldout, log=log)
    if "retention" in parts and loaded.tokenizer is not None and loaded.tokenizer.has_chat_template:
        retention_perplexity(loaded, report, heldout, log=log)
        retention(loaded, report, log=log)
    return report
