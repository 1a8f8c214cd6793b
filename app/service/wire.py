"""The wire of a Colibri server as the desktop app reads it (no threads, no Qt): server-sent events,
the server's address, its errors in words with the fix, the served model's description
(`/v1/models`) as a ModelInfo, and the body of a streamed completion. `app.service.remote` drives them.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from app.service.messages import EngineSettings, GenerateRequest, ModelInfo
from engine.errors import ColibriError

DEFAULT_PORT = 8080             # `colibri serve`'s, for an address that names none
CONNECT_TIMEOUT = 5.0           # s to open a connection and get an answer to a plain GET
MAX_LINE = 64 << 20             # bytes of one server-sent line (a telemetry event of a very large MoE is ~1 MB)
SETTINGS = ("memory_budget", "prefetch_depth", "io_threads", "context_length")


# ---- server-sent events ------------------------------------------------------------------------


@dataclass(frozen=True)
class SSEEvent:
    """One server-sent event: its data lines joined with newlines, its type and its last id."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    """Server-sent events from lines, by the WHATWG rules that matter here.

    `data:` lines join with newlines; a blank line ends an event (none without data); lines starting
    with ':' are comments (keep-alives, counted); `event:` names and `id:` numbers it; one space after
    the colon is dropped; other fields (`retry:`) are ignored.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self.comments = 0

    def feed(self, line: str) -> SSEEvent | None:
        """Take one line (with or without its line ending); the event it completes, if any."""
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent("\n".join(self._data), self._event or "message", self._id)
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            self.comments += 1
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None


def iter_sse(lines: Iterable[bytes | str], parser: SSEParser | None = None) -> Iterator[SSEEvent]:
    """The events of a stream of lines (bytes are UTF-8); an event cut off by the end is dropped."""
    parser = parser or SSEParser()
    for line in lines:
        event = parser.feed(line.decode("utf-8") if isinstance(line, bytes) else line)
        if event is not None:
            yield event


def read_lines(response: http.client.HTTPResponse) -> Iterator[bytes]:
    """A response's lines until it ends; ValueError for a line over MAX_LINE."""
    while True:
        line = response.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE:
            raise ValueError(f"a server-sent line is over {MAX_LINE} bytes")
        yield line


# ---- addresses and errors -------------------------------------------------------------------------


class RemoteError(ColibriError):
    """The server could not be reached, refused the request, or answered something else than expected."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param   # the HTTP status and OpenAI error fields


@dataclass(frozen=True)
class Endpoint:
    """Where the server listens: scheme, host, port and the path before /v1."""

    scheme: str
    host: str
    port: int
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """`host`, `host:port`, `http://host:port`, `https://host/prefix`, with or without a trailing /v1."""
        text = url.strip()
        if "://" not in text:
            text = "http://" + text
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ColibriError(f"--remote {url!r}: give the server's address as http://HOST:PORT "
                               f"(e.g. http://192.168.1.20:{DEFAULT_PORT})")
        try:
            port = parts.port
        except ValueError:
            raise ColibriError(f"--remote {url!r}: the port is not a number from 1 to 65535") from None
        if port is None:
            port = DEFAULT_PORT if "://" not in url else (443 if parts.scheme == "https" else 80)
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        return cls(parts.scheme, parts.hostname, port, prefix)

    @property
    def url(self) -> str:
        """The address as people write it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"


def unreachable(endpoint: Endpoint, exc: BaseException) -> str:
    """Why the server could not be reached, and what to do."""
    e, url = endpoint, endpoint.url
    if isinstance(exc, ConnectionRefusedError):
        return (f"cannot reach {url}: nothing listens on port {e.port} there. Start the server on that "
                f"machine (`colibri serve MODEL --host 0.0.0.0 --port {e.port}`) or fix the address")
    if isinstance(exc, socket.gaierror):
        return f"cannot reach {url}: the host name {e.host!r} is unknown; check the address"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return (f"cannot reach {url}: no answer within {CONNECT_TIMEOUT:.0f} s. Check the address, that the "
                "server listens beyond its own machine (`--host 0.0.0.0`) and that no firewall is in the way")
    if isinstance(exc, ssl.SSLError):
        return f"cannot reach {url}: TLS failed ({exc.reason or exc}); is it https, with a valid certificate?"
    if isinstance(exc, (ConnectionResetError, http.client.RemoteDisconnected, http.client.BadStatusLine)):
        return f"{url} closed the connection without an answer; is it a Colibri server (`colibri serve`)?"
    return f"cannot reach {url}: {exc}"


def refusal(endpoint: Endpoint, api_key: str | None, response: http.client.HTTPResponse) -> RemoteError:
    """An HTTP error answer (OpenAI's error shape, or anything else) in words, with the fix where there is one."""
    url = endpoint.url
    try:
        error = json.loads(response.read(1 << 20))["error"]
        detail, code, param = str(error["message"]), error.get("code"), error.get("param")
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError):
        detail, code, param = response.reason, None, None
    status = response.status
    if status == 401 and api_key is None:
        message = (f"{url} needs an API key: start the app with `colibri gui --remote {url} --api-key KEY`, "
                   "the key the server was given (`colibri serve --api-key KEY`)")
    elif status == 401:
        message = (f"{url} refused the API key: give --api-key the key the server was started with "
                   "(`colibri serve --api-key KEY`)")
    elif status == 429:
        message = f"{url} is busy: {detail}"
    else:
        message = f"{url} answered {status}: {detail}"
    return RemoteError(message, status, code, param)


# ---- what the server says of its model, what a completion asks --------------------------------


def fixed_reason(url: str) -> str:
    """Why a setting of the server at url cannot change from here."""
    return (f"set where the server runs ({url}): restart `colibri serve` there with other flags "
            "(--max-memory, --prefetch-depth, --io-threads, --ctx) to change it")


def model_info(models: Any, url: str) -> ModelInfo:
    """The ModelInfo of the first model a /v1/models answer lists (with its `colibri` description)."""
    try:
        entry = models["data"][0]
        name = str(entry["id"])
    except (KeyError, IndexError, TypeError):
        raise RemoteError(f"{url}/v1/models lists no model; is it a Colibri server (`colibri serve MODEL`)?") from None
    about = entry.get("colibri")
    if not isinstance(about, dict):
        raise RemoteError(f"{url} serves {name!r} but does not describe it as Colibri does: it is another "
                          "OpenAI-compatible server, or an older `colibri serve`; update Colibri there")
    try:
        settings = about["settings"]
        budget_range = about.get("budget_range")
        reason = fixed_reason(url)
        return ModelInfo(
            path=Path(name), name=str(about.get("name") or name), architecture=str(about["architecture"]),
            n_layers=int(about["n_layers"]), n_experts=int(about["n_experts"]), top_k=int(about["top_k"]),
            chat=bool(about["chat"]), max_context=int(about["max_context"]), streaming=str(about["streaming"] or ""),
            budget_range=(int(budget_range[0]), int(budget_range[1])) if budget_range else None,
            fixed={k: reason for k in SETTINGS},
            settings=EngineSettings(
                memory_budget=int(settings["memory_budget"]) if settings.get("memory_budget") is not None else None,
                prefetch_depth=int(settings["prefetch_depth"]), io_threads=int(settings["io_threads"]),
                context_length=int(settings["context_length"])),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise RemoteError(f"{url}/v1/models describes {name!r} without {exc} in the form expected; "
                          "update Colibri on the server or here so both are the same version") from None


def completion_body(req: GenerateRequest, model: str) -> dict:
    """The JSON of a streamed completion for a generate request (OpenAI's fields, Colibri's extensions)."""
    s = req.sampling
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": s.temperature, "top_p": s.top_p, "max_tokens": req.max_tokens}
    if req.messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content, **({"reasoning_content": m.reasoning} if m.reasoning
                                                                      else {})} for m in req.messages]
    else:
        body["prompt"] = list(req.prompt or ())
    if req.stop:
        body["stop"] = list(req.stop)
    if s.seed is not None:
        body["seed"] = s.seed
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty   # not OpenAI's (vLLM's name): a server may ignore it
    if req.logprobs is not None:
        if req.messages is not None:
            body["logprobs"] = True
            body["top_logprobs"] = req.logprobs
        else:
            body["logprobs"] = req.logprobs
    if req.grammar is not None:
        if req.grammar.response_format is None:
            raise RemoteError(f"{req.grammar.what} cannot be asked of a server: only a JSON schema or a JSON object "
                              "(response_format) travels over its API; ask for one of those")
        body["response_format"] = json.loads(req.grammar.response_format)
    return body


def token_scores(choice: dict, chat: bool) -> list[tuple[str, float | None, tuple[tuple[str, float], ...]]]:
    """The (token, log-probability, alternatives) a streamed chunk's choice reports (chat's `logprobs.content` or the
    completions API's parallel lists), in order; [] when it reports none."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return []
    if chat:
        return [(str(e.get("token", "")), e.get("logprob"),
                 tuple((str(t.get("token", "")), float(t["logprob"])) for t in e.get("top_logprobs") or ()))
                for e in lp.get("content") or () if isinstance(e, dict)]
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or ())
    return [(str(t), p, tuple((str(k), float(v)) for k, v in (top or {}).items()))
            for t, p, top in zip(lp.get("tokens") or (), lp.get("token_logprobs") or (), tops)]
