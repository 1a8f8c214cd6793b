"""What `colibri tune` measures on a real model: the workload, the settings it may change, and one timed run.

The workload is one chat: a fixed question (through the chat template when the model has one; fixed token ids
when it has no tokenizer) answered with `gen` greedy tokens, end-of-sequence ignored so that every run does the
same work. A run is timed from the prompt to the last token, as `colibri run` generates (same KV cache, same
speculation); the load is not timed. With --max-memory every run loads the model afresh with the container's
pages dropped from the page cache and no usage history read or written, so each run starts from the same cold
state and tuning leaves the user's history as it was; a resident model is loaded once and kept.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from app.bench.tune import Axis, Settings, Trial
from engine.errors import ColibriError

QUESTION = "Explain in a few sentences why the sky is blue, then list three other colours of the sky at dusk."
GEN = 32                    # greedy tokens a run generates

# options that only change speed, by the kind of run; each with the values tried (the current value always stays)
STREAMING_AXES = (("prefetch_depth", (0, 1, 2, 3)), ("io_threads", (1, 2, 4, 8)))
EXPERT_AXES = (("cache_policy", ("lru", "lfru", "learned")),)
COMMON_AXES = (("kv_block_size", (16, 32, 64)), ("speculative", (False, True)))
DRAFTS = (2, 4, 8)


def axes_for(streaming: bool, experts: bool, most_threads: int) -> list[Axis]:
    """The settings to try: streaming ones first (the reason to tune a model larger than memory), then threads,
    KV block size and speculative decoding (its draft length only while it is on)."""
    axes = []
    if streaming:
        axes += [Axis(k, v) for k, v in STREAMING_AXES]
        if experts:
            axes += [Axis(k, v) for k, v in EXPERT_AXES]
    axes.append(Axis("threads", tuple(range(1, most_threads + 1))))
    axes += [Axis(k, v) for k, v in COMMON_AXES]
    axes.append(Axis("draft", DRAFTS, applies=lambda s: s.get("speculative") is True))
    return axes


def workload(tokenizer, vocab: int) -> list[int]:
    """The prompt's token ids (see the module's docstring)."""
    if tokenizer is None:
        return [1 + i % max(1, vocab - 1) for i in range(32)]
    try:
        return list(tokenizer.encode_chat([{"role": "user", "content": QUESTION}], add_generation_prompt=True))
    except ColibriError:
        return list(tokenizer.encode(QUESTION))             # no chat template


def load_options(settings: Settings):
    """LoadOptions of a run's settings, as `colibri run` builds them (without the usage history)."""
    from app.config.sizes import parse_size
    from app.service.messages import LoadOptions

    if not 0 <= settings["prefetch_depth"] <= 1024:
        raise ColibriError(f"prefetch_depth {settings['prefetch_depth']}: use 0 to 1024 layers")
    if settings["io_threads"] < 1:
        raise ColibriError(f"io_threads {settings['io_threads']}: use at least 1 reader thread")
    mm = settings.get("max_memory")
    return LoadOptions(max_memory=parse_size(mm, "--max-memory") if mm else None, context_length=settings.get("ctx"),
                       prefetch_depth=settings["prefetch_depth"], io=settings["io"],
                       io_threads=settings["io_threads"], cache_policy=settings["cache_policy"],
                       resident_layers=settings.get("resident_layers"), history=False, kv_bits=settings["kv_bits"],
                       kv_block_size=settings["kv_block_size"], overflow=settings["overflow"])


class ModelBench:
    """A `Measure` on a real model: load (or keep) it under the settings, run the workload, time it."""

    def __init__(self, path: Path, gen: int = GEN) -> None:
        self.path, self.gen = Path(path), gen
        self._loaded: Any = None
        self.prompt: list[int] | None = None

    @property
    def streaming(self) -> bool:
        return self._loaded is not None and self._loaded.store is not None

    def close(self) -> None:
        """Close the model held (a resident run keeps it between runs)."""
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None

    def _load(self, settings: Settings):
        from app.bench.offload import drop_caches
        from app.commands._common import load

        options = load_options(settings)
        if options.max_memory is None:          # held whole: no load option applies, one load serves every run
            if self._loaded is None:
                self._loaded = load(str(self.path), quiet=True)
            return self._loaded
        self.close()
        if self.path.is_dir():
            drop_caches(self.path)              # the same cold start for every streamed run
        self._loaded = load(str(self.path), quiet=True, options=options)
        return self._loaded

    def __call__(self, settings: Settings) -> Trial:
        """One timed run of the workload under `settings` (the merged options of `colibri run`)."""
        import time

        from app.bench.decode import thread_limits
        from app.commands._common import context_length
        from app.service.loading import kv_cache
        from engine.events import DoneEvent, ErrorEvent
        from engine.generation.generate import GenerationRequest, stream_generate
        from engine.generation.sampling import SamplingParams

        loaded = self._load(settings)
        if self.prompt is None:
            self.prompt = workload(loaded.tokenizer, loaded.spec.vocab_size)
        from app.service.loading import KVOptions

        kv = KVOptions.of(load_options(settings))
        ctx = context_length(loaded, settings.get("ctx"))
        if len(self.prompt) + self.gen + 1 > ctx:
            raise ColibriError(f"the tuning workload needs {len(self.prompt) + self.gen + 1} positions; the context "
                               f"holds {ctx}: give a larger --ctx or a smaller --gen")
        request = GenerationRequest(prompt=tuple(self.prompt), max_tokens=self.gen,
                                    sampling=SamplingParams(temperature=0.0))
        controller = None
        if settings.get("speculative") is True:
            from engine.generation.speculative import SpeculationController, SpeculativeSettings

            spec = SpeculativeSettings(max_draft=settings.get("draft") or 4)
            spec.validate()
            request = dataclasses.replace(request, speculative=spec)
            controller = SpeculationController(spec)
        cache = kv_cache(loaded.spec, kv, ctx)
        done = None
        with thread_limits(settings["threads"]):
            t0 = time.perf_counter()
            for event in stream_generate(loaded.model, loaded.tokenizer, request, cache=cache,
                                         speculation=controller):
                if isinstance(event, ErrorEvent):
                    raise ColibriError(event.message)
                if isinstance(event, DoneEvent):
                    done = event
            seconds = time.perf_counter() - t0
        if done is None:
            raise ColibriError("the generation ended without its last event")
        if settings.get("max_memory"):
            self.close()                        # the next streamed run starts cold again
        return Trial(tuple(done.tokens), seconds)


def start_settings(merged: Mapping[str, Any]) -> dict[str, Any]:
    """The merged run settings a tune starts from (a `draft` of None is the run's default, 4)."""
    out = dict(merged)
    if out.get("draft") is None:
        out["draft"] = 4
    return out
