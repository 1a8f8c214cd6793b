"""Anthropic's Messages API: `POST /v1/messages` (whole, or streamed as Anthropic's server-sent events:
message_start, ping, content_block_start, content_block_delta, content_block_stop, message_delta with the stop reason
and usage, message_stop) and `POST /v1/messages/count_tokens`.

A request's `system`, its messages' content blocks (text; tool_use and tool_result as the chat template's
`tool_calls` and `tool` turns; thinking as the turn's reasoning) go through the model's chat template; an answer
ending the conversation as the assistant is continued (Anthropic's prefill). `stop_sequences`, `max_tokens`,
`temperature`, `top_p` and `top_k` steer the answer. A model that reasons apart (engine.tokenizer.reasoning)
answers its reasoning in thinking blocks. Every mistake gets Anthropic's error shape (app.server.errors, chosen by
the path); the key may come as `x-api-key` (app.server.app). `tools` ({name, description, input_schema}) reach the
model through its chat template as JSON-schema functions; its calls come back as tool_use blocks (stop_reason
`tool_use`), streamed as a content_block_start and one `input_json_delta` each (app.server.tool_calls);
`tool_choice` any or tool constrains the answer to such a call where the model's format allows.
`output_config.format` (`{"type": "json_schema", "schema": ...}`; the beta's `output_format` too) constrains the
answer to JSON matching the schema by grammar (engine.generation.grammar).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator
from pydantic_core import PydanticCustomError

from app.server.engine import Served, Ticket
from app.server.errors import ApiError, error, responses
from app.server.generation import Budget, budget, events, start, stop_sequence
from app.server.tool_calls import (
    AnswerSplitter,
    Tools,
    answer_grammar,
    answer_reasoning,
    anthropic_tools,
    call_id,
    render_chat,
)
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.grammar import Grammar, json_schema_grammar
from engine.generation.sampling import SamplingParams
from engine.tokenizer.tool_calls import Piece, ToolCall

MAX_STOPS = 16              # stop sequences a request may give

# --------------------------------------------------------------------------- request bodies
# Unknown fields are ignored (`metadata`, `service_tier`, `cache_control` ... change nothing in an answer here);
# those Colibri cannot honour are refused by name.


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Union[StrictStr, list[TextBlock], None] = None
    is_error: StrictBool = False

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]      # opaque: nothing a template could render
    data: StrictStr | None = None


class MediaBlock(_Block):
    type: Literal["image", "document"]

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: str) -> str:
        raise PydanticCustomError("unsupported", f"{value} blocks are not read: the served model reads text only")


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock, MediaBlock],
                  Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: Union[StrictStr, list[Block]]


class CountBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: Union[StrictStr, list[TextBlock], None] = None
    tools: Any = None           # checked by app.server.tool_calls.anthropic_tools
    tool_choice: Any = None
    thinking: Any = None        # harmless: a model that reasons apart always shows its reasoning


class MessagesBody(CountBody):
    max_tokens: StrictInt = Field(ge=1)
    output_config: Any = None   # {"format": {"type": "json_schema", "schema": ...}}: structured output
    output_format: Any = None   # the same format under the structured-outputs beta's older name
    stop_sequences: list[StrictStr] | None = Field(None, max_length=MAX_STOPS)
    stream: StrictBool = False
    temperature: StrictFloat = Field(1.0, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)

    def grammar(self) -> Grammar | None:
        """The grammar `output_config.format` (or the beta's `output_format`) asks for: the answer is JSON matching
        its schema (None: free text); ApiError (400) naming what is wrong. Compiling takes a while: call it off the
        event loop."""
        where = "output_config.format"
        fmt = self.output_config.get("format") if isinstance(self.output_config, dict) else None
        if self.output_config is not None and not isinstance(self.output_config, dict):
            raise ApiError(400, "output_config must be an object", "output_config")
        if fmt is None and self.output_format is not None:
            fmt, where = self.output_format, "output_format"
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', where)
        try:
            return json_schema_grammar(fmt["schema"])
        except ColibriError as exc:
            raise ApiError(400, f"{where}.schema: {exc}", where) from None

    def sampling(self) -> SamplingParams:
        """The sampling settings this body asks for (Anthropic's defaults: temperature 1, no top-p or top-k)."""
        params = SamplingParams(temperature=self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
                                top_k=self.top_k or 0)
        try:
            params.validate()
        except ColibriError as exc:
            raise ApiError(400, str(exc)) from None
        return params


# --------------------------------------------------------------------------- the conversation


def template_messages(body: CountBody) -> list[dict]:
    """The conversation as chat-template messages: `system` first, a user turn's tool results as `tool` turns
    (named after the tool_use they answer), an assistant turn's tool uses as its `tool_calls` and its thinking as
    its `reasoning_content`."""
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}          # tool_use id -> tool name
    for m in body.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
            names.update((u.id, u.name) for u in uses)
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thinking:
                turn["reasoning_content"] = thinking
            if uses:
                turn["tool_calls"] = [{"id": u.id, "type": "function",
                                       "function": {"name": u.name, "arguments": u.input}} for u in uses]
            out.append(turn)
            continue
        for r in (b for b in blocks if isinstance(b, ToolResultBlock)):
            out.append({"role": "tool", "tool_call_id": r.tool_use_id, "name": names.get(r.tool_use_id),
                        "content": ("error: " if r.is_error else "") + r.text()})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


class Blocks:
    """The answer's content blocks as its text arrives: a thinking block for reasoning, a text block for the
    answer and a tool_use block for each call parsed out of it (app.server.tool_calls), a new block each time the
    kind changes (a model may write before it reasons). `feed` gives the stream's events for each piece; `blocks`
    is the whole answer's content (built the same way, so the whole and the streamed answers agree)."""

    def __init__(self, tools: Tools | None = None) -> None:
        self.blocks: list[dict] = []
        self.kind = ""              # the open block's kind, "" when none is open
        self._splitter = AnswerSplitter(tools)

    @property
    def called(self) -> bool:
        """Whether the answer holds a tool call."""
        return bool(self._splitter.calls)

    def feed(self, kind: Literal["thinking", "text"], text: str) -> list[tuple[str, dict]]:
        """Add `text` of `kind`; the stream's events for it."""
        if not text:
            return []
        if kind == "text":
            return self._pieces(self._splitter.feed(text))
        return self._add(kind, text)

    def _pieces(self, pieces: list[Piece]) -> list[tuple[str, dict]]:
        out = []
        for p in pieces:
            out += self._add("text", p) if isinstance(p, str) else self._tool_use(p)
        return out

    def _tool_use(self, call: ToolCall) -> list[tuple[str, dict]]:
        out = self._close()
        block = {"type": "tool_use", "id": call_id("toolu_"), "name": call.name, "input": call.arguments}
        self.blocks.append(block)
        index = len(self.blocks) - 1
        out.append(("content_block_start", {"type": "content_block_start", "index": index,
                                            "content_block": {**block, "input": {}}}))
        out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
            "type": "input_json_delta", "partial_json": call.arguments_json()}}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out

    def _close(self) -> list[tuple[str, dict]]:
        if not self.kind:
            return []
        self.kind = ""
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _add(self, kind: Literal["thinking", "text"], text: str) -> list[tuple[str, dict]]:
        out = self._open(kind) if kind != self.kind else []
        block = self.blocks[-1]
        block[kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                            "delta": delta}))
        return out

    def finish(self) -> list[tuple[str, dict]]:
        """Close the open block (opening an empty text block when the answer has neither text nor a call); the
        stream's events."""
        out = self._pieces(self._splitter.flush())
        if not any(b["type"] in ("text", "tool_use") for b in self.blocks):
            out += self._open("text")
        return out + self._close()

    def _open(self, kind: Literal["thinking", "text"]) -> list[tuple[str, dict]]:
        out = self._close()
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
        self.blocks.append(block)
        self.kind = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                            "content_block": dict(block)}))
        return out


def _sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------- routes


def add_anthropic_routes(app: FastAPI, engine: Served) -> None:
    """Anthropic's Messages API on the model `engine` serves."""
    tokenizer = engine.service.tokenizer

    def _check_model(name: str) -> None:
        if name not in (engine.name, "colibri", "default"):
            raise ApiError(404, f"model {name!r} is not served here; this server serves {engine.name!r}",
                           "model", "model_not_found")

    def _prompt(body: CountBody) -> tuple[list[int], str, Tools | None]:
        """The prompt's token ids, its text (an assistant turn at the end is continued, not closed) and the tools
        the model may call."""
        _check_model(body.model)
        if tokenizer is None or not tokenizer.has_chat_template:
            raise ApiError(400, f"{engine.name} has no chat template, which the Messages API needs; use "
                                "/v1/completions", "messages")
        tools = anthropic_tools(body.tools, body.tool_choice, tokenizer)
        messages = template_messages(body)
        prefill = ""
        if messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1] and len(messages) > 1:
            prefill = messages.pop()["content"]
        return (*render_chat(tokenizer, messages, tools, prefill), tools)

    @app.post("/v1/messages/count_tokens", responses=responses(400, 401, 404, 408, 413, api="anthropic"))
    async def count_tokens(body: CountBody):
        return {"input_tokens": len(_prompt(body)[0])}

    @app.post("/v1/messages", responses=responses(400, 401, 404, 408, 413, 429, 503, stream=True, api="anthropic"))
    async def messages(body: MessagesBody, request: Request):
        prompt, text, tools = _prompt(body)
        limit = budget(body.max_tokens, len(prompt), engine.ctx, "messages")
        stops = tuple(body.stop_sequences or ())
        reasoning = answer_reasoning(tokenizer, text, tools)
        # compiling takes a while: off the event loop, in one call (one worker of its executor, not two)
        grammar = await asyncio.to_thread(lambda: answer_grammar(body.grammar(), tools, "output_config.format", reasoning))
        ticket = start(engine, prompt, request, max_tokens=limit.max_tokens, sampling=body.sampling(), stops=stops,
                       reasoning=reasoning, grammar=grammar)
        rid = "msg_" + uuid.uuid4().hex[:24]
        if body.stream:
            return StreamingResponse(_stream(ticket, rid, len(prompt), limit, stops, Blocks(tools)),
                                     media_type="text/event-stream")
        return await _whole(ticket, rid, len(prompt), limit, stops, request.url.path, Blocks(tools))

    def _stop(done: DoneEvent, limit: Budget, stops: tuple[str, ...], called: bool = False) -> dict:
        """`stop_reason` and `stop_sequence` of an answer."""
        if done.finish_reason == "length":
            full = limit.clamped and len(done.tokens) >= limit.max_tokens
            return {"stop_reason": "model_context_window_exceeded" if full else "max_tokens", "stop_sequence": None}
        if called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        hit = stop_sequence(tokenizer.decode(done.tokens), stops) if tokenizer is not None and stops else None
        return {"stop_reason": "stop_sequence" if hit is not None else "end_turn", "stop_sequence": hit}

    def _message(rid: str, content: list[dict], n_prompt: int, n_out: int) -> dict:
        return {"id": rid, "type": "message", "role": "assistant", "model": engine.name, "content": content,
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": n_prompt, "output_tokens": n_out}}

    def _pieces(event: TokenEvent | DoneEvent) -> list[tuple[Literal["thinking", "text"], str]]:
        if isinstance(event, TokenEvent):
            return [("thinking", event.reasoning), ("text", event.text)]
        return [("thinking", event.reasoning_tail), ("text", event.tail)]

    async def _whole(ticket: Ticket, rid: str, n_prompt: int, limit: Budget, stops: tuple[str, ...], path: str,
                     blocks: Blocks):
        async for event in events(ticket):
            if isinstance(event, ErrorEvent):
                raise ApiError(400, event.message)
            for kind, piece in _pieces(event):
                blocks.feed(kind, piece)
        assert isinstance(event, DoneEvent)
        if event.finish_reason == "cancelled":      # the client left (its ticket's watcher saw it): nobody reads
            return error(499, "the client closed the request", path=path)
        blocks.finish()
        return {**_message(rid, blocks.blocks, n_prompt, len(event.tokens)),
                **_stop(event, limit, stops, blocks.called)}

    async def _stream(ticket: Ticket, rid: str, n_prompt: int, limit: Budget, stops: tuple[str, ...],
                      blocks: Blocks):
        yield _sse("message_start", {"type": "message_start", "message": _message(rid, [], n_prompt, 0)})
        yield _sse("ping", {"type": "ping"})      # as Anthropic sends it: clients skip it, proxies see a live stream
        async for event in events(ticket):
            if isinstance(event, ErrorEvent):
                yield _sse("error", {"type": "error", "error": {"type": "api_error", "message": event.message}})
                return
            for kind, piece in _pieces(event):
                for name, payload in blocks.feed(kind, piece):
                    yield _sse(name, payload)
            if isinstance(event, DoneEvent):
                for name, payload in blocks.finish():
                    yield _sse(name, payload)
                yield _sse("message_delta", {"type": "message_delta", "delta": _stop(event, limit, stops,
                                                                                      blocks.called),
                                             "usage": {"output_tokens": len(event.tokens)}})
                yield _sse("message_stop", {"type": "message_stop"})
