"""The chat templates the new families ship (tests/data/templates) render as transformers renders them."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import TokenizerError
from engine.tokenizer.chat_template import render_chat

pytestmark = pytest.mark.parity

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]

PLAIN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four. Café ✓"},
    {"role": "user", "content": "And 3+3?"},
]

WITH_TOOLS = [
    {"role": "system", "content": "You help with weather."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny.", "reasoning_content": "The tool answered."},
    {"role": "user", "content": "Thanks!"},
]

CASES = {
    "plain": (PLAIN, None, {}),
    "plain-no-generation-prompt": (PLAIN[:3], None, {}),
    "tools": (WITH_TOOLS, TOOLS, {}),
    "thinking-off": (PLAIN, None, {"enable_thinking": False, "thinking": False}),
    "thinking-on": (PLAIN, None, {"enable_thinking": True, "thinking": True, "reasoning_effort": "high"}),
}


def _transformers(template: str, messages, tools, add_generation_prompt: bool, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **SPECIAL, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", NAMES)
def test_published_template_renders_as_transformers(name, case):
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    messages, tools, kwargs = CASES[case]
    add = case != "plain-no-generation-prompt"
    extra = dict(kwargs, tools=tools) if tools is not None else dict(kwargs)
    try:
        expected = _transformers(template, messages, tools, add, **kwargs)
    except Exception as exc:  # Kimi K2's tool branch calls list.append, which the sandbox refuses
        with pytest.raises(TokenizerError, match=type(exc).__name__):
            render_chat(template, messages, add_generation_prompt=add, special_tokens=SPECIAL, source=name, **extra)
        return
    got = render_chat(template, messages, add_generation_prompt=add, special_tokens=SPECIAL, source=name, **extra)
    assert got == expected


def test_every_family_has_a_template():
    """The families issue 24 names ship their templates here (GLM-5's is not published in llama.cpp)."""
    for stem in ("GLM-4.6", "GLM-4.7-Flash", "openai-gpt-oss-120b", "deepseek-ai-DeepSeek-V3.1",
                 "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Qwen-Qwen3-0.6B", "MiniMax-M2", "Kimi-K2-Instruct",
                 "Kimi-K2-Thinking"):
        assert stem in NAMES
