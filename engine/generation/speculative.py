"""Speculative decoding: guess the next few tokens cheaply, check them all in one forward pass.

- A drafter proposes up to k tokens that may follow the context: `PromptLookup` copies what
  followed the last earlier occurrence of the context's final n-gram (free, and right whenever
  the output repeats the prompt: lists, code edits, quotes); `DraftModel` runs a small model
  that shares the tokenizer greedily on its own KV cache; `engine.generation.mtp.MTPDrafter` runs the
  checkpoint's multi-token-prediction layer on the main model's hidden states.
- `verify` walks the logits of [last token] + draft [1 + k, V] row by row, choosing each token
  exactly as plain decoding would (same processors, one sampler call per produced token, in
  order), and stops at the first token that differs from the draft. The tokens produced are
  therefore the tokens plain decoding produces, greedy or seeded sampling alike; only the number
  of forward passes changes. (This rests on each logits row being computed bit for bit as in a
  one-token pass, which the quantized kernels guarantee; float32 folders go through BLAS and
  may differ in the last bits, so a near tie could go the other way.)
- `SpeculationController` measures acceptance and seconds per produced token with and without
  drafting (plain steps interleaved now and then) and switches drafting off when it loses, for
  instance when verifying k + 1 rows widens the set of experts a streamed MoE reads from disk;
  it tries again later. Its counters are what reports show.

The decode loops that use these pieces are `engine.generation.generate.generate_step` (`colibri run`) and the
scheduler (`engine.generation.scheduler`: chat, the GUI and the server), where each speculative sequence of a batch
drafts with its own drafter and controller and verifies in the batch's pass.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from engine.errors import ColibriError
from engine.generation.prefill import prefill
from engine.kv import KVCache
from engine.models.transformer import Transformer


class Drafter(Protocol):
    """Proposes tokens that may follow a context; a wrong guess costs time, never correctness."""

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """Up to k token ids guessed to follow `context` [n] (prompt + generated); [] for no guess."""
        ...


@runtime_checkable
class HiddenStateDrafter(Drafter, Protocol):
    """A drafter that reads the main model's hidden states (the MTP drafter, engine/generation/mtp.py): the
    decode loop hands it those of the verified positions after the prompt and after every pass."""

    def observe(self, start: int, hidden: np.ndarray) -> None:
        """Hidden states before the final norm [T, hidden] of context positions start..start + T - 1."""
        ...

    def close(self) -> None:
        """Give back what it holds (its KV cache)."""
        ...


@dataclass(frozen=True)
class SpeculativeSettings:
    """How to draft and when to stop drafting; a `GenerationRequest` without them decodes plainly."""

    max_draft: int = 4              # k: tokens proposed per step (the verify pass runs k + 1 rows)
    lookup: bool = True             # draft from n-grams of the context (prompt lookup)
    max_ngram: int = 3              # prompt lookup tries the longest n-gram first ...
    min_ngram: int = 1              # ... down to this one
    draft_model: Any = field(default=None, compare=False, repr=False)  # a small Transformer, same vocab
    drafter: Any = field(default=None, compare=False, repr=False)      # a Drafter used as is (replaces both)
    mtp: Any = field(default=None, compare=False, repr=False)          # an MTPHead: draft with it (replaces both)
    adaptive: bool = True           # let the controller switch drafting off when it loses
    warmup: int = 4                 # drafting steps measured before the first verdict
    probe_every: int = 16           # while drafting, one plain step in this many (keeps the baseline fresh)
    retry_after: int = 32           # plain steps before drafting is tried again (doubles per failed try)
    min_gain: float = 0.1           # accepted tokens per drafting step below which drafting cannot pay
    margin: float = 0.05            # drafting must cost less than (1 - margin) x plain per token to stay on

    def validate(self) -> None:
        """Raise ColibriError naming the first out-of-range setting."""
        if not isinstance(self.max_draft, int) or not 1 <= self.max_draft <= 64:
            raise ColibriError(f"speculative max_draft {self.max_draft!r}: use an integer from 1 to 64")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ColibriError(f"prompt lookup n-grams {self.min_ngram}..{self.max_ngram}: "
                               "need 1 <= min_ngram <= max_ngram")
        if not self.lookup and self.draft_model is None and self.drafter is None and self.mtp is None:
            raise ColibriError("speculative decoding with neither prompt lookup nor a draft model drafts "
                               "nothing; turn lookup on or give a draft model")
        if min(self.warmup, self.retry_after) < 1 or self.probe_every < 2:
            raise ColibriError("speculative warmup and retry_after must be at least 1, probe_every at least 2")


class PromptLookup:
    """Drafts by copying: find the context's last n-gram earlier in the context, propose what followed.

    The longest n-gram (max_ngram) is tried first and the most recent occurrence wins. When the
    copied span runs into the end of the context, it continues with the proposal itself, which
    extends a periodic run ("a b a b" -> "a b a b ...") instead of stopping short.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ColibriError(f"prompt lookup n-grams {min_ngram}..{max_ngram}: need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """Up to min(k, max_draft) tokens that followed the latest earlier match of the last n-gram."""
        ctx = np.asarray(context, dtype=np.int64)
        size, k = ctx.size, min(k, self.max_draft)
        if k < 1:
            return []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            # windows ctx[i : i + n] for i + n <= size - 1: each has a token after it, the suffix itself is excluded
            windows = np.lib.stride_tricks.sliding_window_view(ctx[: size - 1], n)   # [size - n, n]
            hits = np.flatnonzero((windows == ctx[size - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                seq = ctx.tolist()
                for j in range(k):          # seq grows as it is read: a run into the end repeats
                    seq.append(seq[start + j])
                return seq[size:]
        return []


class DraftModel:
    """Drafts with a small model sharing the tokenizer: k greedy tokens on its own KV cache.

    The cache follows the context by its longest common prefix: on each call the positions that
    no longer match (rejected drafts) are truncated and the new tokens run, so the draft model
    never recomputes what it already holds.
    """

    def __init__(self, model: Transformer, max_len: int | None = None, vocab_size: int | None = None):
        self.model = model
        self.cache = KVCache(model.spec, max_len)
        self.vocab_size = vocab_size or model.spec.vocab_size   # ids past the target's vocabulary end a draft

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """k greedy draft-model tokens after `context`: fewer past the target's vocabulary, none past the draft's."""

        ctx = np.asarray(context, dtype=np.int64)
        cache = self.cache
        if k < 1 or ctx.size == 0 or ctx.size + k > cache.max_len or ctx.max() >= self.model.spec.vocab_size:
            return []       # nothing asked, or a context the draft model cannot read: no guess
        held = np.asarray(cache.tokens[: min(cache.length, ctx.size - 1)], dtype=np.int64)
        differ = np.flatnonzero(held != ctx[: held.size])
        cache.truncate(int(differ[0]) if differ.size else held.size)
        logits = prefill(self.model, ctx[cache.length :].tolist(), cache)    # [V]
        out: list[int] = []
        while True:
            token = int(np.argmax(logits))
            if token >= self.vocab_size:
                return out
            out.append(token)
            if len(out) == k:
                return out
            logits = self.model.forward([token], cache)[-1]

    def close(self) -> None:
        """Give the draft cache's blocks back."""
        self.cache.release()


class FirstOf:
    """The first non-empty proposal of several drafters (cheap ones first)."""

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """The first drafter's guess that is not empty."""
        for drafter in self.drafters:
            draft = drafter.propose(context, k)
            if draft:
                return draft
        return []


def make_drafter(settings: SpeculativeSettings, vocab_size: int, max_len: int | None = None) -> Drafter:
    """The drafter the settings describe: theirs, else the MTP head's, else prompt lookup, then the draft model
    when lookup has no guess. `max_len` bounds the MTP drafter's cache (the target cache's length)."""
    settings.validate()
    if settings.drafter is not None:
        return settings.drafter
    if settings.mtp is not None:
        from engine.generation.mtp import MTPDrafter

        return MTPDrafter(settings.mtp, max_len)
    drafters: list[Drafter] = []
    if settings.lookup:
        drafters.append(PromptLookup(settings.max_ngram, settings.min_ngram, settings.max_draft))
    if settings.draft_model is not None:
        drafters.append(DraftModel(settings.draft_model, vocab_size=vocab_size))
    return drafters[0] if len(drafters) == 1 else FirstOf(drafters)


def verify(rows: np.ndarray, draft: Sequence[int], choose: Callable[[np.ndarray], int]) -> list[int]:
    """The tokens plain decoding would produce, from verification logits rows [1 + k, V].

    Row j holds the logits after the last token and draft[:j]; `choose` (processors + sampler,
    recording the token) is called once per produced token, in order, so an RNG advances exactly
    as in plain decoding. Stops after the first token that differs from the draft, or after the
    bonus token of the last row when every draft token was accepted.
    """
    out: list[int] = []
    for j in range(len(draft) + 1):
        token = choose(rows[j])
        out.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return out


class SpeculationController:
    """Decides per step whether to draft, from measured acceptance and seconds per produced token.

    Seconds per produced token are kept for the last `WINDOW` drafting steps and the last
    `WINDOW` plain steps (steps where the drafter had no guess, and one probe step in
    `probe_every` while drafting); their medians are the costs compared, so a compilation, a
    draft model's prefill or another process's burst does not decide. After `warmup` drafting
    steps, drafting stays on while it accepts at least `min_gain` tokens per step (moving average)
    and, once both costs are known, costs less per token than plain decoding. When off, it tries
    again after `retry_after` plain steps, waiting twice as long after each try that fails at once.
    """

    ALPHA = 0.25   # weight of the newest step in the moving average of accepted tokens
    WINDOW = 8     # timed steps of each kind kept

    def __init__(self, settings: SpeculativeSettings, clock: Callable[[], float] = time.perf_counter):
        self.settings = settings
        self.clock = clock          # what the decode loop times steps with (tests pass a fake one)
        self.on = True
        self.steps = 0              # decode steps (forward passes after the prompt)
        self.draft_steps = 0        # steps that verified a draft
        self.drafted = 0            # draft tokens proposed
        self.accepted = 0           # draft tokens accepted
        self.produced = 0           # tokens produced by all steps
        self.switches = 0           # times drafting was switched off
        self.gain: float | None = None          # moving average of accepted tokens per drafting step
        self._costs: dict[bool, deque[float]] = {True: deque(maxlen=self.WINDOW), False: deque(maxlen=self.WINDOW)}
        self._since = 0             # steps since drafting was last switched on or off
        self._trial = 0             # drafting steps since drafting was last switched on
        self._wait = settings.retry_after

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens over proposed ones."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def cost(self, drafting: bool) -> float | None:
        """Median seconds per produced token over the recent drafting (or plain) steps; None before any."""
        samples = self._costs[drafting]
        return float(np.median(samples)) if samples else None

    def want_draft(self) -> bool:
        """Whether this step should draft (when on, all but one probe step in `probe_every`)."""
        s = self.settings
        if not s.adaptive:
            return True
        if not self.on:
            if self._since < self._wait:
                return False
            self.on, self._since, self._trial, self.gain = True, 0, 0, None   # try again
        return self._since % s.probe_every != 1     # the second step probes: a baseline comes early

    def record(self, drafted: int, accepted: int, produced: int, seconds: float) -> None:
        """Account one step: draft tokens verified (0 for a plain step), accepted, produced, its time."""
        self.steps += 1
        self._since += 1
        self.produced += produced
        drafting = drafted > 0
        self._costs[drafting].append(seconds / max(produced, 1))
        if not drafting:
            return
        self.draft_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self._trial += 1
        self.gain = float(accepted) if self.gain is None else self.gain + self.ALPHA * (accepted - self.gain)
        s = self.settings
        if s.adaptive and self.on and self._trial >= s.warmup and self._losing():
            failed_at_once = self._trial == s.warmup and self.switches > 0
            self._wait = min(2 * self._wait, 4096) if failed_at_once else s.retry_after
            self.on, self._since = False, 0
            self.switches += 1

    def _losing(self) -> bool:
        if self.gain is not None and self.gain < self.settings.min_gain:
            return True
        draft, plain = self.cost(True), self.cost(False)
        return draft is not None and plain is not None and draft > (1.0 - self.settings.margin) * plain

    def as_dict(self) -> dict[str, float | int | bool]:
        """The counters a report shows."""
        draft, plain = self.cost(True), self.cost(False)
        return {
            "on": self.on, "steps": self.steps, "draft_steps": self.draft_steps, "drafted": self.drafted,
            "accepted": self.accepted, "acceptance": round(self.acceptance, 4), "produced": self.produced,
            "switches": self.switches,
            "tokens_per_step": round(self.produced / self.steps, 4) if self.steps else 0.0,
            "ms_per_token_draft": round(1e3 * draft, 3) if draft is not None else -1.0,
            "ms_per_token_plain": round(1e3 * plain, 3) if plain is not None else -1.0,
        }
