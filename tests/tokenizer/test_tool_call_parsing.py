"""Tool calls read back from a model's answer (engine.tokenizer.tool_calls): each format from hand-written
outputs, whole and streamed in any cut, prose kept, malformed calls left as prose; the format chosen from what
each published template writes; and what a published template writes for a past call parses back to that call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.tokenizer.chat_template import render_chat
from engine.tokenizer.reasoning import detect_format, open_parser
from engine.tokenizer.tool_calls import ToolCall, ToolCallParser, detect_tool_format, parse_tool_calls

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
WEATHER = ToolCall("get_weather", {"city": "Paris", "days": 2})
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
           "note": {"type": "object", "properties": {"text": {"type": "string"}}}}

# (format, answer text, prose, calls): as each family writes them
CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>', "Let me look.\n", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
               '<tool_call>\n{"name": "note", "arguments": "{\\"text\\": \\"a <b> c\\"}"}\n</tool_call>',
     "\n", [WEATHER, ToolCall("note", {"text": "a <b> c"})]),
    ("hermes", "No call: 3 < 4 and <tool_c is not a marker.", "No call: 3 < 4 and <tool_c is not a marker.", []),
    ("glm", "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", "Checking.", [WEATHER]),
    ("glm", "<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>42</arg_value>\n</tool_call>", "",
     [ToolCall("note", {"text": "42"})]),         # a string in its schema stays a string
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [WEATHER]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
               '{"name": "note", "parameters": {"text": "x; y"}}', "", [WEATHER, ToolCall("note", {"text": "x; y"})]),
    ("llama3", "Paris is in France {roughly}.", "Paris is in France {roughly}.", []),
    ("harmony", '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris", "days": 2}<|call|>', "", [WEATHER]),
    ("harmony", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                '{"city": "Paris", "days": 2}', "", [WEATHER]),     # <|call|> ends the answer: not in its text
    # DeepSeek V3.1: the name, then the arguments; two calls in one section
    ("deepseek", 'Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
                 '<｜tool▁call▁end｜><｜tool▁call▁begin｜>note<｜tool▁sep｜>{"text": "x"}<｜tool▁call▁end｜>'
                 '<｜tool▁calls▁end｜>', "Looking.", [WEATHER, ToolCall("note", {"text": "x"})]),
    # DeepSeek V3 and R1: the call's type, the name, the arguments fenced
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                 '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>note'
                 '\n```json\n{"text": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "", [WEATHER, ToolCall("note", {"text": "x"})]),
    ("deepseek", "No call: <｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜> stays.",
     "No call: <｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜> stays.", []),
    ("kimi", 'Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.note:1'
             '<|tool_call_argument_begin|>{"text": "x"}<|tool_call_end|><|tool_calls_section_end|>',
     "Sure.", [WEATHER, ToolCall("note", {"text": "x"})]),
    ("minimax", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather"><parameter name="city">Paris</parameter>\n'
                '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="note"><parameter name="text">42'
                '</parameter>\n</invoke>\n</minimax:tool_call>', "Checking.\n",
     [WEATHER, ToolCall("note", {"text": "42"})]),        # a string in its schema stays a string
]


def _cuts(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("fmt, text, prose, calls", CASES)
def test_each_format_parses_whole(fmt, text, prose, calls):
    assert parse_tool_calls(fmt, text, SCHEMAS) == (prose, calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize("fmt, text, prose, calls", CASES)
def test_streamed_in_any_cut_equals_whole(fmt, text, prose, calls, size):
    parser = ToolCallParser(fmt, SCHEMAS)
    pieces = [p for cut in _cuts(text, size) for p in parser.feed(cut)] + parser.flush()
    assert "".join(p for p in pieces if isinstance(p, str)) == prose
    assert [p for p in pieces if isinstance(p, ToolCall)] == calls


def test_prose_streams_before_the_call_ends():
    parser = ToolCallParser("hermes")
    assert parser.feed("Sure. <tool") == ["Sure. "]          # the possible marker start waits
    assert parser.feed('_call>{"name": "f", "arguments": {}}') == []
    assert parser.feed("</tool_call> done") == [ToolCall("f", {}), " done"]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),          # no name
    ("glm", "<tool_call>f\nstray<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
    ("harmony", "<|start|>assistant<|channel|>commentary<|message|>{}<|end|>"),   # no recipient
    ("llama3", '{"name": "f", "parameters": {"a": 1}'),              # cut short
])
def test_a_malformed_call_stays_prose(fmt, text):
    assert parse_tool_calls(fmt, text) == (text, [])


def test_an_unclosed_call_at_the_end_is_read():
    assert parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}') == ("", [ToolCall("f", {"a": 1})])


@pytest.mark.parametrize("name, fmt", [
    ("Qwen-Qwen3-0.6B", "hermes"), ("GLM-4.6", "glm"), ("GLM-4.7-Flash", "glm"), ("openai-gpt-oss-120b", "harmony"),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek"), ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek"),
    ("Kimi-K2-Instruct", "kimi"), ("Kimi-K2-Thinking", "kimi"), ("MiniMax-M2", "minimax"),
])
def test_the_format_is_read_from_the_template(name, fmt):
    assert detect_tool_format((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")) == fmt


def test_a_llama3_template_is_read_as_json_calls():
    # the lines of Llama 3.1's template that teach JSON calls (the template itself is not in tests/data)
    template = ('{{- "<|start_header_id|>user<|end_header_id|>\\n\\n" -}}'
                '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                'its value}.\' }}{{- "<|python_tag|>" + tool_call.name }}')
    assert detect_tool_format(template) == "llama3"
    assert detect_tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": SCHEMAS["get_weather"]}}]


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "GLM-4.6", "GLM-4.7-Flash", "openai-gpt-oss-120b",
                                  "deepseek-ai-DeepSeek-V3.1"])
def test_what_a_template_writes_for_a_call_parses_back(name):
    """The assistant turn a published template renders for a past call, read as the model's answer (through the
    reasoning parser, from the state the generation prompt leaves), gives that call back."""
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    asked = [{"role": "user", "content": "Weather in Paris for two days?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER.arguments}}]}
    # a tool answer after the call, so that templates render the call as history, not as the turn in progress
    history = [*asked, call, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = render_chat(template, asked, add_generation_prompt=True, special_tokens=special, source=name, tools=TOOLS)
    whole = render_chat(template, history, add_generation_prompt=False, special_tokens=special, source=name,
                        tools=TOOLS)
    # the answer starts where the two part (GLM-4.7 opens <think> in the prompt but writes a closed one)
    start = os.path.commonprefix([prompt, whole])
    assert len(start) > len(prompt) - len("<think>")
    answer = whole[len(start):]
    fmt = detect_format(template)
    split = open_parser(fmt.after(start) if fmt else None)
    content = split.feed(answer).content + split.flush().content
    _, calls = parse_tool_calls(detect_tool_format(template), content, SCHEMAS)
    assert calls[:1] == [WEATHER]


@pytest.mark.parametrize("name, opener", [("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "<｜tool▁calls▁begin｜>"),
                                          ("MiniMax-M2", "<minimax:tool_call>")])
def test_a_past_call_as_the_template_writes_it_parses_back(name, opener):
    """Templates that write a past call's turn unlike the answer's start (R1 drops the reasoning, MiniMax-M2 opens
    <think> in the prompt): the call's section as written reads back as the call."""
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    history = [{"role": "user", "content": "Weather in Paris for two days?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": WEATHER.arguments}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    whole = render_chat(template, history, add_generation_prompt=False, special_tokens={"bos_token": "<s>",
                        "eos_token": "</s>"}, source=name, tools=TOOLS)
    _, calls = parse_tool_calls(detect_tool_format(template), whole[whole.index(opener):], SCHEMAS)
    assert calls[:1] == [WEATHER]


HARMONY_ANSWER = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                  'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>')


@pytest.mark.parametrize("size", [1, 4, 9, len(HARMONY_ANSWER)])
def test_a_harmony_call_passes_the_reasoning_parser_whole(size):
    """gpt-oss's analysis is reasoning; its message to a function reaches the answer verbatim and parses."""
    fmt = detect_format((TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8"))
    split = open_parser(fmt.after("<|start|>user<|message|>Weather?<|end|><|start|>assistant"))
    calls = ToolCallParser("harmony", SCHEMAS)
    reasoning, pieces = "", []
    for cut in _cuts(HARMONY_ANSWER, size):
        part = split.feed(cut)
        reasoning += part.reasoning
        pieces += calls.feed(part.content)
    last = split.flush()
    pieces += calls.feed(last.content) + calls.flush()
    assert reasoning + last.reasoning == "Need the weather."
    assert pieces == [WEATHER]


def test_a_schema_of_any_shape_does_not_break_the_parser():
    odd = {"note": {"properties": "text"}, "f": {"properties": {"a": ["string"]}}}
    glm = "<tool_call>{}\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert parse_tool_calls("glm", glm.format("note"), odd) == ("", [ToolCall("note", {"a": 1})])
    assert parse_tool_calls("glm", glm.format("f"), odd) == ("", [ToolCall("f", {"a": 1})])
