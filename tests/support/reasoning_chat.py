"""A tiny chat model that reasons in `<think>`...`</think>`: its greedy answer is known in advance.

The tiny chat MoE (support.tiny_chat) has a character tokenizer, one character per id. Its greedy answer
to a fixed conversation is some run of ids; two of them that occur once each (and not in the prompt) are
renamed `<think>` and `</think>` as special tokens. The prompt's ids do not change, so neither does the
greedy answer, and the answer now reads "before<think>reasoning</think>answer".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from support.tiny_chat import CHARS, EOS_ID, tiny_moe

# A template that strips past reasoning, as DeepSeek-R1's does: enough for Colibri to read the "think" format
THINK_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] "
                  "{% if m.role == 'assistant' and m.reasoning_content %}({{ m.reasoning_content }}) {% endif %}"
                  "{{ m.content.split('</think>')[-1] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "hello there"}]
ANSWER_TOKENS = 24


@dataclass(frozen=True)
class ThinkingModel:
    """The folder, and what its greedy answer to MESSAGES (ANSWER_TOKENS long) says apart."""

    folder: Path
    text: str           # the whole answer with both markers
    reasoning: str      # between the markers
    before: str         # the answer's text before the opening marker
    after: str          # and after the closing one

    @property
    def content(self) -> str:
        """The whole answer, without the reasoning."""
        return self.before + self.after


def _greedy_ids(folder: Path, messages: list[dict], n: int) -> list[int]:
    from engine.events import DoneEvent
    from engine.generation.generate import GenerationRequest, stream_generate
    from engine.kv import KVCache
    from engine.loader import load_model

    loaded = load_model(folder)
    try:
        prompt = loaded.tokenizer.encode_chat(messages, add_generation_prompt=True)
        request = GenerationRequest(prompt=tuple(prompt), max_tokens=n)
        events = stream_generate(loaded.model, loaded.tokenizer, request, stop_ids=loaded.stop_ids,
                                 cache=KVCache(loaded.spec, 256))
        done = [e for e in events if isinstance(e, DoneEvent)][0]
        return list(done.tokens)
    finally:
        loaded.close()


def thinking_model(folder: Path) -> ThinkingModel:
    """Build the tiny thinking model in `folder` (a fresh folder)."""
    tiny_moe(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = THINK_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ids = _greedy_ids(folder, MESSAGES, ANSWER_TOKENS)
    prompt_chars = set(THINK_TEMPLATE) | set("[user] hello there\n[assistant] ")
    once = [i for k, i in enumerate(ids) if ids.count(i) == 1 and CHARS[i - 1] not in prompt_chars and k > 0]
    assert len(once) >= 2, f"the greedy answer {ids} has too few distinct ids to rename"
    # open early, close near the end: some answer text before, reasoning between, answer after
    opening, closing = once[0], once[-1]
    assert ids.index(opening) < ids.index(closing) < len(ids) - 1

    from tokenizers import Tokenizer, decoders, models

    vocab = {"<eos>": EOS_ID, **{c: i + 1 for i, c in enumerate(CHARS)}}
    renamed = {CHARS[opening - 1]: "<think>", CHARS[closing - 1]: "</think>"}
    vocab = {renamed.get(piece, piece): i for piece, i in vocab.items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    tokenizer.add_special_tokens(["<eos>", "<think>", "</think>"])
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    pieces = {i: p for p, i in vocab.items()}
    text = "".join(pieces[i] for i in ids)
    before, rest = text.split("<think>")
    reasoning, after = rest.split("</think>")
    return ThinkingModel(folder, text, reasoning.strip("\n"), before.lstrip("\n"), after.lstrip("\n"))
