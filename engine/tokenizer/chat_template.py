"""Chat templates: render a conversation to prompt text the way transformers' `apply_chat_template` does.

A template is Jinja code shipped with the model, so it runs in jinja2's immutable sandbox with the
same environment transformers builds (trim_blocks, lstrip_blocks, loop controls, the `{% generation %}`
tag, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text). Any failure inside a
template is reported as a TokenizerError naming where the template came from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import TokenizerError
from engine.tokenizer.text import clean_text

# The names a message's reasoning travels under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRaised(Exception):
    """`raise_exception(...)` called by a template: the template refuses this conversation."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it only renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters and has no ensure_ascii; templates expect json.dumps
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """`dict(...)` for templates, without handing them the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no `self`: jinja's Namespace signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def _jinja_is_safe(version: str) -> bool:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= (3, 1, 6)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template in the sandbox (cached); raises jinja2.TemplateSyntaxError."""
    if not _jinja_is_safe(jinja2.__version__):
        # Templates come with downloaded models: older jinja2 sandboxes can be escaped
        raise TokenizerError(f"chat templates need jinja2 >= 3.1.6 (found {jinja2.__version__}, whose sandbox "
                             "has known escapes); upgrade it with `pip install -U jinja2`")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env.from_string(template)


def plain_data(value: Any) -> Any:
    """A copy made of plain JSON-like values only, so the template never touches caller objects; strings are
    cleaned (`clean_text`) so that a template sees valid text."""
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, str):
        return clean_text(str.__str__(value))
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if isinstance(value, np.generic):  # numpy scalars: np.bool_(False) must stay falsy
        return plain_data(value.item())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Any, source: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError(f"chat template ({source}): the conversation is empty; give at least one message")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TokenizerError(f"chat template ({source}): a message must be a dict with 'role' and "
                                 f"'content', got {type(message).__name__}")
        # Keys set to None are dropped: templates handle a missing key but often print "None"
        msg = {k: plain_data(v) for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def select_template(templates: str | Mapping[str, str] | None, has_tools: bool, source: str) -> str:
    """The template to use: the only one, or from named ones "tool_use" when tools are given, else "default"."""
    if templates is None:
        raise TokenizerError(f"{source} has no chat template; use a prompt without --chat")
    if isinstance(templates, str):
        return templates
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise TokenizerError(
        f"{source} has several chat templates ({', '.join(sorted(templates))}) and none named 'default'; "
        "add a chat_template.jinja to the model folder"
    )


def render_chat(template: str, messages: Any, *, add_generation_prompt: bool,
                special_tokens: Mapping[str, str], source: str, **extra: Any) -> str:
    """Render `messages` with `template` exactly as transformers would (tokenize=False)."""
    try:
        compiled = compile_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"the chat template from {source} has a syntax error (line {exc.lineno}: {exc.message}); "
            "fix the template or run without --chat"
        ) from exc
    chat = _normalize_messages(messages, source)
    tools = extra.pop("tools", None)
    documents = extra.pop("documents", None)
    if tools is not None:
        if not all(isinstance(t, Mapping) for t in tools):
            raise TokenizerError(f"chat template ({source}): tools must be JSON-schema dicts")
        tools = plain_data(list(tools))
    if documents is not None:
        if not all(isinstance(d, Mapping) for d in documents):
            raise TokenizerError(f"chat template ({source}): documents must be dicts with 'title' and 'text'")
        documents = plain_data(list(documents))
    variables = plain_data({**special_tokens, **extra})  # caller's values win over the special tokens
    try:
        return compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except TemplateRaised as exc:
        raise TokenizerError(f"the chat template from {source} rejected the conversation: {exc}") from exc
    except Exception as exc:  # a template is foreign code: any failure in it is a template problem
        raise TokenizerError(
            f"the chat template from {source} failed ({type(exc).__name__}: {exc}); "
            "check the messages it expects, fix the template, or run without --chat"
        ) from exc
