"""Choosing the next token: logits processors (penalties) and the sampler chain.

A step goes   logits -> apply_processors(logits, history, processors) -> sampler(logits) -> id.

Processors (`make_logits_processors`) rewrite logits: a fixed logit bias per token id (OpenAI's
`logit_bias`, first, as llama.cpp's chain does), then from what was already seen: repetition
penalty, then presence/frequency penalty. Each is a callable
`(logits [V], ids) -> new logits` and never writes into its input. The two penalties look at
different histories, so a processor may declare the one it wants in a `wants` attribute:

- `"context"`   = prompt + generated ids (transformers semantics; repetition penalty, and the
                  default for any plain callable without `wants`);
- `"generated"` = generated ids only (OpenAI semantics; presence and frequency penalties).

The generation loop builds one `History(tokens, n_prompt)` per step (ideally views of the
sequence's own int array, so nothing is copied) and calls `apply_processors(logits, history,
processors)`, which hands each processor the history it wants. Passing a plain id sequence
instead gives that same sequence to every processor. `penalty_last_n` windows the history each
penalty sees (the last n ids of it).

The sampler (`make_sampler`) then runs temperature -> top_k -> top_p -> min_p -> draw, in
float64, on a shrinking candidate set so that a 150k vocabulary costs a few O(V) passes.
Temperature 0 is greedy and skips the rest of the chain (penalties still apply: they run
before the sampler). Ties are broken towards the lowest token id everywhere (greedy, top_k,
top_p), so the kept set never depends on sort internals. Each non-greedy draw uses exactly
one uniform number from a `Generator(PCG64(seed))`, whose state can be saved and restored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal, Sequence

import numpy as np

from engine.errors import GenerationError

TokenIds = Sequence[int] | np.ndarray  # [L] token ids; an int ndarray passes without a copy
LogitsProcessor = Callable[[np.ndarray, TokenIds], np.ndarray]
HistoryKind = Literal["context", "generated"]

# Logits arrive as float32 (rounding ~1e-7 relative), so top_p masses and min_p log-ratios
# within this of their boundary count as on it (kept): rounding never decides a tie with p.
_BOUNDARY_EPS = 1e-6
# Sets at most this large are simply sorted (top_p) or cumulated in one go (the draw).
_SMALL = 1024
# top_p first tries the tokens this likely relative to the top one (peaked distributions),
# then a histogram: buckets of 1/16 nat of log-probability below the top, the last one open.
_NEAR_TOP = 1e-3
_BUCKETS_PER_NAT = 16
_N_BUCKETS = 16 * 48
# Least group count for the top_k bound, block length of the draw's two-level cumulative sum,
# and the sample size top_p's pivots are chosen from.
_BLOCK = 256


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens; the defaults are greedy decoding with no penalties."""

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; keep tokens with p >= min_p * p_max
    repetition_penalty: float = 1.0  # CTRL-style, over distinct ids of prompt + generated
    presence_penalty: float = 0.0  # OpenAI: subtracted once per distinct generated id
    frequency_penalty: float = 0.0  # OpenAI: count * frequency_penalty subtracted
    penalty_last_n: int = 0  # 0 = the whole history given, else only its last n ids count
    seed: int | None = None  # None = fresh OS entropy
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), -100..100

    def __post_init__(self) -> None:
        # a saved session's JSON gives lists of lists: keep the params hashable (values are checked by validate)
        if isinstance(self.logit_bias, list):
            pairs = tuple(tuple(p) if isinstance(p, list) else p for p in self.logit_bias)
            object.__setattr__(self, "logit_bias", pairs)

    def validate(self) -> None:
        """Raise GenerationError naming the first out-of-range setting."""
        _check_real("temperature", self.temperature, "a number >= 0 (0 = greedy)", lambda v: v >= 0)
        _check_int("top_k", self.top_k, "an integer >= 0 (0 = off)", lambda v: v >= 0)
        _check_real("top_p", self.top_p, "in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        _check_real("min_p", self.min_p, "in [0, 1] (0 = off)", lambda v: 0 <= v <= 1)
        _check_real(
            "repetition_penalty", self.repetition_penalty, "a number >= 0.001 (1 = off)", lambda v: v >= 1e-3
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), "in [-2, 2] (0 = off)", lambda v: -2 <= v <= 2)
        _check_int("penalty_last_n", self.penalty_last_n, "an integer >= 0 (0 = all)", lambda v: v >= 0)
        if self.seed is not None:
            _check_int("seed", self.seed, "a non-negative integer or None", lambda v: v >= 0)
        if not isinstance(self.logit_bias, tuple):
            raise GenerationError(f"sampling setting logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise GenerationError(f"sampling setting logit_bias must be (token id, bias) pairs, got {pair!r}")
            _check_int("logit_bias", pair[0], "keyed by token ids >= 0", lambda v: v >= 0)
            _check_real("logit_bias", pair[1], "in [-100, 100]", lambda v: -100 <= v <= 100)


def _check_real(name: str, value: object, want: str, ok: Callable[[float], bool]) -> None:
    real = (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not (isinstance(value, real) and math.isfinite(value) and ok(float(value))):
        raise GenerationError(f"sampling setting {name} must be {want}, got {value!r}")


def _check_int(name: str, value: object, want: str, ok: Callable[[int], bool]) -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, np.integer)) and ok(int(value))):
        raise GenerationError(f"sampling setting {name} must be {want}, got {value!r}")


# --------------------------------------------------------------------------- histories


@dataclass(frozen=True, eq=False)
class History:
    """The ids a step has seen: tokens[:n_prompt] is the prompt, the rest was generated."""

    tokens: TokenIds  # [L] prompt ids then generated ids; an int ndarray avoids copies
    n_prompt: int

    def __post_init__(self) -> None:
        if not 0 <= self.n_prompt <= len(self.tokens):
            raise ValueError(f"n_prompt={self.n_prompt} outside [0, {len(self.tokens)}]")

    @classmethod
    def of(cls, prompt: Sequence[int], generated: Sequence[int] = ()) -> History:
        """Build a history from separate prompt and generated ids (copies them once)."""
        tokens = np.concatenate(
            [np.asarray(prompt, dtype=np.int64), np.asarray(generated, dtype=np.int64)]
        )
        return cls(tokens, len(prompt))

    @property
    def prompt(self) -> TokenIds:
        """The prompt ids."""
        return self.tokens[: self.n_prompt]

    @property
    def generated(self) -> TokenIds:
        """The ids generated so far."""
        return self.tokens[self.n_prompt :]

    def view(self, kind: HistoryKind) -> TokenIds:
        """The ids a processor asked for: "context" (prompt + generated) or "generated"."""
        if kind == "context":
            return self.tokens
        if kind == "generated":
            return self.generated
        raise ValueError(f"unknown history kind {kind!r}; expected 'context' or 'generated'")


def _tail(history: TokenIds, last_n: int) -> TokenIds:
    return history[-last_n:] if 0 < last_n < len(history) else history


def _distinct(history: TokenIds, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids of history (ascending) and how often each occurs."""
    ids = np.asarray(history, dtype=np.int64)  # [L]
    if ids.size == 0:
        return ids, ids
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise GenerationError(
            f"token id {bad} in the history is outside the model's vocabulary [0, {vocab}); "
            "the prompt was encoded for another model"
        )
    if ids.size * 8 < vocab:  # short history: sorting it beats scanning the vocabulary
        return np.unique(ids, return_counts=True)
    counts = np.bincount(ids, minlength=vocab)  # [V]
    seen = np.flatnonzero(counts)
    return seen, counts[seen]


# --------------------------------------------------------------------------- processors


def repetition_penalty(logits: np.ndarray, history: TokenIds, penalty: float) -> np.ndarray:
    """CTRL penalty: each distinct id's logit divided by penalty if > 0, multiplied if < 0."""
    out = np.array(logits, copy=True)
    ids, _ = _distinct(history, out.shape[0])
    if ids.size and penalty != 1.0:
        vals = out[ids]
        out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def presence_frequency_penalty(
    logits: np.ndarray, history: TokenIds, presence: float, frequency: float
) -> np.ndarray:
    """OpenAI penalty: subtract presence once per distinct id and frequency times its count."""
    out = np.array(logits, copy=True)
    ids, counts = _distinct(history, out.shape[0])
    if ids.size and (presence != 0.0 or frequency != 0.0):
        out[ids] -= (presence + frequency * counts).astype(out.dtype)
    return out


@dataclass(frozen=True)
class LogitBias:
    """A fixed amount added to chosen ids' logits (OpenAI's logit_bias); reads no history."""

    bias: tuple[tuple[int, float], ...]  # (token id, added to its logit)
    wants: ClassVar[HistoryKind] = "generated"

    def __call__(self, logits: np.ndarray, history: TokenIds) -> np.ndarray:
        """Logits with each biased id's amount added (the last pair wins if an id repeats)."""
        out = np.array(logits, copy=True)
        vocab = out.shape[0]
        for token, _ in self.bias:
            if not 0 <= token < vocab:
                raise GenerationError(
                    f"logit_bias names token id {token}, outside the model's vocabulary [0, {vocab})"
                )
        for token, amount in dict(self.bias).items():
            out[token] = out[token] + amount
        return out


@dataclass(frozen=True)
class RepetitionPenalty:
    """Repetition penalty as a processor; reads the context (prompt + generated)."""

    penalty: float
    last_n: int = 0
    wants: ClassVar[HistoryKind] = "context"

    def __call__(self, logits: np.ndarray, history: TokenIds) -> np.ndarray:
        """Penalize the distinct ids among the last `last_n` of history."""
        return repetition_penalty(logits, _tail(history, self.last_n), self.penalty)


@dataclass(frozen=True)
class PresenceFrequencyPenalty:
    """Presence and frequency penalties as a processor; reads the generated ids only."""

    presence: float
    frequency: float
    last_n: int = 0
    wants: ClassVar[HistoryKind] = "generated"

    def __call__(self, logits: np.ndarray, history: TokenIds) -> np.ndarray:
        """Penalize the ids among the last `last_n` of history by presence and count."""
        return presence_frequency_penalty(
            logits, _tail(history, self.last_n), self.presence, self.frequency
        )


def make_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors params turn on, in chain order (logit bias, repetition, presence/frequency)."""
    params.validate()
    procs: list[LogitsProcessor] = []
    if params.logit_bias:
        procs.append(LogitBias(params.logit_bias))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenalty(params.repetition_penalty, params.penalty_last_n))
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        procs.append(
            PresenceFrequencyPenalty(
                params.presence_penalty, params.frequency_penalty, params.penalty_last_n
            )
        )
    return procs


def apply_processors(
    logits: np.ndarray,
    history: History | TokenIds,
    processors: Sequence[LogitsProcessor],
) -> np.ndarray:
    """Run processors in order, each on the history it wants; logits itself if there are none."""
    out = logits
    for proc in processors:
        if isinstance(history, History):
            ids = history.view(getattr(proc, "wants", "context"))
        else:
            ids = history
        out = proc(out, ids)
    return out


# --------------------------------------------------------------------------- pure sampling pieces


def greedy(logits: np.ndarray) -> int:
    """The id of the largest logit; ties go to the lowest id."""
    i = int(np.argmax(logits))
    if np.isnan(logits[i]):
        raise ValueError("greedy: logits contain NaN")
    return i


def softmax(logits: np.ndarray) -> np.ndarray:
    """Float64 probabilities; -inf entries get 0, at least one entry must be finite."""
    w = _weights(np.asarray(logits, dtype=np.float64))
    w /= w.sum()
    return w


def apply_temperature(logits: np.ndarray, t: float) -> np.ndarray:
    """Logits divided by t > 0, as float64 (the sampler's working precision)."""
    if not t > 0:
        raise ValueError(f"temperature must be > 0 here (0 means greedy), got {t}")
    x = np.array(logits, dtype=np.float64)
    x /= t
    return x


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (ties to the lowest ids), others -inf; k <= 0 keeps all."""
    if k <= 0 or k >= logits.shape[0]:
        return np.array(logits, copy=True)
    return _keep_only(logits, _top_k_ids(logits, k))


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the most likely tokens until their mass reaches p (always the top one), others -inf."""
    if p >= 1.0:
        return np.array(logits, copy=True)
    return _keep_only(logits, _top_p_ids(logits, p))


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens whose probability is >= min_p times the top probability, others -inf."""
    if min_p <= 0.0:
        return np.array(logits, copy=True)
    return _keep_only(logits, _min_p_ids(logits, min_p))


def _keep_only(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    out = np.full_like(logits, -np.inf)
    out[ids] = logits[ids]
    return out


# --------------------------------------------------------------------------- the fast paths
# Each helper returns ascending indices into its input. `scratch` lends preallocated [V] buffers
# so that a step allocates nothing vocabulary-sized (fresh pages cost more than the arithmetic).


class _Scratch:
    """Reusable work buffers for one vocabulary size."""

    def __init__(self, vocab: int) -> None:
        self.x = np.empty(vocab, dtype=np.float64)  # [V] tempered logits
        self.w = np.empty(vocab, dtype=np.float64)  # [V] weights exp(x - max)
        self.mask = np.empty(vocab, dtype=np.bool_)  # [V] comparison results
        self.ping = np.empty(vocab, dtype=np.float64)  # [V] top_p's shrinking selections
        self.pong = np.empty(vocab, dtype=np.float64)  # [V] (alternating with ping)
        self.bucket = np.empty(vocab, dtype=np.intp)  # [V] top_p's log-probability buckets


def _buf(scratch: _Scratch | None, name: str, n: int) -> np.ndarray | None:
    return None if scratch is None else getattr(scratch, name)[:n]


def _weights(x: np.ndarray, scratch: _Scratch | None = None) -> np.ndarray:
    """Float64 exp(x - max(x)): probabilities up to their sum, the largest exactly 1."""
    top = x.max()
    if not np.isfinite(top):
        raise ValueError(f"softmax needs a finite logit and no NaN or +inf (max is {top})")
    w = np.subtract(x, top, out=_buf(scratch, "w", x.shape[0]), dtype=np.float64)
    return np.exp(w, out=w)


def _top_k_ids(x: np.ndarray, k: int, scratch: _Scratch | None = None) -> np.ndarray:
    """The k largest entries of x, ties at the k-th value to the lowest indices."""
    n = x.shape[0]
    if k >= n:
        return np.arange(n)
    cand = np.arange(n)
    groups = max(4 * k, _BLOCK)
    if groups <= n // 4:
        # Each of the k largest group maxima is a distinct entry >= the k-th of them, so that
        # value bounds the k-th largest entry from below: only entries above it are candidates.
        rows = n // groups
        gmax = x[: rows * groups].reshape(rows, groups).max(axis=0)  # [groups], column maxima
        bound = np.partition(gmax, groups - k)[groups - k]
        cand = np.flatnonzero(np.greater_equal(x, bound, out=_buf(scratch, "mask", n)))
    xc = x[cand]  # [c] with c >= k
    part = np.argpartition(xc, xc.shape[0] - k)[xc.shape[0] - k :]  # k largest, ties arbitrary
    kth = xc[part].min()
    above = cand[part[xc[part] > kth]]
    at_kth = cand[np.flatnonzero(xc == kth)[: k - above.shape[0]]]  # ascending: lowest ids win
    return np.sort(np.concatenate([above, at_kth]))


def _top_p_ids(x: np.ndarray, p: float, scratch: _Scratch | None = None) -> np.ndarray:
    """The smallest most-likely prefix (ties by index) whose probability mass reaches p."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    w = _weights(x, scratch)  # [n] exp(x - top)
    need = (p - _BOUNDARY_EPS) * float(w.sum())
    mask = _buf(scratch, "mask", n)
    # Find the candidates among which the cut falls (ascending) and the weight of the tokens
    # that rank above all of them (all kept), then order only the candidates.
    bucket, c, base = None, 0, 0.0
    near = np.greater_equal(w, _NEAR_TOP, out=mask)
    if n <= _SMALL:
        cand = np.arange(n)
    elif np.count_nonzero(near) <= _SMALL and float(np.add.reduce(w, where=near)) >= need:
        cand = np.flatnonzero(near)  # peaked: the cut falls among the few tokens near the top
    else:
        # One histogram of log-probability buckets (each ranks wholly above the next) finds
        # the bucket where the mass reaches need; its tokens are the candidates.
        edge = np.subtract(x.max(), x, out=_buf(scratch, "ping", n))  # [n] -log(w), inf if -inf
        edge *= _BUCKETS_PER_NAT
        np.minimum(edge, _N_BUCKETS - 1, out=edge)
        bucket = _buf(scratch, "bucket", n)  # [n] bucket index: truncation = floor here
        if bucket is None:
            bucket = edge.astype(np.intp)
        else:
            np.copyto(bucket, edge, casting="unsafe")
        mass = np.cumsum(np.bincount(bucket, weights=w, minlength=_N_BUCKETS))  # [buckets]
        c = int(np.searchsorted(mass, need, side="left"))
        if c >= _N_BUCKETS:  # rounding left the total just under need: cut in the last bucket
            c = int(np.flatnonzero(np.diff(mass, prepend=0.0) > 0)[-1])
        base = float(mass[c - 1]) if c else 0.0
        cand = np.flatnonzero(np.equal(bucket, c, out=mask))
    wc = w[cand]  # [m]
    cut, n_ties = _mass_cut(wc, need, base, scratch)
    kept = cand[(wc > cut) | ((wc == cut) & (np.cumsum(wc == cut) <= n_ties))]
    if bucket is None:
        return kept
    keep = np.less(bucket, c, out=mask)
    keep[kept] = True
    return np.flatnonzero(keep)


def _min_p_ids(x: np.ndarray, min_p: float, scratch: _Scratch | None = None) -> np.ndarray:
    """Entries with p_i / p_max >= min_p, tested in log space."""
    x = np.asarray(x, dtype=np.float64)
    bound = x.max() + (math.log(min_p) - _BOUNDARY_EPS)
    return np.flatnonzero(np.greater_equal(x, bound, out=_buf(scratch, "mask", x.shape[0])))


def _mass_cut(
    w: np.ndarray, need: float, base: float, scratch: _Scratch | None = None
) -> tuple[float, int]:
    """Taking w in descending order after `base` weight already taken, until the sum reaches
    need: the weight of the last token taken and how many tokens of exactly that weight are
    taken. Sorts at most _SMALL entries; larger sets are first narrowed by sampled pivots."""
    n = w.shape[0]
    mask = _buf(scratch, "mask", n)
    spare = [_buf(scratch, "pong", n), _buf(scratch, "ping", n)]  # compress targets, alternating
    active = w
    while active.shape[0] > _SMALL:
        pivot = _mass_pivot(active, need - base)
        m = active.shape[0]
        above = np.greater(active, pivot, out=None if mask is None else mask[:m])
        hi_mass = float(np.add.reduce(active, where=above))
        if base + hi_mass >= need:
            active = _compress(above, active, spare)
            continue
        n_eq = int(np.count_nonzero(active == pivot))
        below = np.less(active, pivot, out=above)
        if base + hi_mass + n_eq * pivot >= need or not below.any():
            n_ties = math.ceil((need - base - hi_mass) / pivot) if pivot > 0 else n_eq
            return pivot, min(max(n_ties, 1), n_eq)
        base += hi_mass + n_eq * pivot
        active = _compress(below, active, spare)
    if active.shape[0] == 0:
        raise ValueError("top_p found no token to cut at (NaN in the weights?)")
    desc = np.sort(active)[::-1]
    mass = base + np.cumsum(desc)
    j = min(int(np.searchsorted(mass, need, side="left")), desc.shape[0] - 1)
    cut = float(desc[j])
    return cut, j - int(np.count_nonzero(desc > cut)) + 1


def _compress(cond: np.ndarray, a: np.ndarray, spare: list) -> np.ndarray:
    """a[cond], written into the next spare buffer (if any) instead of fresh memory."""
    buf = spare.pop(0)
    spare.append(buf)
    out = None if buf is None else buf[: int(np.count_nonzero(cond))]
    return np.compress(cond, a, out=out)


def _mass_pivot(w: np.ndarray, need: float) -> float:
    """An entry of w near where the descending cumulative sum reaches need, from a sample;
    kept away from the sample's ends so that every split removes a good share of w."""
    stride = max(1, w.shape[0] // _BLOCK)
    sample = np.sort(w[::stride])[::-1]  # [s] descending
    est = np.cumsum(sample) * stride  # estimated weight at or above each sampled entry
    s = sample.shape[0]
    j = int(np.searchsorted(est, need, side="left"))
    return float(sample[min(max(j, s // 16), s - 1 - s // 16)])


def _draw(w: np.ndarray, u: float) -> int:
    """The index whose slice of the cumulative weight holds u * total, for u in [0, 1)."""
    n = w.shape[0]
    if n <= _SMALL:
        cdf = np.cumsum(w)
        return _pick(w, cdf, u * cdf[-1])
    # Two levels: cumulative block totals pick the block, then only that block is cumulated.
    blocks = n // _BLOCK
    sums = w[: blocks * _BLOCK].reshape(blocks, _BLOCK).sum(axis=1)  # [blocks]
    if blocks * _BLOCK < n:
        sums = np.append(sums, w[blocks * _BLOCK :].sum())
    bcdf = np.cumsum(sums)
    target = u * bcdf[-1]
    b = _pick(sums, bcdf, target)
    block = w[b * _BLOCK : (b + 1) * _BLOCK]
    return b * _BLOCK + _pick(block, np.cumsum(block), target - (bcdf[b - 1] if b else 0.0))


def _pick(w: np.ndarray, cdf: np.ndarray, target: float) -> int:
    """First i with cdf[i] > target >= 0 (so w[i] > 0); the last positive entry if rounding
    carried target past the end."""
    i = int(np.searchsorted(cdf, target, side="right"))
    return i if i < w.shape[0] else int(np.flatnonzero(w)[-1])


# --------------------------------------------------------------------------- log-probabilities


def token_logprobs(logits: np.ndarray, token: int, top: int = 0) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen token's log-probability and the `top` most likely (id, log-probability) pairs, most likely
    first (ties to the lowest id).

    These are the model's own log-softmax of the raw logits [V]: taken before logit bias, penalties, a grammar's
    mask and temperature, so they describe the model and not the sampler (a masked or tempered token keeps its
    value; OpenAI's `logprobs` mean the same).
    """
    x = np.asarray(logits, dtype=np.float64)  # [V]
    top_x = float(x.max())
    if not math.isfinite(top_x):
        raise GenerationError("cannot compute log-probabilities: the logits contain NaN or +inf, or are all -inf")
    lse = top_x + math.log(float(np.exp(x - top_x).sum()))
    alts: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = _top_k_ids(x, min(top, x.shape[0]))  # ascending ids, ties at the k-th value to the lowest
        order = ids[np.lexsort((ids, -x[ids]))]  # most likely first, then the lower id
        alts = tuple((int(i), float(x[i] - lse)) for i in order)
    return float(x[token] - lse), alts


# --------------------------------------------------------------------------- the sampler


class Sampler:
    """The sampler chain for one request: temperature, top_k, top_p, min_p, then a seeded draw.
    Holds the RNG and work buffers, so one sampler serves one sequence on one thread."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        self._rng = np.random.Generator(np.random.PCG64(params.seed))
        self._scratch: _Scratch | None = None

    def __call__(self, logits: np.ndarray) -> int:
        """The next token id for these (already processed) logits."""
        if self.params.temperature == 0.0:
            return greedy(_checked(logits))
        ids, x = self._candidates(logits)
        i = _draw(_weights(x, self._scratch), self._rng.random())
        return i if ids is None else int(ids[i])

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids (ascending) the next draw can choose and their probabilities."""
        if self.params.temperature == 0.0:
            return np.array([greedy(_checked(logits))]), np.ones(1)
        ids, x = self._candidates(logits)
        live = np.flatnonzero(x > -np.inf)  # -inf logits (masked, or kept by top_k) cannot be drawn
        return (live if ids is None else ids[live]), softmax(x[live])

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Surviving ids (None = all) and their tempered logits after top_k, top_p, min_p."""
        p = self.params
        logits = _checked(logits)
        vocab = logits.shape[0]
        if self._scratch is None or self._scratch.x.shape[0] != vocab:
            self._scratch = _Scratch(vocab)
        sc = self._scratch
        x = sc.x  # [V] float64; same values as apply_temperature(logits, t)
        np.copyto(x, logits)
        x /= p.temperature
        ids: np.ndarray | None = None
        steps = (
            (0 < p.top_k < vocab, lambda v: _top_k_ids(v, p.top_k, sc)),
            (p.top_p < 1.0, lambda v: _top_p_ids(v, p.top_p, sc)),
            (p.min_p > 0.0, lambda v: _min_p_ids(v, p.min_p, sc)),
        )
        for on, keep in steps:
            if on:
                local = keep(x)
                ids = local if ids is None else ids[local]
                x = x[local]  # [n] the shrinking candidate set
        return ids, x

    def get_state(self) -> dict:
        """The RNG state as JSON-safe values (128-bit integers as hex strings)."""
        s = self._rng.bit_generator.state
        return {
            "bit_generator": s["bit_generator"],
            "state": format(s["state"]["state"], "x"),
            "inc": format(s["state"]["inc"], "x"),
            "has_uint32": int(s["has_uint32"]),
            "uinteger": int(s["uinteger"]),
        }

    def set_state(self, state: dict) -> None:
        """Resume the RNG stream from a get_state() result."""
        try:
            if state["bit_generator"] != "PCG64":
                raise ValueError(f"bit generator {state['bit_generator']!r}, expected 'PCG64'")
            self._rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(state["state"], 16), "inc": int(state["inc"], 16)},
                "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"]),
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise GenerationError(
                f"saved sampler state is unreadable ({type(exc).__name__}: {exc}); "
                "start the session again without restoring it"
            ) from exc


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler for params (validated), with its own RNG seeded from params.seed."""
    return Sampler(params)


def _checked(logits: np.ndarray) -> np.ndarray:
    """logits as a 1-D array, refusing NaN, +inf or an all -inf row with a clear error."""
    x = np.asarray(logits)
    if x.ndim != 1:
        raise ValueError(f"the sampler takes one row of logits [V], got shape {x.shape}")
    top = x.max()
    if np.isnan(top) or top == np.inf:
        raise GenerationError(
            "cannot sample: the logits contain NaN or +inf (a numerical fault in the model; "
            "try a wider quantization)"
        )
    if top == -np.inf:
        raise GenerationError("cannot sample: every token is masked (all logits are -inf)")
    return x
