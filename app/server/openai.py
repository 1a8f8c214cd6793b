"""The OpenAI-compatible routes: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`,
streamed as server-sent events ending with `data: [DONE]` (`"stream": true`) or whole. A chat with a model that
reasons apart (its template has a reasoning format: engine.tokenizer.reasoning) answers its reasoning in
`reasoning_content` (in `message`, or in streamed `delta`s) and only the answer in `content`; a message's
`reasoning_content` goes back to the template. `tools` reach the model through its chat template and its calls
come back parsed (app.server.tool_calls) as the message's `tool_calls` (finish_reason "tool_calls"), or streamed
as one `tool_calls` delta per call; past calls and `tool` turns go back to the template. tool_choice "required"
or a named function constrains the answer to such a call where the model's format allows (else 400).

Every client mistake gets a 4xx answer in OpenAI's error shape (app.server.errors): a field of the wrong type
(a JSON boolean is no number), a value out of range, an unknown model, a prompt longer than the context (with the
numbers), an OpenAI field Colibri cannot honour (never silently ignored). `logit_bias` is honoured, and so are
`logprobs` / `top_logprobs` (chat) and `logprobs` (completions): the model's own log-softmax of each token's raw
logits (before logit bias, penalties and temperature), with up to 20 alternatives; a streamed chunk carries those of
its tokens (of a token whose text is held back, the next chunk). `response_format` `json_object` and
`json_schema` are honoured by grammar-constrained decoding (engine.generation.grammar): the answer is JSON matching
the schema; as max_tokens nears, the answer is steered to close (where the schema lets it close), so that it parses
even when finish_reason is "length" (an answer whose JSON closes on its last allowed token finishes "stop"). A
schema that cannot be compiled gets a 400 naming the problem. A max_tokens past the room the prompt leaves in the
context is clamped to that room (app.server.generation.budget, as on the Anthropic and Ollama routes): the answer
then ends with "length" when the context is full. A full queue answers 429 with `Retry-After`. A client that
disconnects cancels its generation; its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any, Callable, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from app.server.engine import Served, Ticket
from app.server.errors import ApiError, error, responses
from app.server.errors import sse as _sse
from app.server.generation import budget, start
from app.server.tool_calls import (
    AnswerSplitter,
    Tools,
    answer_grammar,
    answer_reasoning,
    arguments,
    call_id,
    openai_tools,
    render_chat,
)
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.grammar import Grammar, json_object_grammar, json_schema_grammar, token_bytes
from engine.generation.sampling import SamplingParams
from engine.tokenizer.reasoning import ReasoningFormat

MAX_TOP_LOGPROBS = 20       # alternatives per token a request may ask for (OpenAI's limit)


# --------------------------------------------------------------------------- request bodies
# JSON booleans are not numbers here (strict ints and floats; an int is still a float). Unknown fields are ignored;
# OpenAI's own fields are each honoured, harmless (`user`, `metadata`, `store`, `service_tier`, `prediction`,
# `parallel_tool_calls`, a message's `name`: nothing in the answer depends on them) or refused with a 400 naming
# them (`_UNSUPPORTED`) unless left at a value that asks for nothing.

_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "function calls are not supported"),
    "function_call": ((None, "none", "auto"), "function calls are not supported"),
    "modalities": ((None, ["text"]), "only text is produced"),
    "audio": ((None,), "only text is produced"),
    "web_search_options": ((None,), "there is no web search"),
    "reasoning_effort": ((None,), "the model's reasoning effort cannot be set"),
    "echo": ((None, False), "the prompt is not echoed; leave it out"),
    "suffix": ((None, ""), "text after the completion (insertion) is not supported"),
    "best_of": ((None, 1), "only one completion is made per request (best_of 1)"),
}


def _asks_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    # by type too: False == 0 in Python, but `logprobs: 0` asks for log probabilities
    return any(value is h or (type(value) is type(h) and value == h) for h in harmless)


def _refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    rule = _UNSUPPORTED.get(info.field_name or "")
    if rule is not None and not _asks_nothing(value, rule[0]):
        raise PydanticCustomError("unsupported", f"{rule[1]} (Colibri does not implement it)")
    return value


_TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]
_Bias = Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")   # unknown fields are ignored; OpenAI's own are handled above

    model: StrictStr
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[_TokenKey, _Bias] | None = Field(None, max_length=1024)   # token id (a string) -> bias
    repetition_penalty: StrictFloat = Field(1.0, ge=1e-3, le=10.0)     # extensions (as in vLLM): the desktop app's,
    top_k: StrictInt = Field(0, ge=0)                                  # 0 = off
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)                    # 0 = off
    speculative: StrictBool | None = None     # extension: draft or not (None: as the server was started)
    n: StrictInt = Field(1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    _unsupported = field_validator(*(n for n in _UNSUPPORTED if n not in ("echo", "suffix", "best_of")),
                                   mode="before")(_refuse_unsupported)

    def grammar(self) -> Grammar | None:
        """The grammar `response_format` asks for (None: free text); ApiError (400) naming what is wrong with it.
        Compiling a large schema takes a while: call it off the event loop."""
        rf = self.response_format
        if rf is None:
            return None
        kinds = '"text", "json_object" or "json_schema"'
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise ApiError(400, f'response_format must be an object with a "type": {kinds}', "response_format")
        kind = rf["type"]
        if kind == "text":
            return None
        if kind not in ("json_object", "json_schema"):
            raise ApiError(400, f"response_format.type {kind!r} is not one of {kinds}", "response_format.type")
        where = "response_format.json_schema"
        try:
            if kind == "json_object":
                return json_object_grammar()
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise ApiError(400, f'{where} is missing: give {{"name": ..., "schema": {{...}}}}', where)
            if "schema" not in spec:
                raise ApiError(400, f"{where}.schema is missing: give the JSON Schema the answer must match",
                               f"{where}.schema")
            name = spec.get("name")
            return json_schema_grammar(spec["schema"], name if isinstance(name, str) else None)
        except ColibriError as exc:
            raise ApiError(400, f"{where}.schema: {exc}", f"{where}.schema") from None

    def sampling(self, vocab: int) -> SamplingParams:
        """The sampling settings this body asks for; ApiError (400) naming a logit_bias id outside the vocabulary."""
        bias = tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        for token, _ in bias:
            if token >= vocab:
                raise ApiError(400, f"logit_bias: token id {token} is outside the vocabulary (0..{vocab - 1})",
                               "logit_bias")
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                seed=self.seed, presence_penalty=self.presence_penalty,
                                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                                logit_bias=bias)
        try:
            params.validate()
        except ColibriError as exc:
            raise ApiError(400, str(exc)) from None
        return params


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: Union[StrictStr, dict[str, Any]] = "{}"     # a JSON string, as answers give it


class CallIn(BaseModel):
    """A call an assistant turn made, as the history sends it back."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None       # harmless: a chat template has no place for it
    reasoning_content: StrictStr | None = None   # an assistant turn's reasoning, as answers give it (the template
                                                 # decides whether to keep it)
    tool_calls: list[CallIn] | None = None       # an assistant turn's calls
    tool_call_id: StrictStr | None = None        # a tool turn: the call it answers
    audio: Any = None

    _unsupported = field_validator("audio", mode="before")(_refuse_unsupported)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool | None = None                                 # each token's log-probability
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)   # and this many alternatives

    def n_logprobs(self) -> int | None:
        """Alternatives per token to report (None: no log-probabilities); ApiError without `logprobs: true`."""
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ApiError(400, "top_logprobs needs \"logprobs\": true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Body):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)   # log-probabilities and this many alternatives
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    _unsupported_here = field_validator("echo", "suffix", "best_of", mode="before")(_refuse_unsupported)

    def n_logprobs(self) -> int | None:
        """Alternatives per token to report (None: no log-probabilities)."""
        return self.logprobs


_Body.model_rebuild()
ChatBody.model_rebuild()
CompletionBody.model_rebuild()


# --------------------------------------------------------------------------- routes


def add_openai_routes(app: FastAPI, engine: Served) -> None:
    """The model list and the completion routes of the model `engine` serves."""
    tokenizer = engine.service.tokenizer

    @app.get("/v1/models", responses=responses(401))
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": int(engine.started),
                                            "owned_by": "colibri", "colibri": model_description(engine.info)}]}

    @app.post("/v1/chat/completions", responses=responses(400, 401, 404, 408, 413, 429, 503, stream=True))
    async def chat(body: ChatBody, request: Request):
        _check_model(body.model)
        if tokenizer is None or not tokenizer.has_chat_template:
            raise ApiError(400, f"{engine.name} has no chat template; use /v1/completions", "messages")
        tools = openai_tools(body.tools, body.tool_choice, tokenizer)
        prompt, text = render_chat(tokenizer, template_messages(body.messages), tools)
        reasoning = answer_reasoning(tokenizer, text, tools)
        return await _generate(body, prompt, request, chat=True, reasoning=reasoning, n_logprobs=body.n_logprobs(),
                               tools=tools)

    @app.post("/v1/completions", responses=responses(400, 401, 404, 408, 413, 429, 503, stream=True))
    async def completions(body: CompletionBody, request: Request):
        _check_model(body.model)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported (n=1)", "prompt")
            p = p[0]
        if isinstance(p, str):
            if tokenizer is None:
                raise ApiError(400, f"{engine.name} has no tokenizer: send the prompt as token ids", "prompt")
            prompt = tokenizer.encode(p)
        else:
            prompt = list(p)
            vocab = engine.info.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        return await _generate(body, prompt, request, chat=False, n_logprobs=body.n_logprobs())

    # --- generation ---

    def _check_model(name: str) -> None:
        if name not in (engine.name, "colibri", "default"):
            raise ApiError(404, f"model {name!r} is not served here; GET /v1/models lists {engine.name!r}",
                           "model", "model_not_found")

    async def _generate(body: _Body, prompt: list[int], request: Request, chat: bool,
                        reasoning: ReasoningFormat | None = None, n_logprobs: int | None = None,
                        tools: Tools | None = None):
        limit = budget(body.max_completion_tokens or body.max_tokens, len(prompt), engine.ctx,
                       "messages" if chat else "prompt").max_tokens
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stops) > 4:
            raise ApiError(400, f"stop: at most 4 sequences, got {len(stops)}", "stop")
        sampling = body.sampling(engine.info.vocab_size)
        # compiling takes a while: off the event loop, in one call (one worker of its executor, not two)
        grammar = await asyncio.to_thread(lambda: answer_grammar(body.grammar(), tools, "response_format", reasoning))
        scores = None
        if n_logprobs is not None:
            scores = _TokenScores(await _pieces(), n_logprobs)
        ticket = start(engine, prompt, request, max_tokens=limit, sampling=sampling, stops=stops,
                       reasoning=reasoning, grammar=grammar, logprobs=n_logprobs, speculative=body.speculative)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(ticket, rid, created, chat, include_usage, len(prompt), scores,
                                             tools),
                                     media_type="text/event-stream")
        return await _whole(ticket, rid, created, chat, len(prompt), scores, tools)

    async def _pieces() -> Callable[[int], tuple[str, list[int] | None]]:
        """A token's text and bytes, as logprobs report them (token ids alone without a tokenizer)."""
        if tokenizer is None:
            return lambda token: (f"token_id:{token}", None)
        vocab = engine.info.vocab_size
        try:       # the tokenizer bridge is built once (about a second for a large vocabulary): off the event loop
            await asyncio.to_thread(token_bytes, tokenizer, vocab, 0)
        except ColibriError as exc:
            raise ApiError(400, f"logprobs: {exc}", "logprobs") from None

        def piece(token: int) -> tuple[str, list[int] | None]:
            raw = token_bytes(tokenizer, vocab, token)
            return raw.decode("utf-8", errors="replace"), list(raw)

        return piece

    def _finish(event: DoneEvent, called: bool = False) -> str:
        if event.finish_reason == "length":
            return "length"
        return "tool_calls" if called else "stop"

    def _usage(prompt_tokens: int, done: DoneEvent) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": len(done.tokens),
                "total_tokens": prompt_tokens + len(done.tokens)}

    async def _whole(ticket: Ticket, rid: str, created: int, chat: bool, n_prompt: int,
                     scores: _TokenScores | None, tools: Tools | None):
        tokens: list[TokenEvent] = []
        try:
            while True:
                event = await ticket.events.get()
                if isinstance(event, TokenEvent):
                    tokens.append(event)
                elif isinstance(event, ErrorEvent):
                    raise ApiError(400, event.message)
                if isinstance(event, DoneEvent):
                    break
        finally:
            ticket.close()           # a no-op once done; frees the blocks of a request abandoned mid-way
        if event.finish_reason == "cancelled":      # the client left (its ticket's watcher saw it): nobody reads
            return error(499, "the client closed the request")
        if chat:
            message = answer_message(event.text, tools)
            if event.reasoning:
                message["reasoning_content"] = event.reasoning
            choice = {"index": 0, "message": message, "finish_reason": _finish(event, "tool_calls" in message),
                      "logprobs": scores.chat(tokens) if scores else None}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": event.text, "finish_reason": _finish(event),
                      "logprobs": scores.completion(tokens) if scores else None}
            kind = "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": engine.name, "choices": [choice],
                "usage": _usage(n_prompt, event)}

    async def _stream(ticket: Ticket, rid: str, created: int, chat: bool, include_usage: bool, n_prompt: int,
                      scores: _TokenScores | None, tools: Tools | None = None):
        kind = "chat.completion.chunk" if chat else "text_completion"
        calls = CallDeltas(tools)
        unsent: list[TokenEvent] = []       # tokens whose log-probabilities no chunk carried yet (text held back)

        def chunk(delta: dict | str, finish: str | None) -> str:
            logprobs = None
            if scores is not None and unsent:
                logprobs = scores.chat(unsent) if chat else scores.completion(unsent)
                unsent.clear()
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": logprobs}
            payload = {"id": rid, "object": kind, "created": created, "model": engine.name, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while True:
                event = await ticket.events.get()
                if isinstance(event, TokenEvent):
                    unsent.append(event)
                    if event.reasoning and chat:
                        yield chunk({"reasoning_content": event.reasoning}, None)
                    for delta in calls.feed(event.text) if chat else [event.text] if event.text else []:
                        yield chunk(delta, None)
                elif isinstance(event, ErrorEvent):
                    yield _sse({"error": {"message": event.message, "type": "invalid_request_error",
                                          "param": None, "code": None}})
                    break
                elif isinstance(event, DoneEvent):
                    if event.reasoning_tail and chat:
                        yield chunk({"reasoning_content": event.reasoning_tail}, None)
                    for delta in calls.feed(event.tail) + calls.flush() if chat else [event.tail] if event.tail else []:
                        yield chunk(delta, None)
                    yield chunk({} if chat else "", _finish(event, calls.n > 0))
                    if include_usage:
                        yield _sse({"id": rid, "object": kind, "created": created, "model": engine.name,
                                    "choices": [], "usage": _usage(n_prompt, event)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            ticket.close()           # the client left (or we are done): stop and free the KV blocks


class _TokenScores:
    """Tokens' log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries, or the completions API's
    parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). One per answer: a completion's
    text offsets run on across its streamed chunks."""

    def __init__(self, piece: Callable[[int], tuple[str, list[int] | None]], n_top: int):
        self.piece, self.n_top = piece, n_top
        self.offset = 0             # characters of the completion before the next token

    def chat(self, events: list[TokenEvent]) -> dict:
        """`choice.logprobs` of a chat answer or chunk."""
        def entry(token: int, logprob: float | None) -> dict:
            text, raw = self.piece(token)
            return {"token": text, "logprob": logprob, "bytes": raw}

        return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top_logprobs]}
                            for e in events], "refusal": None}

    def completion(self, events: list[TokenEvent]) -> dict:
        """`choice.logprobs` of a completion or chunk."""
        tokens, offsets = [], []
        for e in events:
            text = self.piece(e.token_id)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        tops = [{self.piece(i)[0]: lp for i, lp in e.top_logprobs} for e in events] if self.n_top else None
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in events], "top_logprobs": tops,
                "text_offset": offsets}


# --------------------------------------------------------------------------- tool calls


def template_messages(messages: list[Message]) -> list[dict]:
    """The conversation as chat-template messages: a developer turn as a system one, an assistant turn's calls
    with their arguments as objects (templates iterate them), a tool turn named after the call it answers."""
    out: list[dict] = []
    names: dict[str, str] = {}          # call id -> the tool's name
    for i, m in enumerate(messages):
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                                "reasoning_content": m.reasoning_content}
        if m.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": arguments(c.function.arguments, f"messages[{i}].tool_calls")}}
                for c in m.tool_calls]
            names.update((c.id, c.function.name) for c in m.tool_calls)
        if m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id
            turn["name"] = m.name or names.get(m.tool_call_id or "")
        out.append(turn)
    return out


def _call(call, index: int) -> dict:
    return {"index": index, "id": call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json()}}


def answer_message(text: str, tools: Tools | None) -> dict:
    """The assistant message of a whole answer: its prose as `content` (None when it only called), its calls as
    `tool_calls`."""
    splitter = AnswerSplitter(tools)
    pieces = splitter.feed(text) + splitter.flush()
    prose = "".join(p for p in pieces if isinstance(p, str))
    if not splitter.calls:
        return {"role": "assistant", "content": prose}
    calls = [_call(c, i) for i, c in enumerate(splitter.calls)]
    for c in calls:
        del c["index"]                  # indices belong to streamed deltas only
    return {"role": "assistant", "content": prose or None, "tool_calls": calls}


class CallDeltas:
    """A streamed answer's text as chat deltas: prose as `content`, each call, once whole, as one `tool_calls`
    delta (its id, name and all its arguments)."""

    def __init__(self, tools: Tools | None):
        self._splitter = AnswerSplitter(tools)
        self.n = 0                      # calls given so far

    def feed(self, text: str) -> list[dict]:
        """The deltas `text` completes."""
        return self._deltas(self._splitter.feed(text)) if text else []

    def flush(self) -> list[dict]:
        """The deltas still held at the end."""
        return self._deltas(self._splitter.flush())

    def _deltas(self, pieces) -> list[dict]:
        out = []
        for p in pieces:
            if isinstance(p, str):
                out.append({"content": p})
            else:
                out.append({"tool_calls": [_call(p, self.n)]})
                self.n += 1
        return out


def model_description(info) -> dict:
    """The served model as /v1/models describes it under "colibri" (what a remote desktop app shows)."""
    s = info.settings
    return {"name": info.name, "architecture": info.architecture, "n_layers": info.n_layers,
            "n_experts": info.n_experts, "top_k": info.top_k, "chat": info.chat, "max_context": info.max_context,
            "streaming": info.streaming, "budget_range": list(info.budget_range) if info.budget_range else None,
            "settings": {"memory_budget": s.memory_budget, "prefetch_depth": s.prefetch_depth,
                         "io_threads": s.io_threads, "context_length": s.context_length}}
