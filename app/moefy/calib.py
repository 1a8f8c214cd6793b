"""Text for `colibri moefy`: the dense model's own conversations, feature capture, and scoring.

Calibration text is what the model reads in use: multi-turn chats through the probe prompts of
each topic, the model answering every turn (greedy, repetition penalty 1.1, as `colibri chat`
does). Long chats matter: feed-forward inputs drift with position, so routers fitted on short
snippets starve experts on long texts. Only the text of the chat is kept for clustering (the
user's words and the answers), not the chat template's markers, which repeat in every turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from engine.blocks.ffn import Routing
from engine.generation.sampling import History, SamplingParams, apply_processors, make_logits_processors, make_sampler
from engine.kv import KVCache
from engine.models.transformer import Transformer
from engine.tokenizer import Tokenizer

CHUNK = 256          # tokens per forward pass when reading a passage
PASSAGE_TOKENS = 512  # a calibration or held-out file is read in passages of this many tokens
ANSWER_SAMPLING = SamplingParams(temperature=0.0, repetition_penalty=1.1)

Tick = Callable[[], None]  # called between steps; raises to cancel


@dataclass
class Passage:
    """A token sequence run from position 0, and which of its tokens count (text, not markup)."""

    tokens: list[int] = field(default_factory=list)
    keep: list[bool] = field(default_factory=list)

    def extend(self, ids: Sequence[int], keep: Sequence[bool]) -> None:
        """Append tokens and their flags."""
        self.tokens.extend(int(i) for i in ids)
        self.keep.extend(bool(k) for k in keep)


class FeatureCapture:
    """A probe that keeps the feed-forward inputs [n, hidden] of chosen tokens, per layer."""

    def __init__(self, names: dict[str, int]):
        self.names = names                                   # FFN input tensor name -> layer index
        self.rows: dict[int, list[np.ndarray]] = {layer: [] for layer in names.values()}
        self.keep: np.ndarray | None = None                  # [T] bool for the forward pass running now

    def __call__(self, name: str, x: np.ndarray) -> None:
        layer = self.names.get(name)
        if layer is not None and self.keep is not None and self.keep.any():
            self.rows[layer].append(np.array(x[self.keep], dtype=np.float32))

    def matrix(self, layer: int) -> np.ndarray:
        """Every kept input of a layer, [N, hidden]."""
        return np.concatenate(self.rows[layer]) if self.rows[layer] else np.zeros((0, 0), np.float32)

    @property
    def count(self) -> int:
        """Tokens captured (per layer)."""
        first = next(iter(self.rows.values()), [])
        return sum(len(r) for r in first)


def converse(model: Transformer, tokenizer: Tokenizer, prompts: Sequence[str], answer_tokens: int,
             stop_ids: frozenset[int], capture: FeatureCapture | None = None, tick: Tick | None = None) -> Passage:
    """One chat through PROMPTS, the model answering each in up to ANSWER_TOKENS tokens."""
    cache = KVCache(model.spec, model.spec.max_position)
    sampler, processors = make_sampler(ANSWER_SAMPLING), make_logits_processors(ANSWER_SAMPLING)
    passage, messages = Passage(), []
    for prompt in prompts:
        messages.append({"role": "user", "content": prompt})
        ids, content = _turn_ids(tokenizer, messages, prompt, passage.tokens)
        shared = _common_prefix(ids, passage.tokens)
        if len(ids) - shared + answer_tokens >= cache.max_len:
            break  # the context is full: the chat ends here
        shared = cache.truncate(shared)     # fewer where a sliding window's rows are gone: those run again
        del passage.tokens[shared:], passage.keep[shared:]
        new = ids[shared:]
        keep = [shared + j >= content[0] and shared + j < content[1] and shared + j > 0 for j in range(len(new))]
        logits = _forward(model, new, cache, keep, capture)[-1]
        passage.extend(new, keep)
        answer: list[int] = []
        for _ in range(answer_tokens):
            if processors:
                logits = apply_processors(logits, History.of(passage.tokens, answer), processors)
            token = sampler(logits)
            if token in stop_ids:
                break
            answer.append(token)
            logits = _forward(model, [token], cache, [True], capture)[-1]
        passage.extend(answer, [True] * len(answer))
        messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
        if tick is not None:
            tick()
    return passage


def text_passages(tokenizer: Tokenizer, text: str, length: int = PASSAGE_TOKENS) -> list[Passage]:
    """TEXT cut into passages of LENGTH tokens, each read from position 0 (which does not count)."""
    ids = tokenizer.encode(text)
    out = []
    for start in range(0, len(ids), length):
        piece = ids[start : start + length]
        if len(piece) > 1:
            out.append(Passage(list(piece), [j > 0 for j in range(len(piece))]))
    return out


def read_passage(model: Transformer, passage: Passage, capture: FeatureCapture | None = None) -> None:
    """Run a passage through the model so that CAPTURE sees its kept tokens."""
    cache = KVCache(model.spec, len(passage.tokens) + 1)
    for start in range(0, len(passage.tokens), CHUNK):
        end = start + CHUNK
        _forward(model, passage.tokens[start:end], cache, passage.keep[start:end], capture, all_logits=False)


@dataclass
class Score:
    """Negative log-likelihood and routing counts of a model over passages (kept tokens only)."""

    nll: float = 0.0
    tokens: int = 0
    picks: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [E] times each expert was chosen

    @property
    def perplexity(self) -> float:
        """exp(mean NLL) over the scored tokens."""
        return float(np.exp(self.nll / max(self.tokens, 1)))

    def shares(self) -> dict[int, np.ndarray]:
        """Per layer, the fraction of choices each expert got."""
        return {layer: counts / max(counts.sum(), 1) for layer, counts in sorted(self.picks.items())}


def score(model: Transformer, passages: Sequence[Passage], tick: Tick | None = None) -> Score:
    """Perplexity and routing of MODEL on PASSAGES: token t counts when kept (predicted from t-1)."""
    result = Score()
    for passage in passages:
        cache = KVCache(model.spec, len(passage.tokens) + 1)
        tokens, keep = np.asarray(passage.tokens), np.asarray(passage.keep, bool)
        for start in range(0, len(tokens), CHUNK):
            end = min(start + CHUNK, len(tokens))
            routing: list[Routing] = []
            logits = model.forward(tokens[start:end], cache, all_logits=True, routing=routing)   # [T, V]
            targets = np.arange(start + 1, min(end + 1, len(tokens)))        # positions these logits predict
            counted = keep[targets]
            if counted.any():
                rows = (targets - 1 - start)[counted]
                result.nll += float(_nll(logits[rows], tokens[targets[counted]]).sum())
                result.tokens += int(counted.sum())
            for r in routing:
                n_experts = model.spec.layers[r.layer].ffn.n_experts
                counts = result.picks.setdefault(r.layer, np.zeros(n_experts, np.int64))
                counts += np.bincount(r.experts[keep[start:end]].reshape(-1), minlength=n_experts)
        if tick is not None:
            tick()
    return result


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row, computed in float64."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
    return log_z - x[np.arange(len(targets)), targets]


def _forward(model: Transformer, ids: Sequence[int], cache: KVCache, keep: Sequence[bool],
             capture: FeatureCapture | None, all_logits: bool = False) -> np.ndarray:
    if capture is not None:
        capture.keep = np.asarray(keep, bool)
    try:
        return model.forward(ids, cache, all_logits=all_logits, probe=capture)
    finally:
        if capture is not None:
            capture.keep = None


def _turn_ids(tokenizer: Tokenizer, messages: list[dict], prompt: str, so_far: list[int]) -> tuple[list[int], tuple[int, int]]:
    """The whole chat's token ids after a new user turn, and where that turn's text lies in them."""
    if tokenizer.has_chat_template:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:  # a base model: the prompts and answers as plain paragraphs
        ids = list(so_far) + tokenizer.encode(("\n\n" if so_far else "") + prompt + "\n\n", add_special_tokens=not so_far)
    needle = tokenizer.encode(prompt, add_special_tokens=False)
    inner = needle[1:-1] if len(needle) > 2 else needle      # the ends may merge with the markup around them
    at = _find(ids, inner)
    return ids, ((at, at + len(inner)) if at >= 0 else (0, 0))


def _find(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int:
    """Index of the last occurrence of NEEDLE in HAYSTACK at or after START, or -1."""
    n = len(needle)
    if n == 0:
        return -1
    for i in range(len(haystack) - n, start - 1, -1):
        if list(haystack[i : i + n]) == list(needle):
            return i
    return -1


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
