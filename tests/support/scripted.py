"""A deterministic stand-in at the model boundary, for route tests whose answers must be exact: a random tiny
model never writes a tool call by itself.

`qwen_chat_model` builds a tiny random Mixtral with a character tokenizer that knows Qwen3's markers and ships
Qwen3's published chat template (tests/data/templates), so the server renders, tokenizes, detokenizes, splits
reasoning and parses calls with the real code. `scripted` then replaces only the logits: every forward pass still
runs, but the logits the sampler reads for each sequence pick the next token of the answer a script gives for
its prompt, then the end-of-turn token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from support.reference import build_checkpoint

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
QWEN_TEMPLATE = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]   # not special,
                                                                                                    # as in Qwen3's
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def qwen_chat_model(folder: Path) -> Path:
    """A tiny random chat model with Qwen3's template and markers (one token per character otherwise)."""
    from tokenizers import Tokenizer, decoders, models

    pieces = SPECIAL + ADDED + CHARS
    vocab = {p: i for i, p in enumerate(pieces)}
    folder.mkdir(parents=True, exist_ok=True)
    eos = vocab["<|im_end|>"]
    build_checkpoint(folder, "mixtral", num_local_experts=4, num_experts_per_tok=2, vocab_size=len(pieces),
                     max_position_embeddings=4096, eos_token_id=eos, tie_word_embeddings=False)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.add_tokens(ADDED)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
         "chat_template": QWEN_TEMPLATE}))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@dataclass
class Script:
    """What the stand-in answers (`answer`: the prompt's text -> the answer's text) and the prompts it saw."""

    answer: Callable[[str], str]
    prompts: list[str] = field(default_factory=list)
    strict: bool = True     # an answer that strays from the script fails; else the model then has no preference


def scripted(monkeypatch, tokenizer, script: Script) -> None:
    """While the test runs, the logits each sequence samples from spell `script`'s answer to its prompt, then end
    the turn. The model still runs every step; only the row the sampler reads is replaced. What the sequence
    wrote so far must be the start of the scripted answer (a sampler that strayed fails the generation)."""
    from engine.generation.scheduler import Scheduler

    real = Scheduler._sample
    eos = tokenizer.eos_token_id

    def sample(self, seq, logits, **kw):
        text = tokenizer.decode(seq.request.prompt)
        if not seq.tokens:
            script.prompts.append(text)
        want = tokenizer.encode(script.answer(text), add_special_tokens=False) + [eos]
        written = list(seq.tokens)
        row = np.zeros_like(logits)
        if written == want[:len(written)]:
            row[want[len(written)]] = 100.0     # far above the rest under any sampler or penalty
        else:       # something (a grammar) made the answer stray
            assert not script.strict, f"the answer strayed from the script: {tokenizer.decode(written)!r}"
        return real(self, seq, row, **kw)

    monkeypatch.setattr(Scheduler, "_sample", sample)
