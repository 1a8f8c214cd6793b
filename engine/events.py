"""Typed events of a generation: what the CLI, the server and the GUI all consume."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GenerationStats:
    """Timings and counts of one generation."""

    prompt_tokens: int
    generated_tokens: int       # tokens sampled, an end-of-sequence token included
    prompt_s: float     # prefill time
    decode_s: float     # time from the first generated token to the last
    ttft_s: float       # request start to first token

    @property
    def prompt_tok_s(self) -> float:
        """Prefill throughput."""
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput (tokens after the first, over the time they took)."""
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """The figures `colibri run --json` prints."""
        return {
            "prompt_tok_s": round(self.prompt_tok_s, 3),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "ttft_s": round(self.ttft_s, 4),
        }


@dataclass(frozen=True)
class ProgressEvent:
    """Prefill progress (tokens done of total)."""

    done: int
    total: int


@dataclass(frozen=True)
class PromptLogitsEvent:
    """The prompt's logits [prompt_len, vocab], sent once when the request asks for them."""

    logits: np.ndarray


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completes (may be empty while UTF-8 or a stop string is pending).

    For a chat whose model reasons apart (engine.tokenizer.reasoning), `text` is the answer's part and
    `reasoning` the reasoning's; the format's markers are in neither. When the request asks for log-probabilities,
    `logprob` is the token's and `top_logprobs` the most likely (id, log-probability) pairs, most likely first
    (engine.generation.sampling.token_logprobs: the model's own, before penalties, masks and temperature)."""

    index: int
    token_id: int
    text: str
    reasoning: str = ""
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    pieces: tuple[str, ...] = ()    # where ids are unknown (a remote server's answer): the token's text, then each
                                    # alternative's, in `top_logprobs` order


@dataclass(frozen=True)
class DoneEvent:
    """The end of a generation."""

    finish_reason: str          # "stop" (EOS, stop string, or a grammar done), "length", "cancelled"
    tokens: tuple[int, ...]     # generated ids (an EOS id that stopped it is not included)
    text: str                   # the whole generated text, stop string removed
    stats: GenerationStats
    tail: str = ""              # the end of `text` that no TokenEvent carried (it was held back)
    reasoning: str = ""         # the whole reasoning, apart from `text` (empty unless the request splits it)
    reasoning_tail: str = ""    # the end of `reasoning` that no TokenEvent carried


@dataclass(frozen=True)
class ErrorEvent:
    """A failure that ended the generation; the message is for the user."""

    message: str


Event = ProgressEvent | PromptLogitsEvent | TokenEvent | DoneEvent | ErrorEvent
