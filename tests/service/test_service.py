"""The engine service (no Qt): loading with progress, cancel and errors; streaming generation; Stop
within one token; live settings between tokens without changing the answer; telemetry that
follows the loaded model; the thread always survives and always ends."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from app.service.local import (
    TIER_CACHED,
    TIER_DISK,
    TIER_PINNED,
    TIER_RESIDENT,
    AtlasReady,
    ChatMessage,
    EngineService,
    Generation,
    LoadFailed,
    LoadOptions,
    LoadProgress,
    ModelLoaded,
    SettingsApplied,
    SettingsChange,
)
from engine.errors import ColibriError
from engine.events import DoneEvent, ErrorEvent, TokenEvent
from engine.generation.generate import GenerationRequest, stream_generate
from engine.kv import KVCache
from engine.loader import load_model
from engine.offload.quality import CacheTrace
from engine.offload.story import ExpertCounts
from support.tiny_chat import LAYERS, N_EXPERTS, tiny_models

TIMEOUT = 180
MESSAGES = [{"role": "user", "content": "Hello there, little model."}]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_models(tmp_path_factory.getbasetemp() / "tiny-chat")


@pytest.fixture
def hf(models) -> Path:
    return models[0]


@pytest.fixture
def container(models) -> Path:
    return models[1]


class Events:
    """A service listener that records events and lets the test wait for one."""

    def __init__(self):
        self.items: list = []
        self.cond = threading.Condition()
        self.hooks: list = []       # called on the engine thread with each event

    def __call__(self, event) -> None:
        for hook in self.hooks:
            hook(event)
        with self.cond:
            self.items.append(event)
            self.cond.notify_all()

    def wait(self, pred, timeout: float = TIMEOUT):
        """The first recorded event satisfying pred (waiting for it)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.items:
                    if pred(e):
                        return e
                left = deadline - time.monotonic()
                assert left > 0, f"no such event within {timeout} s; got {[type(e).__name__ for e in self.items]}"
                self.cond.wait(left)

    def of(self, request: int) -> list:
        """The engine events of generation `request`."""
        with self.cond:
            return [e.event for e in self.items if isinstance(e, Generation) and e.request == request]

    def done(self, request: int):
        """Wait for generation `request` to end; its DoneEvent or ErrorEvent."""
        return self.wait(lambda e: isinstance(e, Generation) and e.request == request
                         and isinstance(e.event, (DoneEvent, ErrorEvent))).event


@pytest.fixture
def service():
    events = Events()
    svc = EngineService(events)
    svc.events = events
    yield svc
    svc.close()
    assert not svc.running


def _load(svc: EngineService, path, options: LoadOptions = LoadOptions()) -> ModelLoaded:
    i = svc.load(path, options)
    event = svc.events.wait(lambda e: isinstance(e, (ModelLoaded, LoadFailed)) and e.request == i)
    assert isinstance(event, ModelLoaded), event
    return event


def _generate(svc: EngineService, **kw) -> tuple[list[TokenEvent], DoneEvent]:
    i = svc.generate(**kw)
    done = svc.events.done(i)
    assert isinstance(done, DoneEvent), done
    return [e for e in svc.events.of(i) if isinstance(e, TokenEvent)], done


def _settings(svc: EngineService, change: SettingsChange) -> SettingsApplied:
    i = svc.update_settings(change)
    return svc.events.wait(lambda e: isinstance(e, SettingsApplied) and e.request == i)


# ---- loading ------------------------------------------------------------------------------------


def test_a_folder_loads_whole_with_progress_and_says_why_its_budget_is_fixed(service, hf):
    loaded = _load(service, hf)
    info = loaded.info
    assert (info.n_layers, info.n_experts, info.top_k, info.chat) == (LAYERS, N_EXPERTS, 2, True)
    assert info.streaming == "" and info.budget_range is None and info.settings.memory_budget is None
    assert "held whole" in info.fixed["memory_budget"] and "colibri convert" in info.fixed["memory_budget"]
    progress = [e for e in service.events.items if isinstance(e, LoadProgress)]
    assert progress and progress[-1].fraction == 1.0
    assert service.info == info


def test_a_container_streams_its_experts_under_a_budget(service, container):
    info = _load(service, container).info
    assert info.streaming == "experts" and not info.fixed
    least, full = info.budget_range
    assert least < full and info.settings.memory_budget == full   # everything fits by default here
    info = _load(service, container, LoadOptions(max_memory=least, prefetch_depth=2)).info
    assert info.settings.memory_budget == least and info.settings.prefetch_depth == 2


@pytest.mark.parametrize("path, words", [
    ("/nonexistent/model", "not found"),
    ("__broken__", "config.json"),
])
def test_a_model_that_fails_to_load_is_reported_and_the_engine_stays_up(service, hf, tmp_path, path, words):
    if path == "__broken__":
        path = tmp_path / "broken"
        shutil.copytree(hf, path)
        (path / "config.json").write_text("{ not json")
    i = service.load(path)
    failed = service.events.wait(lambda e: isinstance(e, LoadFailed) and e.request == i)
    assert words in failed.message and not failed.cancelled
    assert service.info is None and service.running
    _load(service, hf)     # the next load works


def test_a_model_that_cannot_open_leaves_the_one_in_use_answering(service, hf, tmp_path):
    _load(service, hf)
    tokens, _ = _generate(service, messages=MESSAGES, max_tokens=8)
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    (broken / "config.json").write_text("{ not json")
    i = service.load(broken)
    failed = service.events.wait(lambda e: isinstance(e, LoadFailed) and e.request == i)
    assert "config.json" in failed.message
    assert failed.kept is not None and failed.kept == service.info and failed.kept.name == hf.name   # still loaded
    again, _ = _generate(service, messages=MESSAGES, max_tokens=8)
    assert [t.token_id for t in again] == [t.token_id for t in tokens]                        # and answers alike


def test_a_model_that_fails_once_the_one_in_use_closed_opens_that_one_again(service, hf, tmp_path, monkeypatch):
    """A load that fails after the model in use was closed for it (a file unreadable past its header) opens that
    model again, with the settings it had live, and answers as before."""
    import engine.loader

    _load(service, hf)
    live = _settings(service, SettingsChange(context_length=96)).info
    tokens, _ = _generate(service, messages=MESSAGES, max_tokens=8)
    other = tmp_path / "other"
    shutil.copytree(hf, other)
    real = engine.loader.load_model

    def load_model(path, *a, **k):
        if Path(path) == other:
            raise OSError(5, "Input/output error", str(other / "model.safetensors"))
        return real(path, *a, **k)
    monkeypatch.setattr(engine.loader, "load_model", load_model)
    i = service.load(other)
    failed = service.events.wait(lambda e: isinstance(e, LoadFailed) and e.request == i)
    assert "Input/output error" in failed.message
    assert failed.kept is not None and failed.kept == service.info and failed.kept.name == hf.name
    assert service.info.settings == live.settings and live.settings.context_length == 96
    again, _ = _generate(service, messages=MESSAGES, max_tokens=8)
    assert [t.token_id for t in again] == [t.token_id for t in tokens]


def test_loading_can_be_cancelled(service, hf):
    service.events.hooks.append(lambda e: isinstance(e, LoadProgress) and service.cancel(e.request))
    i = service.load(hf)
    failed = service.events.wait(lambda e: isinstance(e, LoadFailed) and e.request == i)
    assert failed.cancelled and "cancelled" in failed.message
    assert service.info is None


def test_streaming_a_folder_is_refused_with_the_fix(service, hf):
    i = service.load(hf, LoadOptions(max_memory=10**9))
    failed = service.events.wait(lambda e: isinstance(e, LoadFailed) and e.request == i)
    assert "colibri convert" in failed.message


# ---- generation ---------------------------------------------------------------------------------


def test_chat_messages_stream_tokens_that_add_up_to_the_answer(service, hf):
    _load(service, hf)
    tokens, done = _generate(service, messages=MESSAGES, max_tokens=24)
    assert done.finish_reason == "length" and len(done.tokens) == 24
    assert [t.index for t in tokens] == list(range(24))
    assert "".join(t.text for t in tokens) + done.tail == done.text and done.text
    # the same answer as the engine gives directly (greedy)
    loaded = load_model(hf)
    prompt = loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    direct = list(stream_generate(loaded.model, loaded.tokenizer, GenerationRequest(tuple(prompt), 24),
                                  stop_ids=loaded.stop_ids, cache=KVCache(loaded.spec, 2048)))
    assert direct[-1].tokens == done.tokens


def test_the_next_turn_of_a_chat_starts_from_its_cached_prefix(service, container):
    _load(service, container)
    _, first = _generate(service, messages=MESSAGES, max_tokens=8)
    pool = service._model.pool
    hits = pool.hits
    follow = MESSAGES + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    _, again = _generate(service, messages=follow, max_tokens=8)
    assert pool.hits > hits                                    # earlier turns' blocks were taken, not recomputed
    loaded = load_model(container)
    prompt = loaded.tokenizer.encode_chat(list(follow), add_generation_prompt=True)
    direct = list(stream_generate(loaded.model, loaded.tokenizer, GenerationRequest(tuple(prompt), 8),
                                  stop_ids=loaded.stop_ids, cache=KVCache(loaded.spec, 2048)))
    assert direct[-1].tokens == again.tokens                   # and the answer is the one computed afresh
    assert pool.used_blocks == 0                               # nothing held between requests but cached prefixes


def test_token_ids_generate_too_and_errors_end_the_request(service, hf):
    i = service.generate([5, 6, 7], max_tokens=4)
    assert "no model" in service.events.done(i).message
    _load(service, hf)
    tokens, done = _generate(service, prompt=[5, 6, 7, 8], max_tokens=6)
    assert len(tokens) == 6
    i = service.generate([5] * 4000, max_tokens=4)              # longer than the context
    assert isinstance(service.events.done(i), ErrorEvent)
    with pytest.raises(ValueError):
        service.generate()


def test_each_answer_asks_for_its_drafting_mode(service, hf):
    """"lookup" drafts by prompt lookup whatever the load said, and gives the plain answer; "mtp" on a model
    without an MTP head, or a mode that does not exist, ends the request saying why."""
    info = _load(service, hf).info
    assert not info.mtp
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7]
    _, plain = _generate(service, prompt=prompt, max_tokens=8, speculative=False)
    _, drafted = _generate(service, prompt=prompt, max_tokens=8, speculative="lookup")
    assert drafted.tokens == plain.tokens
    i = service.generate(prompt, max_tokens=4, speculative="mtp")
    assert "no MTP layers" in service.events.done(i).message
    i = service.generate(prompt, max_tokens=4, speculative="medusa")
    assert "ask for \"lookup\"" in service.events.done(i).message


def test_stop_takes_effect_within_one_token(service, hf):
    _load(service, hf)
    stop_at = 5
    service.events.hooks.append(
        lambda e: isinstance(e, Generation) and isinstance(e.event, TokenEvent) and e.event.index == stop_at - 1
        and service.cancel(e.request))
    tokens, done = _generate(service, messages=MESSAGES, max_tokens=500)
    assert done.finish_reason == "cancelled"
    assert len(done.tokens) == stop_at and len(tokens) == stop_at


def test_cancel_all_drops_queued_requests(service, hf):
    _load(service, hf, LoadOptions(max_batch=1))        # the second waits for room in the batch
    service.events.hooks.append(
        lambda e: isinstance(e, Generation) and isinstance(e.event, TokenEvent) and e.event.index == 1
        and service.cancel())
    first = service.generate(messages=MESSAGES, max_tokens=500)
    second = service.generate(messages=MESSAGES, max_tokens=500)
    assert service.events.done(first).finish_reason == "cancelled"
    second_done = service.events.done(second)
    assert second_done.finish_reason == "cancelled" and second_done.tokens == ()


def _direct(path, prompt, n):
    loaded = load_model(path)
    out = list(stream_generate(loaded.model, loaded.tokenizer, GenerationRequest(tuple(prompt), n),
                               stop_ids=loaded.stop_ids, cache=KVCache(loaded.spec, 2048)))
    return out[-1].tokens


def test_generations_run_together_and_each_gets_the_answer_it_gets_alone(service, container):
    info = _load(service, container, LoadOptions(max_batch=3)).info
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    overlap = []

    def watch(e):   # on the engine thread: how many generations were under way at each token
        if isinstance(e, Generation) and isinstance(e.event, TokenEvent):
            overlap.append(service.batch)

    service.events.hooks.append(watch)
    ids = [service.generate(p, max_tokens=12) for p in prompts]
    answers = [service.events.done(i) for i in ids]
    assert max(overlap) == 3                         # all three decoded in the same steps
    for prompt, done in zip(prompts, answers):
        assert done.tokens == _direct(info.path, prompt, 12)
    assert service.kv_usage()[1] == 0 and service.queue_depth == 0


def test_past_max_queue_waiting_generations_are_refused(container):
    from app.service.local import QueueFull

    events = Events()
    with EngineService(events, max_queue=1) as svc:
        svc.events = events
        _load(svc, container, LoadOptions(max_batch=1))
        running = svc.generate([5, 6, 7], max_tokens=400)
        waiting = svc.generate([5, 6, 7], max_tokens=4)
        with pytest.raises(QueueFull, match="--max-queue 1"):
            svc.generate([5, 6, 7], max_tokens=4)
        assert svc.queue_depth >= 1
        svc.cancel(running)
        assert svc.events.done(waiting).finish_reason == "length"
        assert svc.generate([5, 6], max_tokens=2)    # room again
        svc.cancel()


def test_requests_take_effect_in_the_order_they_were_made(service, hf, container):
    _load(service, hf)
    before = service.generate([5, 6, 7], max_tokens=40)
    load = service.load(container)
    after = service.generate([5, 6, 7], max_tokens=6)
    last = service.events.done(after)
    order = [(type(e).__name__, e.request) for e in service.events.items
             if isinstance(e, ModelLoaded) or (isinstance(e, Generation) and isinstance(e.event, DoneEvent))]
    assert order[-3:] == [("Generation", before), ("ModelLoaded", load), ("Generation", after)]
    assert service.events.done(before).finish_reason == "length"  # the load waited for it to end, uncancelled
    assert last.tokens == _direct(container, [5, 6, 7], 6)         # and the next one ran on the new model


def test_a_failing_listener_does_not_stop_the_engine(hf):
    events = Events()

    def listener(event):
        events(event)
        raise RuntimeError("a broken view")

    with EngineService(listener) as svc:
        svc.events = events
        _load(svc, hf)
        _, done = _generate(svc, messages=MESSAGES, max_tokens=3)
        assert len(done.tokens) == 3


# ---- live settings ------------------------------------------------------------------------------


def test_a_smaller_budget_evicts_experts_and_never_changes_the_answer(service, container):
    info = _load(service, container).info
    least, full = info.budget_range
    _, reference = _generate(service, messages=MESSAGES, max_tokens=20)
    cache_before = service.snapshot().gauges["expert_cache"]
    applied = _settings(service, SettingsChange(memory_budget=least))
    assert applied.problems == () and applied.info.settings.memory_budget == least
    snap = service.snapshot()
    assert snap.gauges["budget"] == least
    assert snap.gauges["expert_cache"] == cache_before - (full - least)   # the cache gives up the difference
    _, smaller = _generate(service, messages=MESSAGES, max_tokens=20)
    assert smaller.tokens == reference.tokens
    snap = service.snapshot()
    assert snap.hits["disk"] > 0 and snap.occupancy["disk"] > 0
    # changed between two tokens of a running generation: applied before it ends, same answer
    seen: list = []
    service.events.hooks.append(
        lambda e: isinstance(e, Generation) and isinstance(e.event, TokenEvent) and e.event.index == 3
        and seen.append(service.update_settings(SettingsChange(memory_budget=full, prefetch_depth=0))))
    i = service.generate(messages=MESSAGES, max_tokens=20)
    done = service.events.done(i)
    applied = service.events.wait(lambda e: isinstance(e, SettingsApplied) and e.request == seen[0])
    assert service.events.items.index(applied) < service.events.items.index(
        next(e for e in service.events.items if isinstance(e, Generation) and e.event is done))
    assert applied.info.settings.memory_budget == full and applied.info.settings.prefetch_depth == 0
    assert done.tokens == reference.tokens


def test_settings_the_model_cannot_take_are_refused_with_the_reason(service, hf, container):
    info = _load(service, container).info
    least, _ = info.budget_range
    applied = _settings(service, SettingsChange(memory_budget=least // 2, io_threads=99))
    assert any("too small" in p for p in applied.problems) and any("io-threads" in p for p in applied.problems)
    assert applied.info.settings == info.settings
    applied = _settings(service, SettingsChange(io_threads=3, context_length=512))
    assert applied.problems == ()
    assert (applied.info.settings.io_threads, applied.info.settings.context_length) == (3, 512)
    assert applied.info.budget_range[0] < least           # a shorter context needs less KV cache
    _load(service, hf)
    applied = _settings(service, SettingsChange(memory_budget=10**9, context_length=100))
    assert len(applied.problems) == 1 and "held whole" in applied.problems[0]
    assert applied.info.settings.context_length == 100
    i = service.generate(messages=[{"role": "user", "content": "x" * 120}], max_tokens=4)
    assert "context holds 100" in service.events.done(i).message   # the next KV cache has the new length


def test_settings_without_a_model_say_so(service):
    applied = _settings(service, SettingsChange(prefetch_depth=2))
    assert applied.info is None and "no model" in applied.problems[0]


# ---- telemetry ----------------------------------------------------------------------------------


def test_subscriptions_follow_every_loaded_model_until_closed(service, hf, container):
    snaps, grids, traces, counts = [], [], [], []
    sub = service.subscribe(snaps.append)
    tiers = service.subscribe_tiers(grids.append)
    cache = service.subscribe_cache(traces.append)
    stories = service.subscribe_expert_counts(counts.append)
    _load(service, hf)
    _generate(service, messages=MESSAGES, max_tokens=5)
    assert snaps[-1].tokens == 4 and snaps[-1].heat.shape == (LAYERS, N_EXPERTS)   # the first token is prefill's
    gauges = snaps[-1].gauges
    assert gauges["rss"] > 0 and gauges["kv_bytes"] > 0 and gauges["ttft"] > 0 and "budget" not in gauges
    assert (grids[-1] == TIER_RESIDENT).all()
    assert traces and traces[-1] is None and counts[-1] is None   # experts held whole: no cache to meter
    _load(service, container)
    _generate(service, messages=MESSAGES, max_tokens=5)
    assert snaps[-1].tokens == 4 and snaps[-1].gauges["budget"] > 0
    assert set(np.unique(grids[-1])) <= {TIER_DISK, TIER_CACHED, TIER_PINNED} and (grids[-1] != TIER_DISK).any()
    trace = traces[-1]
    assert isinstance(trace, CacheTrace) and trace.accesses > 0 and trace.capacity >= 1
    assert {layer for layer, _ in trace.steps} == set(range(LAYERS))
    assert isinstance(counts[-1], ExpertCounts) and counts[-1].hits.shape == (LAYERS, N_EXPERTS)
    assert counts[-1].hits.sum() + counts[-1].misses.sum() == trace.accesses   # (the trace covers the whole chat)
    sub.close()
    tiers.close()
    cache.close()
    stories.close()
    n = len(snaps)
    _generate(service, messages=MESSAGES, max_tokens=3)
    assert len(snaps) == n and sub.closed


def test_the_atlas_is_computed_on_the_loaded_model_and_found_next_time(service, hf, tmp_path):
    model = tmp_path / "moe"
    shutil.copytree(hf, model)
    assert _load(service, model).atlas is None
    i = service.compute_atlas()
    ready = service.events.wait(lambda e: getattr(e, "request", None) == i and type(e).__name__ in
                                ("AtlasReady", "AtlasFailed"))
    assert isinstance(ready, AtlasReady), ready
    assert ready.path == model / "atlas.json" and ready.path.is_file()
    assert len(ready.atlas["layers"]) == LAYERS
    assert _load(service, model).atlas["model_hash"] == ready.atlas["model_hash"]


def test_close_ends_the_thread_and_refuses_more_requests(hf):
    before = set(threading.enumerate())
    svc = EngineService(Events())
    svc.events = svc._on_event
    _load(svc, hf)
    svc.generate(messages=MESSAGES, max_tokens=2000)   # still running when close() comes
    svc.close()
    assert not svc.running
    with pytest.raises(RuntimeError):
        svc.load(hf)
    deadline = time.monotonic() + 10      # threads a closed service started end on their own: wait for it
    while [t for t in threading.enumerate() if t not in before and t.is_alive()] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []


@pytest.mark.parametrize("command", ["gui", "serve"])
def test_the_memory_and_kv_flags_reach_the_service(command):
    from app.cli import build_parser
    from app.commands._memory import load_options

    args = build_parser().parse_args([command, "m", "--max-memory", "512MB", "--kv-bits", "8", "--overflow",
                                      "retain", "--kv-block-size", "16", "--prefetch-depth", "2", "--ctx", "300"])
    options = load_options(args, max_batch=3)
    assert (options.max_memory, options.kv_bits, options.overflow, options.kv_block_size) == (512 * 10**6, 8, "retain", 16)
    assert (options.prefetch_depth, options.context_length, options.max_batch) == (2, 300, 3)
    bad = build_parser().parse_args([command, "m", "--kv-block-size", "12"])
    with pytest.raises(ColibriError, match="block"):
        load_options(bad)


def test_a_kv_setting_of_the_load_shapes_the_pool_and_keeps_the_answer(service, container):
    info = _load(service, container, LoadOptions(kv_bits=32, kv_block_size=8, max_batch=2)).info
    tokens, done = _generate(service, prompt=[5, 6, 7, 8, 9], max_tokens=6)
    pool = service._model.pool
    assert (pool.block_size, pool.bits) == (8, 32) and done.tokens == _direct(info.path, [5, 6, 7, 8, 9], 6)


def test_load_planning_prints_nothing_and_changes_no_option(container, capsys):
    from app.service.loading import LoadPlan, plan_load
    from engine.loader import open_checkpoint

    ckpt = open_checkpoint(container, verify=False)
    options = LoadOptions(max_memory=1 << 40, context_length=64, prefetch_depth=2, history=False)
    plan = plan_load(options, container, ckpt.spec, ckpt.source)
    assert isinstance(plan, LoadPlan) and plan.context_length == 64 and plan.budget == 1 << 40
    assert plan.offload is not None and plan.offload.prefetch_depth == 2 and plan.offload.history_path is None
    assert plan.description.startswith("memory budget ") and "KV cache for 64 tokens" in plan.description
    assert capsys.readouterr() == ("", "") and options == LoadOptions(max_memory=1 << 40, context_length=64,
                                                                      prefetch_depth=2, history=False)
    whole = plan_load(LoadOptions(offload=False), container, ckpt.spec, ckpt.source)
    assert whole.offload is None and whole.budget is None and whole.description == ""


def test_the_local_and_the_remote_service_are_both_a_service():
    from app.service.protocol import Service
    from app.service.remote import RemoteService

    with EngineService() as local, RemoteService("http://127.0.0.1:9") as remote:
        assert isinstance(local, Service) and isinstance(remote, Service)


def test_earlier_chats_kv_stays_within_its_share_of_the_budget_over_ten_chats(service, container):
    _load(service, container, LoadOptions(context_length=256, offload=True))
    model = service._model
    kv, held = [], []
    for i in range(10):                       # different chats: nothing is shared, every full block stays cached
        r = service.generate(messages=[ChatMessage("user", f"chat {i}: " + "xyz"[i % 3] * (20 + i))],
                             max_tokens=150)
        assert isinstance(service.events.done(r), DoneEvent)
        snap = service.snapshot()
        kv.append(snap.gauges["kv_bytes"])
        held.append(model.pool.nbytes)
    limit = model.kv_limit()
    assert limit is not None and max(kv) <= limit and max(held) <= limit
    assert model.pool.capacity_bytes > 2 * limit   # the pool could have grown past it: the trim held it
    assert len(model.pool.cached) > 0               # and the latest chats' prefixes still wait for reuse
