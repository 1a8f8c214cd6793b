"""Tool calls of the families beyond Qwen's `<tool_call>` through the official `openai` client: DeepSeek's call
sections, MiniMax-M2's XML invokes, GLM's argument pairs, gpt-oss's harmony messages, Llama 3's JSON answers.

Each served model is tiny and random with the family's published template and markers (support.marker_chat); the
logits are scripted (support.scripted) to write what the family writes. A call written as the family writes it
passes the lazy call grammar unchanged (the script is strict: a grammar that refused the family's own format
would fail it) and comes back as a structured call, whole and streamed; a forced call makes a model that would
answer in prose write a call whose arguments validate."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from engine.tokenizer.core import Tokenizer
from support.live import serve
from support.marker_chat import marker_chat_model
from support.scripted import Script, scripted

KEY = "formats-key-0123456789"
QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}}]
FINAL = "It is sunny in Paris."
# what each family writes to call get_weather(city="Paris"), as its template renders a past call
CALLS = {
    "deepseek": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
                '<｜tool▁calls▁end｜>',
    "minimax": 'Need the weather.</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">'
               '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>',
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "harmony": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
}
# what each writes before its final answer (MiniMax-M2's prompt opens <think>; gpt-oss answers on a channel)
BEFORE_FINAL = {"minimax": "Got it.</think>\n\n", "harmony": "<|channel|>final<|message|>"}


@pytest.fixture(scope="module", params=["deepseek", "minimax", "glm", "harmony", "llama3", "kimi"])
def family(request, tmp_path_factory):
    fmt = request.param
    folder = marker_chat_model(tmp_path_factory.mktemp(fmt) / "tiny", fmt)
    live = serve(folder, ctx=2048, max_batch=2, max_queue=2, api_key=KEY)
    warm = httpx.post(live.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=900,
                      json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert warm.status_code == 200, warm.text
    yield fmt, folder, openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    live.stop()
    live.service.close()


def test_a_call_in_the_familys_format_round_trips(family, monkeypatch):
    fmt, folder, client = family
    final = BEFORE_FINAL.get(fmt, "") + FINAL
    script = Script(lambda prompt: final if "sunny, 21 C" in prompt else CALLS[fmt])
    scripted(monkeypatch, Tokenizer.from_folder(folder), script)
    asked = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model="tiny", messages=asked, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    # the tools reached the template (DeepSeek V3.1's renders none: its users describe them in the system turn)
    assert ("get_weather" in script.prompts[-1]) != (fmt == "deepseek")

    stream = client.chat.completions.create(model="tiny", messages=asked, tools=TOOLS, max_tokens=200, stream=True)
    calls, content, finish = {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content.strip() == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]

    call = choice.message.tool_calls[0]
    follow = [*asked, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    if fmt == "kimi":   # its template (llama.cpp's copy) appends to a list, which sandboxed Jinja refuses (so does
        with pytest.raises(openai.BadRequestError, match="append"):     # transformers'): a 400 saying so
            client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=200)
        return
    r = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == FINAL


# what a model that would rather not call writes: reasoning first where the family reasons in <think> (MiniMax-M2's
# prompt opens it; DeepSeek and GLM open it themselves), which the forced call follows
REFUSALS = {"minimax": "Let me think.</think>\n\nI would rather not.",
            "deepseek": "<think>Let me think.</think>\n\nI would rather not.",
            "glm": "<think>Let me think.</think>\nI would rather not.",
            "harmony": "<|channel|>analysis<|message|>No call.<|end|><|start|>assistant<|channel|>final<|message|>No."}


def test_a_forced_call_validates_in_every_format(family, monkeypatch):
    fmt, folder, client = family
    script = Script(lambda prompt: REFUSALS.get(fmt, "I would rather not."), strict=False)
    scripted(monkeypatch, Tokenizer.from_folder(folder), script)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                       tool_choice="required", max_tokens=240, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1, r.choices[0]
    if fmt in ("minimax", "deepseek", "glm", "harmony"):
        assert r.choices[0].message.model_extra["reasoning_content"] in ("Let me think.", "No call.")
    assert calls[0].function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
