"""`colibri bench MODEL --speculative`: what drafting buys in the scheduler, the way chat, the GUI and the server run.

Two chat prompts: one whose answer repeats the prompt (a list to copy: prompt lookup drafts right) and an ordinary
question. Each runs alone and as four chats together (both prompts twice), decoded plainly and with drafting (prompt
lookup, k = 4, the controller on), alternately, `runs` times; the report gives the median answer tokens per second
of each, their ratio, the drafts' acceptance and whether every answer equals the plain one token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from engine.events import DoneEvent
from engine.generation.generate import GenerationRequest
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import DraftTotals, Scheduler
from engine.generation.speculative import SpeculativeSettings
from engine.kv import KVPool, blocks_for

Log = Callable[[str], None]

PROMPTS = {
    "repetitive": "Copy this list exactly, one item per line, in the same order: apple, banana, cherry, date, "
                  "elderberry, fig, grape, honeydew melon, kiwi fruit, lemon, mango, nectarine, orange, papaya.",
    "normal": "What is the capital of France? Tell me a little about its history.",
}
CHAT_SAMPLING = SamplingParams(repetition_penalty=1.1)     # what `colibri chat` decodes with by default


@dataclass
class Case:
    """One workload's figures: answer tokens per second of each run, plain and drafting."""

    plain: list[float] = field(default_factory=list)
    drafting: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    identical: bool = True

    @property
    def ratio(self) -> float:
        """Median drafting speed over median plain speed."""
        return float(np.median(self.drafting) / np.median(self.plain)) if self.plain and self.drafting else 0.0

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens over drafted ones."""
        return self.accepted / self.drafted if self.drafted else 0.0


def _run(loaded: Any, prompts: list[list[int]], gen: int, speculative: SpeculativeSettings | None,
         ctx: int) -> tuple[list[tuple[int, ...]], float, DraftTotals]:
    """Answer the prompts together: (their tokens, answer tokens per second from the first step to the last)."""
    pool = KVPool(loaded.spec, len(prompts) * (blocks_for(ctx) + 1), prefix_cache=False)
    sched = Scheduler(loaded.model, pool, max_len=ctx, tokenizer=loaded.tokenizer, stop_ids=loaded.stop_ids,
                      max_batch=len(prompts))
    seqs = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=gen, sampling=CHAT_SAMPLING,
                                           speculative=speculative)) for p in prompts]
    t0 = time.perf_counter()
    sched.run()
    seconds = time.perf_counter() - t0
    done = [[e for e in s.drain() if isinstance(e, DoneEvent)][-1] for s in seqs]
    answered = sum(d.stats.generated_tokens for d in done)
    prefill = sum(d.stats.prompt_s for d in done) / len(done)   # the prompts run first, together: not answer time
    return [d.tokens for d in done], answered / max(seconds - prefill, 1e-9), sched.drafting


def run_speculative_bench(loaded: Any, gen: int = 64, runs: int = 3, log: Log = print) -> dict[str, Case]:
    """Plain against drafting answers, alone and four together, for each prompt kind; returns the cases by name."""
    tok = loaded.tokenizer
    ids = {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                            add_special_tokens=False) for name, text in PROMPTS.items()}
    work = {f"{name}, alone": [p] for name, p in ids.items()}
    work["4 chats (both kinds twice)"] = [ids["repetitive"], ids["normal"]] * 2
    ctx = max(len(p) for p in ids.values()) + gen + 8
    settings = SpeculativeSettings(max_draft=4)
    cases: dict[str, Case] = {}
    for name, prompts in work.items():
        case = cases[name] = Case()
        want, _, _ = _run(loaded, prompts, gen, None, ctx)          # warm-up, and the tokens to match
        _run(loaded, prompts, gen, settings, ctx)
        for _ in range(runs):       # alternately, so that the machine's load weighs on both alike
            got, speed, _ = _run(loaded, prompts, gen, None, ctx)
            case.plain.append(speed)
            case.identical &= got == want
            got, speed, totals = _run(loaded, prompts, gen, settings, ctx)
            case.drafting.append(speed)
            case.identical &= got == want
            case.drafted += totals.drafted
            case.accepted += totals.accepted
        log(f"{name:28s} plain {np.median(case.plain):6.1f} tok/s  drafting {np.median(case.drafting):6.1f} tok/s  "
            f"x{case.ratio:.2f}  acceptance {case.acceptance:.0%} of {case.drafted // runs} drafted a run  "
            f"{'identical' if case.identical else 'OUTPUT DIFFERS'}")
    return cases
