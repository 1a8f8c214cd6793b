"""The reasoning parser: `<think>` and harmony output split into reasoning and answer, however the text streams,
and the format read from the published chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokenizer.chat_template import render_chat
from engine.tokenizer.reasoning import ReasoningFormat, Split, detect_format, open_parser

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
THINK, HARMONY = ReasoningFormat("think"), ReasoningFormat("harmony")


def _split(fmt: ReasoningFormat | None, text: str, cut: int) -> Split:
    parser = open_parser(fmt)
    out = Split()
    for i in range(0, len(text), cut):
        out += parser.feed(text[i:i + cut])
    return out + parser.flush()


CASES = [
    # (format, where the output starts, output, reasoning, answer)
    (THINK, "content", "<think>\nLet me see.\n\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (THINK, "content", "No reasoning at all < > </thin", "", "No reasoning at all < > </thin"),
    (THINK, "reasoning", "Opened by the prompt.\n</think>Answer <think>more</think> end", "Opened by the prompt.more",
     "Answer  end"),
    (THINK, "reasoning", "cut off while thinking <", "cut off while thinking <", ""),
    (HARMONY, "header", "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final"
     "<|message|>4<|return|>", "User asks 2+2.", "4"),
    (HARMONY, "header", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Let me look.<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|><|start|>assistant<|channel|>final"
     "<|message|>done", "ab", "Let me look.done"),
    (HARMONY, "header", "<|channel|>final<|message|>text with <| and |> in it", "", "text with <| and |> in it"),
    (HARMONY, "header", "<|channel|>analysis<|message|>cut off", "cut off", ""),
    (HARMONY, "header", "plain text, no format", "", "plain text, no format"),
    (None, "content", "<think>kept as is</think>", "", "<think>kept as is</think>"),
]


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_does_not_depend_on_how_the_text_streams(case, cut):
    fmt, start, text, reasoning, answer = CASES[case]
    fmt = None if fmt is None else ReasoningFormat(fmt.kind, start=start)
    assert _split(fmt, text, cut) == Split(reasoning, answer)


def test_reasoning_is_never_released_early_as_answer():
    """A marker's first characters wait: the answer never shows "<thi" of a "<think>" still arriving."""
    parser = THINK.parser()
    assert parser.feed("Hi <thi") == Split(content="Hi ")
    assert parser.feed("nk>why") == Split(reasoning="why")
    assert parser.feed("\n\n") == Split()               # reasoning's trailing newlines wait for more reasoning
    assert parser.feed("</think>\nok") == Split(content="ok")


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("name, kwargs, kind, start", [
    ("Qwen-Qwen3-0.6B", {}, "think", "content"),
    ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, "think", "content"),
    ("GLM-4.6", {}, "think", "content"),
    ("GLM-4.7-Flash", {}, "think", "reasoning"),
    ("GLM-4.7-Flash", {"enable_thinking": False}, "think", "content"),
    ("deepseek-ai-DeepSeek-V3.1", {"thinking": True}, "think", "reasoning"),
    ("deepseek-ai-DeepSeek-V3.1", {}, "think", "content"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"enable_thinking": True}, "think", "reasoning"),
    ("MiniMax-M2", {}, "think", "reasoning"),
    ("Kimi-K2-Thinking", {}, "think", "content"),
    ("Kimi-K2-Instruct", {}, None, None),
    ("openai-gpt-oss-120b", {}, "harmony", "header"),
])
def test_format_and_start_come_from_the_template_and_prompt(name, kwargs, kind, start):
    template = _template(name)
    fmt = detect_format(template)
    assert (fmt.kind if fmt else None) == kind
    if fmt is None:
        return
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
               {"role": "user", "content": "2+2?"}]
    prompt = render_chat(template, history, add_generation_prompt=True, special_tokens={"bos_token": "<s>"},
                         source=name, **kwargs)
    assert fmt.after(prompt).start == start


def test_marker_ids_come_from_the_vocabulary():
    ids = {"<think>": 7, "</think>": 8}
    assert detect_format("{{ '</think>' }}", ids.get).marker_ids == {7, 8}
    assert detect_format(None) is None and detect_format("{{ messages }}") is None
