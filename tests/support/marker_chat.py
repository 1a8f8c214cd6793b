"""Tiny chat models of each tool-call format: a random Mixtral with a character tokenizer that knows one family's
markers (as special tokens where the family's vocabulary has them so) and ships that family's chat template, so
that rendering, tokenizing, the call grammars and the call parsers all run the real code on real-format text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from support.reference import build_checkpoint
from support.scripted import CHARS, TEMPLATES

# Llama 3.1's template is not in tests/data: these are its lines that teach JSON calls and render a past one
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if tools and m.role == 'user' %}Respond in the format {\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@dataclass(frozen=True)
class Family:
    """A family's template, its special tokens (the first ends a turn), markers that are text, and more stops."""

    template: str
    special: tuple[str, ...]
    added: tuple[str, ...] = ()
    stops: tuple[str, ...] = ()


FAMILIES = {
    "hermes": Family((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"),
                     ("<|im_end|>", "<|endoftext|>", "<|im_start|>"),
                     ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")),
    "glm": Family((TEMPLATES / "GLM-4.6.jinja").read_text(encoding="utf-8"),
                  ("<|user|>", "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|assistant|>", "<|observation|>",
                   "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                   "</arg_value>", "<tool_response>", "</tool_response>"), stops=("<|observation|>",)),
    "harmony": Family((TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8"),
                      ("<|return|>", "<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>",
                       "<|end|>", "<|call|>"), stops=("<|call|>",)),
    "deepseek": Family((TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja").read_text(encoding="utf-8"),
                       ("<｜end▁of▁sentence｜>", "<|endoftext|>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                        "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                        "<｜tool▁output▁end｜>"), ("<think>", "</think>")),
    "kimi": Family((TEMPLATES / "Kimi-K2-Instruct.jinja").read_text(encoding="utf-8"),
                   ("<|im_end|>", "<|endoftext|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
    "minimax": Family((TEMPLATES / "MiniMax-M2.jinja").read_text(encoding="utf-8"),
                      ("[e~[", "<|endoftext|>", "]~!b[", "]~b]"),
                      ("<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>")),
    "llama3": Family(LLAMA3_TEMPLATE, ("<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                       "<|python_tag|>", "<|eom_id|>"), stops=("<|eom_id|>",)),
}


def marker_chat_model(folder: Path, fmt: str) -> Path:
    """A tiny random chat model writing `fmt` tool calls (FAMILIES), one token per character otherwise."""
    family = FAMILIES[fmt]
    ends = marker_tokenizer(folder, fmt)
    size = len(family.special) + len(family.added) + len(CHARS)
    # the ends in generation_config.json too (its defaults would name characters)
    build_checkpoint(folder, "mixtral", num_local_experts=4, num_experts_per_tok=2, vocab_size=size,
                     max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=ends, bos_token_id=None,
                     pad_token_id=None)
    return folder


def marker_tokenizer(folder: Path, fmt: str) -> list[int]:
    """Write `fmt`'s tokenizer files into `folder`; the ids that end an answer."""
    from tokenizers import Tokenizer, decoders, models

    family = FAMILIES[fmt]
    # characters first: a scripted stand-in that has strayed takes the lowest id the grammar allows, a plain one
    pieces = CHARS + list(family.special) + list(family.added)
    vocab = {p: i for i, p in enumerate(pieces)}
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tokenizer.add_special_tokens(list(family.special))
    tokenizer.add_tokens(list(family.added))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": family.special[0], "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
         "chat_template": family.template}))
    return [vocab[family.special[0]], *(vocab[s] for s in family.stops)]
