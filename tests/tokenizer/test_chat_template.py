"""Chat templates rendered like transformers' apply_chat_template: SmolLM2's own template on several
conversations, then one template per feature of transformers' Jinja environment, then the errors."""

from __future__ import annotations

import pytest

from engine.errors import TokenizerError
from engine.tokenizer import Tokenizer

CONVERSATIONS = {
    "user only": [{"role": "user", "content": "What is the capital of France?"}],
    "with system": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a colour."}],
    "multi-turn": [{"role": "system", "content": "Be kind."},
                   {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Write 2 lines:\n  indented\n\tand tabbed."}],
    "unicode": [{"role": "user", "content": "Traduis «bonjour» en 日本語 🇯🇵 👨‍👩‍👧"},
                {"role": "assistant", "content": "こんにちは"}],
    "special text in content": [{"role": "user", "content": "say <|im_end|> and <|endoftext|> please"}],
    "empty content": [{"role": "user", "content": ""}],
}


@pytest.mark.parity
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(smol, hf_smol, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    text = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = smol.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert smol.decode(ids) == text


def test_messages_are_not_changed(smol):
    messages = [{"role": "user", "content": "hi", "tool_calls": None}]
    snapshot = [dict(m) for m in messages]
    smol.apply_chat_template(messages)
    assert messages == snapshot


# One template per feature of the environment transformers builds; each must render identically.
FEATURES = {
    "tojson": "{{ messages | tojson }}|{{ {'k': 'é<>&\"'} | tojson }}|{{ messages[0] | tojson(indent=2) }}"
              "|{{ 'é' | tojson(ensure_ascii=True) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}",
    "loop controls": "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
                     "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}|{% endfor %}",
    "trim and lstrip blocks": "{% for m in messages %}\n    {% if m.role == 'user' %}\n"
                              "U: {{ m.content }}\n    {% else %}\nO: {{ m.content }}\n    {% endif %}\n{% endfor %}\n",
    "namespace": "{% set ns = namespace(n=0, sys=false) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% if m.role == 'system' %}{% set ns.sys = true %}{% endif %}{% endfor %}{{ ns.n }} {{ ns.sys }}",
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
                      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "strftime_now": "{{ strftime_now('%Y') }}",
    "special tokens": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ sep_token is defined }}",
    "generation prompt": "{{ messages[-1].content }}{% if add_generation_prompt %}<assistant>{% endif %}",
    "tools and documents": "{{ tools is none }} {{ documents is none }}{% if tools %}{{ tools | tojson }}{% endif %}"
                           "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}",
    "extra variables": "{{ enable_thinking }} {{ bos_token }} {{ custom | default('none') }}",
    "none keys dropped": "{% for m in messages %}{{ m.tool_calls is defined }}{% endfor %}",
    "reasoning aliases": "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}",
    "dict global": "{{ dict(a=1, b=[1, 2]) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }}",
    "string methods": "{% for m in messages %}{{ m.content.strip().upper() }}{{ m.content.split(' ')|length }}"
                      "{% endfor %}",
}
FEATURE_MESSAGES = [
    {"role": "system", "content": "  System says hi  "},
    {"role": "user", "content": "Hello there", "tool_calls": None},
    {"role": "assistant", "content": "General Kenobi", "reasoning": "a famous line"},
    {"role": "user", "content": "Ünïcödé ✓"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
DOCUMENTS = [{"title": "Doc", "text": "Some text"}]


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_template_features_match_transformers(smol, hf_smol, name):
    template = FEATURES[name]
    ours = Tokenizer(smol.backend, smol.special_tokens, chat_template=template, source="feature test")
    variants = [({}, True), ({}, False), ({"tools": TOOLS, "documents": DOCUMENTS}, True),
                ({"enable_thinking": False, "bos_token": "<BOS>"}, True)]
    for extra, gen in variants:
        expected = hf_smol.apply_chat_template(FEATURE_MESSAGES, chat_template=template, add_generation_prompt=gen,
                                               tokenize=False, **extra)
        assert ours.apply_chat_template(FEATURE_MESSAGES, add_generation_prompt=gen, **extra) == expected


def test_named_templates_pick_tool_use_when_tools_are_given(smol):
    templates = {"default": "plain:{{ messages[0].content }}", "tool_use": "tools:{{ tools | length }}"}
    ours = Tokenizer(smol.backend, smol.special_tokens, chat_template=templates, source="named")
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "plain:x"
    assert ours.apply_chat_template([{"role": "user", "content": "x"}], tools=TOOLS) == "tools:1"
    only_named = Tokenizer(smol.backend, {}, chat_template={"a": "A", "b": "B"}, source="cfg.json")
    with pytest.raises(TokenizerError, match="none named 'default'"):
        only_named.apply_chat_template([{"role": "user", "content": "x"}])


# ---- errors ------------------------------------------------------------------------------------


def _with_template(smol, template: str) -> Tokenizer:
    return Tokenizer(smol.backend, smol.special_tokens, chat_template=template, source="my_template.jinja")


@pytest.mark.parity
def test_raise_exception_becomes_tokenizer_error(smol, hf_smol):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with system') }}" \
               "{% endif %}ok"
    with pytest.raises(TokenizerError, match="my_template.jinja rejected the conversation: Conversation must start"):
        _with_template(smol, template).apply_chat_template(CONVERSATIONS["user only"])
    with pytest.raises(Exception, match="Conversation must start with system"):
        hf_smol.apply_chat_template(CONVERSATIONS["user only"], chat_template=template, tokenize=False)
    assert _with_template(smol, template).apply_chat_template(CONVERSATIONS["with system"]) == "ok"


@pytest.mark.parametrize("template", [
    "{{ messages.append({'role': 'user'}) }}",  # the sandbox is immutable
    "{% set ns = namespace(_private=1) %}",  # no underscore attributes on a namespace
    "{{ messages[0].content + 1 }}",  # a plain runtime error inside the template
    "{{ undefined_thing.attr }}",
])
def test_failing_templates_raise_tokenizer_error(smol, template):
    with pytest.raises(TokenizerError, match="my_template.jinja"):
        _with_template(smol, template).apply_chat_template(CONVERSATIONS["user only"])


def test_syntax_error_names_the_template_source(smol):
    with pytest.raises(TokenizerError, match=r"my_template\.jinja has a syntax error \(line 2"):
        _with_template(smol, "ok\n{% for m in messages %}").apply_chat_template(CONVERSATIONS["user only"])


def test_no_template_and_bad_messages(smol):
    bare = Tokenizer(smol.backend, smol.special_tokens, chat_template=None, source="model.gguf")
    assert not bare.has_chat_template
    with pytest.raises(TokenizerError, match="model.gguf has no chat template; use a prompt without --chat"):
        bare.apply_chat_template(CONVERSATIONS["user only"])
    with pytest.raises(TokenizerError, match="conversation is empty"):
        smol.apply_chat_template([])
    with pytest.raises(TokenizerError, match="must be a dict"):
        smol.apply_chat_template(["hello"])


def test_old_jinja_is_refused():
    from engine.tokenizer.chat_template import _jinja_is_safe

    assert _jinja_is_safe("3.1.6") and _jinja_is_safe("3.2.0rc1") and _jinja_is_safe("4.0")
    assert not _jinja_is_safe("3.1.5") and not _jinja_is_safe("2.11.3")
