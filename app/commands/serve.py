"""`colibri serve MODEL`: the model behind OpenAI-, Anthropic- and Ollama-compatible HTTP APIs (see app.server.app)."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from app.commands._common import add_model_argument, add_speculative_argument
from app.commands._memory import add_memory_arguments, load_options
from engine.errors import ColibriError

MAX_CONNECTIONS = 512       # app.server.http.HttpLimits' default (not imported here: `colibri` starts without uvicorn)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` command."""
    parser = subparsers.add_parser(
        "serve", help="serve a model over OpenAI-, Anthropic- and Ollama-compatible HTTP APIs",
        description="Serve MODEL on /v1/chat/completions, /v1/completions and /v1/models (streamed or not), "
        "Anthropic's /v1/messages and Ollama's /api/chat, /api/generate, /api/tags ..., with "
        "/health, /metrics (Prometheus) and /v1/telemetry (server-sent events). Concurrent requests decode "
        "together; past --max-queue waiting requests the answer is 429. Binds to loopback unless told otherwise. "
        "A request head must arrive within 10 s and its body within 30 s (else 408); heads over 16 KiB get 431; "
        "past --max-connections the longest-idle connection is closed, or, if all are busy, the answer is 503.",
    )
    add_model_argument(parser, required=False)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health")
    parser.add_argument("--max-queue", type=int, default=16, metavar="N",
                        help="requests that may wait for room in the batch before 429 (default 16)")
    parser.add_argument("--max-batch", type=int, default=4, metavar="N", help="requests decoded together (default 4)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="allow browser pages from ORIGIN (repeatable; default: no CORS)")
    parser.add_argument("--max-body", type=int, default=4 << 20, metavar="BYTES",
                        help="largest request body accepted (default 4 MiB)")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                        help=f"open connections held at once, idle ones included (default {MAX_CONNECTIONS})")
    parser.add_argument("--ctx", type=int, default=None, metavar="N",
                        help="context per request in tokens (default 4096 or the model's, if less)")
    add_memory_arguments(parser)
    add_speculative_argument(parser)
    parser.set_defaults(func=_run)


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise ColibriError(f"--port {args.port}: use 1 to 65535")
    if args.max_batch < 1 or args.max_queue < 0:
        raise ColibriError(f"--max-batch {args.max_batch} / --max-queue {args.max_queue}: the batch needs at least 1 "
                           "request, the queue 0 or more")
    if args.max_body < 1024:
        raise ColibriError(f"--max-body {args.max_body}: allow at least 1024 bytes")
    if args.max_connections <= args.max_batch + args.max_queue:
        raise ColibriError(f"--max-connections {args.max_connections} leaves no room beside the {args.max_batch} "
                           f"running and {args.max_queue} queued requests (for /health, say): allow at least "
                           f"{args.max_batch + args.max_queue + 1}")
    if args.api_key is not None and len(args.api_key) < 8:
        raise ColibriError("--api-key is shorter than 8 characters: use a longer, random key")


def is_loopback(host: str) -> bool:
    """Whether host names this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run(args: argparse.Namespace) -> int:
    from app.server.app import create_app
    from app.server.http import HttpLimits, Server, build_config, check_fd_limit
    from app.service.local import EngineService

    _check(args)
    check_fd_limit(args.max_connections)      # before the model loads: fail fast
    if not is_loopback(args.host):
        print(f"warning: serving on {args.host} reaches beyond this machine"
              + ("" if args.api_key else "; anyone who can reach it may use it (set --api-key)"), file=sys.stderr)
    options = load_options(args, max_batch=args.max_batch)    # no --ctx: 4096 or the model's limit, if less
    # the engine service the desktop app drives too: one engine thread, requests batched by its scheduler
    with EngineService(max_queue=args.max_queue, name="colibri-serve-engine") as service:
        print(f"loading {args.model} ...", file=sys.stderr)
        info = service.load_and_wait(args.model, options)
        app = create_app(service, api_key=args.api_key, cors_origins=tuple(args.cors_origin), max_body=args.max_body)
        s = info.settings
        memory = f", budget {s.memory_budget / 2**30:.2f} GiB, streaming {info.streaming}" if s.memory_budget else ""
        print(f"serving {info.name} on http://{args.host}:{args.port}/v1 (context {s.context_length}, "
              f"batch {args.max_batch}{memory})", file=sys.stderr)
        limits = HttpLimits(max_connections=args.max_connections)
        Server(build_config(app, host=args.host, port=args.port, limits=limits)).run()
    return 0

