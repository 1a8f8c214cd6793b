"""`colibri bench MODEL --grammar`: how often a model's answers are valid JSON with and without the constraint, and
what the constraint costs per token.

Fifty chat prompts (ten subjects x five phrasings) each ask for one JSON object with the keys "name", "kind" and
"facts". They are answered greedily, batched, three ways: free text (the prompt alone asks for JSON),
`json_object` (any JSON object, by grammar) and `json_schema` (SCHEMA, by grammar). For each mode the report gives
the share of answers that parse with `json` (whole answer, and once a Markdown code fence around it is taken off)
and the share that validates against SCHEMA with `jsonschema`.

The constraint's cost is measured by replaying each constrained answer through a fresh constraint of its grammar:
per token, the mask (llguidance's compute_mask plus applying it to the logits) and the advance on the chosen token,
timed one by one; their median and p95 in microseconds, and their mean over the constrained run's time per decoded
token (the same tokens, batched, timed over the scheduler's steps that only decoded: a step with prompt rows in it
is left out) as the constraint's share of decode time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent
from engine.generation.generate import GenerationRequest
from engine.generation.grammar import Grammar, json_object_grammar, json_schema_grammar, make_constraint
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import Scheduler
from engine.kv import KVPool, blocks_for

Log = Callable[[str], None]

SUBJECTS = ("the city of Paris", "the planet Mars", "a red fox", "the violin", "the novel Moby-Dick",
            "the element oxygen", "the Amazon river", "a bicycle", "the game of chess", "honey")
PHRASINGS = (
    'Describe {s} as a JSON object with the keys "name" (a string), "kind" (a string) and "facts" (a list of up to '
    "three short strings). Reply with the JSON only.",
    'Return JSON about {s}: an object with "name", "kind" and "facts" (an array of at most 3 strings). No other '
    "text.",
    'I need machine-readable data. Give me {s} as one JSON object with fields name, kind and facts (a list of '
    "strings, three at most).",
    'Write a JSON object for {s}. Use exactly these keys: "name" (string), "kind" (string), "facts" (array of up to '
    "three strings).",
    'Answer in JSON: {{"name": ..., "kind": ..., "facts": [...]}} for {s}, with at most three facts.',
)
# bounded strings: an answer of plain characters closes within about 300, so a budget of 128 tokens rarely cuts one
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 32}, "kind": {"type": "string", "maxLength": 32},
                         "facts": {"type": "array", "items": {"type": "string", "maxLength": 64}, "maxItems": 3}},
          "required": ["name", "kind", "facts"], "additionalProperties": False}
MODES = ("free", "json_object", "json_schema")
GREEDY = SamplingParams(temperature=0.0)


def prompts(n: int = 50) -> list[str]:
    """The first `n` prompts: each subject in each phrasing, subjects varying fastest."""
    if not 1 <= n <= len(SUBJECTS) * len(PHRASINGS):
        raise ColibriError(f"--prompts {n}: give 1 to {len(SUBJECTS) * len(PHRASINGS)}")
    return [PHRASINGS[i // len(SUBJECTS)].format(s=SUBJECTS[i % len(SUBJECTS)]) for i in range(n)]


@dataclass
class ModeResult:
    """One mode's answers and figures."""

    mode: str
    answers: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)     # each answer's finish reason
    parsed: int = 0             # answers json.loads reads whole
    parsed_unfenced: int = 0    # ... once a Markdown code fence around the answer is taken off
    valid: int = 0              # answers (whole) that validate against SCHEMA
    tokens: int = 0             # tokens sampled (an end-of-sequence id included)
    decode_s: float = 0.0       # time of the batched run's steps that decoded only (no prompt rows)
    decode_tokens: int = 0      # tokens those steps decoded
    mask_us: list[float] = field(default_factory=list)  # constrained modes: the constraint's time per token

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready figures (answers left out)."""
        cost = self.cost() if self.mask_us else (0.0, 0.0, 0.0)
        return {"mode": self.mode, "answers": len(self.answers), "parsed": self.parsed,
                "parsed_unfenced": self.parsed_unfenced, "valid": self.valid, "tokens": self.tokens,
                "stopped": self.finish.count("stop"), "decode_s": round(self.decode_s, 4),
                "decode_tokens": self.decode_tokens, "decode_tok_s": round(self.decode_tok_s, 2),
                **({"mask_us_median": round(cost[0], 1), "mask_us_p95": round(cost[1], 1),
                    "mask_share": round(cost[2], 4)} if self.mask_us else {})}

    def cost(self) -> tuple[float, float, float]:
        """The constraint's median and p95 microseconds per token and its share of the decode time (a constrained
        mode's: free text has no timings)."""
        if not self.mask_us:
            raise ColibriError(f"the {self.mode} mode ran no constraint: no cost to report")
        us = np.asarray(self.mask_us)
        share = us.mean() / 1e6 / (self.decode_s / self.decode_tokens) if self.decode_tokens else 0.0
        return float(np.median(us)), float(np.percentile(us, 95)), float(share)

    @property
    def decode_tok_s(self) -> float:
        """Tokens a second over the steps that decoded only."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _unfenced(text: str) -> str:
    """The answer with a Markdown code fence around it taken off (```json ... ```), else as it is."""
    s = text.strip()
    if s.startswith("```"):
        s = s.split("\n", 1)[1] if "\n" in s else ""
        s = s.rsplit("```", 1)[0] if "```" in s else s
    return s.strip()


def _validator() -> Any:
    try:
        import jsonschema
    except ImportError:
        raise ColibriError("`colibri bench --grammar` validates answers with the jsonschema package: "
                           "`pip install jsonschema`") from None
    return jsonschema.Draft202012Validator(SCHEMA)


def _score(result: ModeResult, validator: Any) -> None:
    for text in result.answers:
        for attr, candidate in (("parsed", text.strip()), ("parsed_unfenced", _unfenced(text))):
            try:
                value = json.loads(candidate)
            except ValueError:
                continue
            setattr(result, attr, getattr(result, attr) + 1)
            if attr == "parsed" and validator.is_valid(value):
                result.valid += 1


def _answer(loaded: Any, ids: list[list[int]], grammar: Grammar | None, gen: int, batch: int,
            result: ModeResult) -> list[tuple[int, ...]]:
    """Answer every prompt, `batch` at a time, into `result`; returns each answer's tokens."""
    ctx = max(len(p) for p in ids) + gen + 8
    pool = KVPool(loaded.spec, batch * (blocks_for(ctx) + 1), prefix_cache=False)
    sched = Scheduler(loaded.model, pool, max_len=ctx, tokenizer=loaded.tokenizer, stop_ids=loaded.stop_ids,
                      max_batch=batch)
    seqs = [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=gen, sampling=GREEDY, grammar=grammar))
            for p in ids]
    while sched.busy:
        # a step where every running sequence decodes (none prefills, none waits) is timed as decode
        rows = len(sched.running)
        decoding = not sched.waiting and all(s.pending is not None for s in sched.running)
        t0 = time.perf_counter()
        sched.step()
        if decoding:
            result.decode_s += time.perf_counter() - t0
            result.decode_tokens += rows
    out = []
    for seq in seqs:
        events = list(seq.drain())
        failed = [e.message for e in events if isinstance(e, ErrorEvent)]
        if failed:
            raise ColibriError(f"the {result.mode} run failed: {failed[0]}")
        done = [e for e in events if isinstance(e, DoneEvent)][-1]
        result.answers.append(done.text)
        result.finish.append(done.finish_reason)
        result.tokens += done.stats.generated_tokens
        out.append(done.tokens)
    return out


def _replay(loaded: Any, grammar: Grammar, answers: list[tuple[int, ...]], finish: list[str], gen: int,
            result: ModeResult) -> None:
    """Time the constraint on each answer's tokens again: mask then advance, per token (the final mask too, that
    let the end-of-sequence id through, when the answer stopped)."""
    vocab = loaded.spec.vocab_size
    logits = np.zeros(vocab, dtype=np.float32)   # [V] the mask's cost does not depend on the values
    history = np.zeros(0, dtype=np.int64)        # [0] a constraint reads no history
    for tokens, why in zip(answers, finish):
        constraint = make_constraint(grammar, loaded.tokenizer, vocab, loaded.stop_ids, gen)
        steps = list(tokens) + ([-1] if why == "stop" else [])
        for token in steps:
            t0 = time.perf_counter_ns()
            constraint(logits, history)
            if token >= 0:
                constraint.advance(token)
            result.mask_us.append((time.perf_counter_ns() - t0) / 1e3)


def run_grammar_bench(loaded: Any, n_prompts: int = 50, gen: int = 128, batch: int = 8,
                      log: Log = print) -> dict[str, ModeResult]:
    """Answer the prompts in each mode and score them (see the module's docstring); returns the modes by name."""
    if gen < 1 or batch < 1:
        raise ColibriError("--gen and --batch must be at least 1")
    tok = loaded.tokenizer
    if tok is None:
        raise ColibriError("`colibri bench --grammar` needs the model's tokenizer, and this model has none")
    validator = _validator()
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                      add_special_tokens=False) for p in prompts(n_prompts)]
    grammars: dict[str, Grammar | None] = {"free": None, "json_object": json_object_grammar(),
                                           "json_schema": json_schema_grammar(SCHEMA, "subject")}
    t0 = time.perf_counter()
    make_constraint(json_object_grammar(), tok, loaded.spec.vocab_size, loaded.stop_ids)  # the bridge, once
    log(f"grammar tokenizer for {loaded.spec.vocab_size} tokens built in {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    _answer(loaded, ids[:batch], None, 2, batch, ModeResult("warm-up"))  # kernels compile outside the timings
    log(f"warm-up on {min(batch, len(ids))} prompts: {time.perf_counter() - t0:.2f} s")
    results: dict[str, ModeResult] = {}
    for mode, grammar in grammars.items():
        result = results[mode] = ModeResult(mode)
        answers = _answer(loaded, ids, grammar, gen, batch, result)
        if grammar is not None:
            _replay(loaded, grammar, answers, result.finish, gen, result)
        _score(result, validator)
        log(format_mode(result))
    return results


def format_mode(r: ModeResult) -> str:
    """One line of the report."""
    n = len(r.answers)
    line = (f"{r.mode:12s} valid JSON {r.parsed:3d}/{n} ({r.parsed / n:4.0%})  unfenced {r.parsed_unfenced:3d}/{n}  "
            f"schema {r.valid:3d}/{n} ({r.valid / n:4.0%})  stopped {r.finish.count('stop'):3d}/{n}  "
            f"{r.decode_tok_s:6.1f} tok/s")
    if r.mask_us:
        median, p95, share = r.cost()
        line += f"  mask {median:6.1f} us median, {p95:6.1f} us p95 = {share:5.1%} of decode"
    return line
