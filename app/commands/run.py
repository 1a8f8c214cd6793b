"""`colibri run MODEL (--prompt TEXT | --tokens 1,2,3)`: one generation, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from app.commands._common import (
    add_model_argument,
    add_sampling_arguments,
    context_length,
    load,
    sampling_from_args,
    speculative_mode,
)
from app.commands._memory import add_memory_arguments, load_options
from app.service.loading import KVOptions, kv_cache
from engine.errors import ColibriError
from engine.tokenizer.text import clean_text


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `run` command."""
    parser = subparsers.add_parser(
        "run",
        help="generate text from a prompt",
        description="Generate from a prompt (text, or token ids with --tokens) and stream the text; "
        "with --json print one JSON object with the generated ids, the text and speed figures. "
        "Greedy by default (--temperature 0).",
    )
    add_model_argument(parser, required=True)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=clean_text, metavar="TEXT", help="the prompt text")
    src.add_argument("--tokens", metavar="1,2,3", help="the prompt as comma-separated token ids")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", type=clean_text, metavar="TEXT", help="a system message (with --chat)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--logits-out", type=Path, metavar="FILE.npy", help="save the prompt's logits, float32 [prompt_len, vocab]")
    add_sampling_arguments(parser, temperature=0.0, repetition_penalty=1.0)
    g = parser.add_argument_group("speculative decoding (the same output, faster when text repeats)")
    g.add_argument("--speculative", nargs="?", const=True, default=False, type=speculative_mode, metavar="mtp",
                   help="draft tokens from n-grams of the context and verify them in one pass; switches itself "
                        "off when it does not pay. `--speculative mtp` drafts with the checkpoint's "
                        "multi-token-prediction layer instead (DeepSeek-V3, GLM-4.5, GLM-5)")
    g.add_argument("--draft", type=int, default=None, metavar="K",
                   help="tokens drafted per step (default 4; 1 with mtp, whose later guesses feed on its own)")
    g.add_argument("--draft-model", metavar="MODEL",
                   help="also draft with a small model sharing the tokenizer (e.g. smollm2-135m for smollm2-moe)")
    add_memory_arguments(parser)
    parser.set_defaults(func=_run)


def parse_token_ids(text: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3], with a clear error for anything else."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ColibriError(f"--tokens {text!r}: expected comma-separated integers such as 1,2,3") from None
    if not ids:
        raise ColibriError("--tokens is empty: give at least one token id")
    return ids


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    """The prompt's token ids from --prompt/--tokens, --chat and --system."""
    if args.system is not None and not args.chat:
        raise ColibriError("--system needs --chat (the system message goes through the chat template)")
    if args.tokens is not None:
        if args.chat:
            raise ColibriError("--chat applies to --prompt text, not to --tokens ids")
        return parse_token_ids(args.tokens)
    if tokenizer is None:
        raise ColibriError("this model has no tokenizer files (tokenizer.json); pass the prompt as --tokens 1,2,3")
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        messages.append({"role": "user", "content": args.prompt})
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    return tokenizer.encode(args.prompt)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save through a temporary file in the same folder, renamed at the end."""
    path = path.expanduser()
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ColibriError(f"--logits-out {path}: folder {folder} does not exist")
    if path.is_dir():
        raise ColibriError(f"--logits-out {path} is a folder: name a file in it, such as {path / 'logits.npy'}")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _run(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    options = load_options(args)
    loaded = load(args.model, quiet=args.json, options=options)
    try:
        return _answer(args, loaded, sampling, KVOptions.of(options))
    finally:
        loaded.close()                      # saves the usage history of a streamed model


def _answer(args: argparse.Namespace, loaded, sampling, kv: KVOptions) -> int:
    from engine.events import DoneEvent, ErrorEvent, PromptLogitsEvent, TokenEvent
    from engine.generation.generate import GenerationRequest, stream_generate

    ids = prompt_ids(args, loaded.tokenizer)
    outside = [i for i in ids if not 0 <= i < loaded.spec.vocab_size]
    if outside:
        raise ColibriError(f"--tokens: id {outside[0]} is outside {loaded.name}'s vocabulary "
                           f"(0..{loaded.spec.vocab_size - 1})")
    request = GenerationRequest(
        prompt=tuple(ids), max_tokens=args.max_tokens, sampling=sampling,
        stop=tuple(args.stop), prompt_logits=args.logits_out is not None,
    )
    cache = kv_cache(loaded.spec, kv, context_length(loaded, args.ctx))
    controller = None
    if args.speculative:
        import dataclasses

        from engine.generation.speculative import SpeculationController, SpeculativeSettings

        draft_model = mtp = None
        if args.speculative == "mtp":
            if args.draft_model is not None:
                raise ColibriError("--speculative mtp drafts with the model's own MTP layer: drop --draft-model "
                                   "(or use --speculative without mtp)")
            from engine.loader import load_mtp

            mtp = load_mtp(loaded.path, loaded.spec)
        if args.draft_model is not None:
            draft = load(args.draft_model, quiet=True)
            if draft.spec.vocab_size != loaded.spec.vocab_size:
                raise ColibriError(f"--draft-model {args.draft_model}: its vocabulary has {draft.spec.vocab_size} "
                                   f"tokens, {loaded.name}'s {loaded.spec.vocab_size}; use a model of the same family")
            draft_model = draft.model
        # one MTP layer is trained for the next token but one: further guesses feed on its own state and are
        # accepted less often, while each one widens the verify pass
        k = args.draft if args.draft is not None else (1 if mtp is not None else 4)
        settings = SpeculativeSettings(max_draft=k, draft_model=draft_model, mtp=mtp)
        settings.validate()
        request = dataclasses.replace(request, speculative=settings)
        controller = SpeculationController(settings)
    elif args.draft_model is not None:
        raise ColibriError("--draft-model needs --speculative")
    done = None
    for event in stream_generate(loaded.model, loaded.tokenizer, request, stop_ids=loaded.stop_ids, cache=cache,
                                 speculation=controller):
        if isinstance(event, ErrorEvent):
            raise ColibriError(event.message)
        if isinstance(event, PromptLogitsEvent):
            save_npy_atomic(args.logits_out, np.ascontiguousarray(event.logits, dtype=np.float32))
        elif isinstance(event, TokenEvent) and not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, DoneEvent):
            done = event
    assert done is not None
    if args.json:
        print(json.dumps({
            "tokens": list(done.tokens),
            "text": done.text,
            "prompt_tokens": len(ids),
            "finish_reason": done.finish_reason,
            "stats": done.stats.as_dict(),
            **({"speculative": controller.as_dict()} if controller is not None else {}),
        }, ensure_ascii=False))
    else:
        sys.stdout.write(done.tail + "\n")
        s = done.stats
        print(
            f"[{s.prompt_tokens} prompt tokens at {s.prompt_tok_s:.1f} tok/s, {len(done.tokens)} generated at "
            f"{s.decode_tok_s:.1f} tok/s, first token after {s.ttft_s:.2f} s, {done.finish_reason}]",
            file=sys.stderr,
        )
        if controller is not None:
            c = controller
            print(f"[speculative{' (MTP)' if args.speculative == 'mtp' else ''}: {c.accepted} of {c.drafted} drafted "
                  f"tokens accepted in {c.draft_steps} steps, "
                  f"drafting {'on' if c.on else 'off'} at the end]", file=sys.stderr)
    return 0
