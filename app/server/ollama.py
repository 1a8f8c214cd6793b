"""Ollama's API: `POST /api/chat` and `POST /api/generate` (streamed as newline-delimited JSON objects, the last
with `"done": true` and the timings, unless `"stream": false`), `GET /api/tags`, `POST /api/show`, `GET /api/ps`
and `GET /api/version`, so that the clients and front ends written for Ollama list and use the served model.

A request's `options` map to Colibri's sampling settings: temperature, top_p, top_k, min_p, seed,
repeat_penalty and repeat_last_n, presence_penalty and frequency_penalty; num_predict bounds the answer (-1 or
-2: the room left in the context); stop gives stop strings. Options Ollama uses for its own runner (num_ctx,
num_gpu, num_thread ...) are ignored, as Ollama ignores options it does not know. Left out, a setting takes
Ollama's documented default. A model that reasons apart answers its reasoning in `thinking`. `tools` (OpenAI's
function form) reach the model through its chat template; its calls come back as `message.tool_calls`, each
whole in its own streamed line (app.server.tool_calls); past calls and `tool` turns go back. `format` ("json", or
a JSON Schema object) constrains the answer by grammar (engine.generation.grammar), as `response_format` does on
the OpenAI route. Every mistake gets
Ollama's error shape `{"error": "..."}` (app.server.errors, chosen by the path).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator
from pydantic_core import PydanticCustomError

from app.server.engine import Served, Ticket
from app.server.errors import ApiError, error, responses
from app.server.generation import budget, events, start
from app.server.model_details import model_details
from app.server.tool_calls import (
    AnswerSplitter,
    Tools,
    answer_grammar,
    answer_reasoning,
    arguments,
    openai_tools,
    render_chat,
)
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.grammar import Grammar, json_object_grammar, json_schema_grammar
from engine.generation.sampling import SamplingParams
from engine.tokenizer.tool_calls import ToolCall

VERSION = "0.12.0"          # the Ollama API version whose routes and fields these follow (clients gate on it)
MAX_STOPS = 16              # stop strings a request may give


# --------------------------------------------------------------------------- request bodies


def _refuse(what: str):
    def check(value: Any) -> Any:
        if value not in (None, "", [], {}):
            raise PydanticCustomError("unsupported", f"{what} (Colibri does not implement it)")
        return value
    return check


class Options(BaseModel):
    """The `options` Colibri honours (Ollama's defaults); others are ignored."""

    model_config = ConfigDict(extra="ignore")
    temperature: StrictFloat = Field(0.8, ge=0.0, le=100.0)
    top_p: StrictFloat = Field(0.9, gt=0.0, le=1.0)
    top_k: StrictInt = Field(40, ge=0)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    repeat_penalty: StrictFloat = Field(1.1, ge=1e-3, le=10.0)
    repeat_last_n: StrictInt = Field(64, ge=-1)         # -1: the whole context, 0: off
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    num_predict: StrictInt = Field(-1, ge=-2)           # -1 or -2: until the context is full
    stop: Union[StrictStr, list[StrictStr], None] = None
    speculative: StrictBool | None = None               # Colibri's: draft or not (None: as the server was started)

    def sampling(self) -> SamplingParams:
        """These options as Colibri's sampling settings; 400 naming one out of range."""
        if self.repeat_last_n == 0:     # Ollama: 0 turns the repeat penalty off
            penalty, last_n = 1.0, 0
        else:
            penalty, last_n = self.repeat_penalty, max(self.repeat_last_n, 0)
        seed = None if self.seed is None or self.seed < 0 else self.seed       # Ollama: -1 = random
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                seed=seed, repetition_penalty=penalty, penalty_last_n=last_n,
                                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        try:
            params.validate()
        except ColibriError as exc:
            raise ApiError(400, f"options: {exc}") from None
        return params

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"options.stop: at most {MAX_STOPS} strings, got {len(stops)}", "options.stop")
        return stops

    def limit(self) -> int | None:
        if self.num_predict == 0:
            raise ApiError(400, "options.num_predict is 0: give at least 1, or -1 for as many as the context holds",
                           "options.num_predict")
        return None if self.num_predict < 0 else self.num_predict


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")   # keep_alive and the like change nothing here
    model: StrictStr
    stream: StrictBool = True
    options: Options | None = None
    think: Union[StrictBool, StrictStr, None] = None    # a model that reasons apart always shows its reasoning
    format: Any = None
    images: Any = None

    _images = field_validator("images", mode="before")(_refuse("images are not read: the served model reads text only"))


    def grammar(self) -> Grammar | None:
        """The grammar `format` asks for: "json" any JSON object, an object a JSON Schema the answer must match
        (None: free text); ApiError (400) naming what is wrong. Compiling takes a while: call it off the event loop."""
        if self.format is None or self.format == "":
            return None
        try:
            if self.format == "json":
                return json_object_grammar()
            if isinstance(self.format, dict):
                return json_schema_grammar(self.format)
        except ColibriError as exc:
            raise ApiError(400, f"format: {exc}", "format") from None
        raise ApiError(400, 'format must be "json" or a JSON Schema object', "format")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr = ""
    thinking: StrictStr | None = None
    tool_name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    images: Any = None

    _images = field_validator("images", mode="before")(_refuse("images are not read: the served model reads text only"))


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Any = None           # OpenAI-shaped function tools, checked by app.server.tool_calls.openai_tools


class GenerateBody(_Body):
    prompt: StrictStr = ""
    system: StrictStr | None = None
    raw: StrictBool = False
    context: list[StrictInt] | None = None
    suffix: Any = None
    template: Any = None

    _suffix = field_validator("suffix", mode="before")(_refuse("text after the completion (`suffix`) is not supported"))
    _template = field_validator("template", mode="before")(_refuse("the model's own chat template is used; "
                                                                    "leave out `template` or send `raw` prompts"))


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    name: StrictStr | None = None           # the older spelling of `model`
    verbose: StrictBool = False


# --------------------------------------------------------------------------- routes


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as chat-template messages: a tool turn named after its tool, an assistant turn's calls in
    the function form templates read (Ollama sends {"function": {"name", "arguments"}})."""
    out = []
    for i, m in enumerate(messages):
        calls = None
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                fn = c.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}]: give the call as "
                                        "{\"function\": {\"name\": ..., \"arguments\": {...}}}", "messages")
                calls.append({"type": "function", "function": {
                    "name": fn["name"], "arguments": arguments(fn.get("arguments", {}), "messages")}})
        out.append({"role": m.role, "content": m.content, "reasoning_content": m.thinking, "name": m.tool_name,
                    "tool_calls": calls})
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _size(path: Path) -> int:
    """Bytes of the model's files."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0


def family(architecture: str) -> str:
    """The family name Ollama shows for an architecture: `MixtralForCausalLM` -> `mixtral` (a GGUF's `llama` stays)."""
    return re.sub(r"For(CausalLM|ConditionalGeneration)$", "", architecture).lower()


def add_ollama_routes(app: FastAPI, engine: Served) -> None:
    """Ollama's API on the model `engine` serves."""
    tokenizer = engine.service.tokenizer
    info = engine.info
    tag = info.name if ":" in info.name else f"{info.name}:latest"
    size = _size(Path(info.path))
    digest = hashlib.sha256(f"{info.name}:{size}".encode()).hexdigest()      # stable per model, tells nothing
    reasons = tokenizer is not None and tokenizer.reasoning_format is not None
    arch = family(info.architecture)
    parameter_size, quantization = model_details(Path(info.path))     # read once: the model does not change

    def _check_model(name: str) -> None:
        if name not in (tag, info.name, "colibri", "default", "colibri:latest", "default:latest"):
            raise ApiError(404, f"model {name!r} not found; this server serves {tag!r} (GET /api/tags)",
                           "model", "model_not_found")

    def _details() -> dict:
        return {"parent_model": "", "format": "colibri" if Path(info.path).is_dir() else "gguf",
                "family": arch, "families": [arch], "parameter_size": parameter_size,
                "quantization_level": quantization}

    def _entry() -> dict:
        return {"name": tag, "model": tag, "modified_at": datetime.fromtimestamp(engine.started, timezone.utc)
                .isoformat().replace("+00:00", "Z"), "size": size, "digest": digest, "details": _details()}

    @app.get("/api/version", responses=responses(401, api="ollama"))
    async def version():
        return {"version": VERSION}

    @app.get("/api/tags", responses=responses(401, api="ollama"))
    async def tags():
        return {"models": [_entry()]}

    @app.get("/api/ps", responses=responses(401, api="ollama"))
    async def ps():
        return {"models": [{**_entry(), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                            "context_length": engine.ctx}]}

    @app.post("/api/show", responses=responses(400, 401, 404, 413, api="ollama"))
    async def show(body: ShowBody):
        name = body.model or body.name
        if name is None:
            raise ApiError(400, "model: give the model's name (GET /api/tags lists it)", "model")
        _check_model(name)
        model_info: dict[str, Any] = {"general.architecture": arch, f"{arch}.context_length": info.max_context,
                                      f"{arch}.block_count": info.n_layers}
        if info.n_experts:
            model_info[f"{arch}.expert_count"] = info.n_experts
            model_info[f"{arch}.expert_used_count"] = info.top_k
        capabilities = ["completion"] + (["tools"] if tokenizer is not None and tokenizer.tool_format else []) + \
            (["thinking"] if reasons else [])
        return {"modelfile": "", "parameters": "", "template": "", "details": _details(), "model_info": model_info,
                "capabilities": capabilities, "modified_at": _entry()["modified_at"]}

    @app.post("/api/chat", responses=responses(400, 401, 404, 408, 413, 429, 503, api="ollama", ndjson=True))
    async def chat(body: ChatBody, request: Request):
        _check_model(body.model)
        if tokenizer is None or not tokenizer.has_chat_template:
            raise ApiError(400, f"{info.name} has no chat template; use /api/generate with `raw`", "messages")
        tools = openai_tools(body.tools, None, tokenizer)
        prompt, text = render_chat(tokenizer, template_messages(body.messages), tools)
        reasoning = answer_reasoning(tokenizer, text, tools)
        return await _generate(body, prompt, request, chat=True, reasoning=reasoning, tools=tools)

    @app.post("/api/generate", responses=responses(400, 401, 404, 408, 413, 429, 503, api="ollama", ndjson=True))
    async def generate(body: GenerateBody, request: Request):
        _check_model(body.model)
        if not body.prompt and not body.context:    # Ollama's way to load a model: it is loaded
            return {"model": body.model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        context = list(body.context or ())
        bad = [t for t in context if not 0 <= t < info.vocab_size]
        if bad:
            raise ApiError(400, f"context: token id {bad[0]} is outside the vocabulary (0..{info.vocab_size - 1}); "
                                "send back the `context` an answer gave", "context")
        if tokenizer is None:
            raise ApiError(400, f"{info.name} has no tokenizer: /api/generate needs one", "prompt")
        reasoning = None
        try:
            if body.raw or not tokenizer.has_chat_template:
                text = body.prompt
                ids = tokenizer.encode(text, add_special_tokens=not context)
            else:
                turns = ([{"role": "system", "content": body.system}] if body.system else []) + \
                        [{"role": "user", "content": body.prompt}]
                text = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
                fmt = tokenizer.reasoning_format
                reasoning = fmt.after(text) if fmt else None
        except ColibriError as exc:
            raise ApiError(400, str(exc), "prompt") from None
        return await _generate(body, context + ids, request, chat=False, reasoning=reasoning)

    async def _generate(body: _Body, prompt: list[int], request: Request, chat: bool, reasoning,
                        tools: Tools | None = None):
        options = body.options or Options()
        limit = budget(options.limit(), len(prompt), engine.ctx, "messages" if chat else "prompt")
        # compiling takes a while: off the event loop, in one call (one worker of its executor, not two)
        grammar = await asyncio.to_thread(lambda: answer_grammar(body.grammar(), tools, "format", reasoning))
        ticket = start(engine, prompt, request, max_tokens=limit.max_tokens, sampling=options.sampling(),
                       stops=options.stops(), reasoning=reasoning, grammar=grammar, speculative=options.speculative)
        if body.stream:
            return StreamingResponse(_stream(ticket, body.model, prompt, chat, AnswerSplitter(tools)),
                                     media_type="application/x-ndjson")
        return await _whole(ticket, body.model, prompt, chat, request.url.path, AnswerSplitter(tools))

    def _part(model: str, chat: bool, text: str, thinking: str, calls: list[ToolCall] = ()) -> dict:
        out: dict[str, Any] = {"model": model, "created_at": _now()}
        if chat:
            out["message"] = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
            if calls:
                out["message"]["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}}
                                                for c in calls]
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        return out

    def _final(model: str, prompt: list[int], chat: bool, done: DoneEvent, t0: float) -> dict:
        s = done.stats
        out = {**_part(model, chat, "", ""), "done": True, "done_reason": "length" if done.finish_reason == "length"
               else "stop", "total_duration": int((time.monotonic() - t0) * 1e9), "load_duration": 0,
               "prompt_eval_count": len(prompt), "prompt_eval_duration": int(s.prompt_s * 1e9),
               "eval_count": len(done.tokens), "eval_duration": int(s.decode_s * 1e9)}
        if not chat:
            out["context"] = [*prompt, *done.tokens]
        return out

    async def _whole(ticket: Ticket, model: str, prompt: list[int], chat: bool, path: str, split: AnswerSplitter):
        t0 = ticket.submitted
        async for event in events(ticket):
            if isinstance(event, ErrorEvent):
                raise ApiError(400, event.message)
        assert isinstance(event, DoneEvent)
        if event.finish_reason == "cancelled":      # the client left (its ticket's watcher saw it): nobody reads
            return error(499, "the client closed the request", path=path)
        final = _final(model, prompt, chat, event, t0)
        pieces = split.feed(event.text) + split.flush()
        prose = "".join(p for p in pieces if isinstance(p, str))
        return {**final, **_part(model, chat, prose, event.reasoning, split.calls), "created_at": final["created_at"]}

    async def _stream(ticket: Ticket, model: str, prompt: list[int], chat: bool, split: AnswerSplitter):
        t0 = ticket.submitted
        async for event in events(ticket):
            if isinstance(event, ErrorEvent):
                yield json.dumps({"error": event.message}) + "\n"
                return
            text, thinking = ((event.text, event.reasoning) if isinstance(event, TokenEvent)
                              else (event.tail, event.reasoning_tail))
            pieces = split.feed(text) + (split.flush() if isinstance(event, DoneEvent) else [])
            prose = "".join(p for p in pieces if isinstance(p, str))
            calls = [p for p in pieces if isinstance(p, ToolCall)]
            if prose or thinking or calls:      # a call comes whole, in its own line, as Ollama sends it
                yield json.dumps({**_part(model, chat, prose, thinking, calls), "done": False},
                                 ensure_ascii=False) + "\n"
            if isinstance(event, DoneEvent):
                yield json.dumps(_final(model, prompt, chat, event, t0), ensure_ascii=False) + "\n"
