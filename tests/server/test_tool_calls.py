"""Tool calls through the official `openai`, `anthropic` and `ollama` clients against a live server on loopback:
a round trip each (the call, its result, the final answer), whole and streamed.

The served model is tiny and random with Qwen3's published template and markers (support.scripted); only its
logits are scripted, to write what Qwen3 writes when it calls a tool. Rendering (the tools and the past call and
result, compared with transformers' own rendering of the same conversation), tokenizing, the reasoning split, the
call parser and the routes' shapes are the real code.

What the clients needed: nothing (openai 3.63 reads `tool_calls` deltas, anthropic 2.17 rebuilds the input from
`input_json_delta`, ollama 0.6 reads `message.tool_calls`)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from engine.tokenizer.core import Tokenizer
from support.live import serve
from support.scripted import Script, qwen_chat_model, scripted

KEY = "tools-key-0123456789"
CTX = 2048
QUESTION = "What is the weather in Paris?"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
THOUGHT = "The user wants the weather; I call the tool."
CALL = '<think>\n' + THOUGHT + '\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL = "It is sunny in Paris."
RESULT = "sunny, 21 C"


def _answer(prompt: str) -> str:
    """Qwen3's two turns: call the tool, then answer from its result."""
    return FINAL if "<tool_response>" in prompt else CALL


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qwen_chat_model(tmp_path_factory.mktemp("qwen") / "tiny")


@pytest.fixture(scope="module")
def server(folder):
    live = serve(folder, ctx=CTX, max_batch=2, max_queue=2, api_key=KEY)
    # one answer first, however long the kernels take to compile into a cold numba cache
    warm = httpx.post(live.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=900,
                      json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert warm.status_code == 200, warm.text
    yield live
    live.stop()
    live.service.close()


@pytest.fixture
def script(monkeypatch, folder, server):
    s = Script(_answer)
    scripted(monkeypatch, Tokenizer.from_folder(folder), s)
    return s


def _expected_prompt(messages: list[dict], tools: list[dict] = TOOLS) -> str:
    """The prompt transformers renders for a conversation with `tools`, from the same published template."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from support.scripted import QWEN_TEMPLATE

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=QWEN_TEMPLATE,
                                        add_generation_prompt=True, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    return rendered[0]


# the conversation as transformers takes it: past arguments as an object
HISTORY = [{"role": "user", "content": QUESTION},
           {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
           {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": RESULT}]


# --------------------------------------------------------------------------- OpenAI


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_openai_round_trip(oai, script):
    asked = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(model="tiny", messages=asked, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    assert script.prompts[-1] == _expected_prompt(asked)

    follow = [*asked, {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
                       "tool_calls": [call.model_dump(exclude_none=True)]},
              {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    r = oai.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == FINAL
    assert not r.choices[0].message.tool_calls
    assert script.prompts[-1] == _expected_prompt(HISTORY)


def test_openai_streams_the_call_as_a_delta(oai, script):
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                         tools=TOOLS, max_tokens=200, stream=True)
    calls, content, reasoning, finish = {}, "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += c.id or ""
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and reasoning == THOUGHT
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_tool_choice_none_hides_the_tools(oai, script):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                    tool_choice="none", max_tokens=200)
    assert "<tools>" not in script.prompts[-1]
    # no tools offered: the call the script still writes is only text
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content


CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "utc": {"type": "boolean"}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice, name", [("required", None),
                                          ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
def test_a_forced_call_is_decoded_under_the_tools_schema(oai, monkeypatch, folder, choice, name):
    """The model would answer in prose; forced, it writes a call whose arguments match the tool's schema (the
    stand-in has no preference once it strays: its string runs on until the budget's end closes it)."""
    script = Script(lambda prompt: "I would rather not.", strict=False)
    scripted(monkeypatch, Tokenizer.from_folder(folder), script)
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                    tools=[*TOOLS, CLOCK], tool_choice=choice, max_tokens=60, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1, r.choices[0]
    assert name is None or calls[0].function.name == name
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in [*TOOLS, CLOCK]}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_a_call_opened_under_auto_gets_arguments_that_validate(oai, monkeypatch, folder):
    """The model opens a call freely (its prose first passes as written), then writes an argument off the schema
    (a number for a string): the call grammar takes over at the opener, so the call still validates (the stand-in
    has no preference once it strays: its string runs on until the budget's end closes it)."""
    script = Script(lambda prompt: 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"city": 7',
                    strict=False)
    scripted(monkeypatch, Tokenizer.from_folder(folder), script)
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                    tools=[*TOOLS, CLOCK], max_tokens=120, temperature=0)
    message = r.choices[0].message
    assert message.content.startswith("Let me look.")
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), CLOCK["function"]["parameters"])


def test_a_forced_call_without_tools_is_refused(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                    tool_choice="required", max_tokens=5)
    assert "no tools" in str(err.value) and err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=5)
    assert "'nope'" in str(err.value)


def test_malformed_tools_are_refused(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                    tools=[{"type": "function", "function": {"description": "no name"}}], max_tokens=5)
    assert "name" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                   "function": {"name": "get_weather", "arguments": "{oops"}}]},
            {"role": "tool", "tool_call_id": "c", "content": RESULT}], tools=TOOLS, max_tokens=5)
    assert "not JSON" in str(err.value)


# --------------------------------------------------------------------------- Anthropic

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_anthropic_round_trip(claude, script):
    asked = [{"role": "user", "content": QUESTION}]
    r = claude.messages.create(model="tiny", max_tokens=200, messages=asked, tools=ANTHROPIC_TOOLS)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    assert r.content[0].thinking == THOUGHT
    use = r.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    assert script.prompts[-1] == _expected_prompt(asked)

    follow = [*asked, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    r = claude.messages.create(model="tiny", max_tokens=200, messages=follow, tools=ANTHROPIC_TOOLS)
    assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["text"] and r.content[0].text == FINAL
    assert script.prompts[-1] == _expected_prompt(HISTORY)


def test_anthropic_streams_the_call_as_input_json(claude, script):
    kinds = []
    with claude.messages.stream(model="tiny", max_tokens=200, tools=ANTHROPIC_TOOLS,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = stream.get_final_message()
    assert "input_json_delta" in kinds and "thinking_delta" in kinds
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].input == {"city": "Paris"}


def test_anthropic_any_tool_forces_a_call(claude, monkeypatch, folder):
    scripted(monkeypatch, Tokenizer.from_folder(folder), Script(lambda prompt: "No.", strict=False))
    r = claude.messages.create(model="tiny", max_tokens=60, messages=[{"role": "user", "content": QUESTION}],
                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, extra_body={"temperature": 0.0})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, ANTHROPIC_TOOLS[0]["input_schema"])


# --------------------------------------------------------------------------- Ollama


@pytest.fixture(scope="module")
def llama(server):
    return ollama.Client(host=server.url, headers={"authorization": f"Bearer {KEY}"}, timeout=120)


def test_ollama_round_trip(llama, script):
    asked = [{"role": "user", "content": QUESTION}]
    r = llama.chat(model="tiny", messages=asked, tools=TOOLS, stream=False)
    assert r.message.thinking == THOUGHT and r.message.content == ""
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    sent = [ollama.Tool.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]    # the client's key order
    assert script.prompts[-1] == _expected_prompt(asked, sent)

    follow = [*asked, {"role": "assistant", "content": "", "thinking": THOUGHT,
                       "tool_calls": [c.model_dump() for c in r.message.tool_calls]},
              {"role": "tool", "content": RESULT, "tool_name": "get_weather"}]
    r = llama.chat(model="tiny", messages=follow, tools=TOOLS, stream=False)
    assert r.message.content == FINAL and not r.message.tool_calls
    # Ollama sends no call ids: the template's past call has none either
    want = [dict(m) for m in HISTORY]
    want[1] = {**want[1], "tool_calls": [{"type": "function", "function": want[1]["tool_calls"][0]["function"]}]}
    want[2] = {k: v for k, v in want[2].items() if k != "tool_call_id"}
    assert script.prompts[-1] == _expected_prompt(want, sent)


def test_ollama_streams_the_call(llama, script):
    calls, thinking = [], ""
    for part in llama.chat(model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, stream=True):
        thinking += part.message.thinking or ""
        calls += part.message.tool_calls or []
    assert thinking == THOUGHT
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_ollama_shows_the_tools_capability(llama):
    assert "tools" in llama.show("tiny").capabilities
