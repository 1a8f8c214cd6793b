"""A hybrid model (Qwen3-Next: gated DeltaNet layers beside full attention) in saved sessions and batches.

Saved sessions hold the recurrent layers' states: restored into a fresh pool, a conversation continues
with the tokens and logits of one never interrupted. The scheduler keeps one state per sequence and
shares prefixes through state checkpoints: its tokens are each request's solo tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.events import DoneEvent
from engine.formats.container import MANIFEST
from engine.generation.generate import GenerationRequest, generate_step
from engine.generation.sampling import SamplingParams, make_sampler
from engine.generation.scheduler import Scheduler
from engine.generation.session import KVSettings, SessionError, SessionFile, SessionState
from engine.kv import KVCache, KVPool
from engine.loader import load_model
from support.recurrent import PROMPT, qwen3_next_container

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    out = qwen3_next_container(tmp_path_factory.mktemp("q3n"))
    return out, json.loads((out / MANIFEST).read_text())["model_hash"]


@pytest.fixture(scope="module")
def model(container):
    loaded = load_model(container[0])
    yield loaded.model
    loaded.close()


def _pool(model) -> KVPool:
    return KVPool(model.spec, 200, block_size=4)


def _decode(model, cache: KVCache, state: SessionState, n: int) -> tuple[list[int], SessionState, bytes]:
    """n more sampled tokens from `state` (the prompt first, else its pending token); the last logits' hash."""
    sampler = make_sampler(state.sampling)
    if state.sampler is not None:
        sampler.set_state(state.sampler)
    seen, pending, out, digest = list(state.seen), state.pending, [], b""
    for _ in range(n):
        logits = model.forward(seen if pending is None else [pending], cache)[-1]      # [V]
        digest = hashlib.blake2b(logits.tobytes(), digest_size=16).digest()
        pending = sampler(logits)
        seen.append(pending)
        out.append(pending)
    return out, SessionState(tuple(seen), state.prompt_len, pending, state.sampling, sampler.get_state()), digest


def test_a_hybrid_session_saved_and_restored_continues_unchanged(model, container, tmp_path):
    start = SessionState(tuple(PROMPT), len(PROMPT), None, SAMPLED)
    want, _, want_logits = _decode(model, KVCache(model.spec, 64, pool=_pool(model)), start, 24)
    cache = KVCache(model.spec, 64, pool=_pool(model))
    path = tmp_path / "hybrid.session"
    session = SessionFile(path, container[1], KVSettings.of(cache))
    state, done = start, []
    for n in (3, 5, 2):                                   # saved three times: appended, the states in each tail
        tokens, state, _ = _decode(model, cache, state, n)
        done += tokens
        session.save(cache, state)
    pool = _pool(model)                                   # restored into another pool of this process
    restored, got = SessionFile(path, container[1], KVSettings.of(cache)).load(pool)
    assert restored.length == cache.length and got == state
    for mine, theirs in zip(restored.states, cache.states):
        assert all(np.array_equal(a, b) for a, b in zip(mine.state(), theirs.state()))
    more, _, logits = _decode(model, restored, got, 24 - len(done))
    assert done + more == want and logits == want_logits
    # and in a new process, where nothing but the file survives
    job = {"container": str(container[0]), "model_hash": container[1], "session": str(path), "n": 24 - len(done)}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    res = subprocess.run([sys.executable, __file__, json.dumps(job)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    elsewhere = json.loads(res.stdout.strip().splitlines()[-1])
    assert done + elsewhere["tokens"] == want and elsewhere["logits"] == want_logits.hex()


def test_a_session_of_other_state_shapes_is_refused(model, container, tmp_path):
    cache = KVCache(model.spec, 64, pool=_pool(model))
    path = tmp_path / "s.session"
    _, state, _ = _decode(model, cache, SessionState(tuple(PROMPT), len(PROMPT), None, SAMPLED), 2)
    SessionFile(path, container[1], KVSettings.of(cache)).save(cache, state)
    session = SessionFile(path, container[1], KVSettings.of(cache))
    header = session._header(_pool(model))
    header["states"][0][1][1][0] += 1                    # another layer width in the file's header
    with pytest.raises(SessionError, match="recurrent states of shapes"):
        session._check(header, _pool(model))


def test_the_scheduler_shares_checkpointed_prefixes_and_keeps_a_state_per_sequence(model):
    """Requests sharing a prefix with one that ran before adopt its blocks and states; batched, chunked and
    reusing, each gets its solo greedy tokens."""
    greedy = SamplingParams()
    first = PROMPT + [6, 18]
    prompts = [PROMPT + [44, 2, 90], PROMPT[:13] + [9, 31], PROMPT[3:] + [6, 18], [7, 7, 7]]
    want = [list(itertools.islice(generate_step(model, p, KVCache(model.spec, 64), greedy), 8))
            for p in [first] + prompts]
    sched = Scheduler(model, KVPool(model.spec, 200, block_size=4), max_len=64, prefill_chunk=8)
    seqs = [sched.submit(GenerationRequest(prompt=tuple(first), max_tokens=8, sampling=greedy))]
    sched.run()                                           # leaves its blocks and checkpoints cached
    seqs += [sched.submit(GenerationRequest(prompt=tuple(p), max_tokens=8, sampling=greedy)) for p in prompts]
    sched.run()
    got = [list([e for e in s.drain() if isinstance(e, DoneEvent)][0].tokens) for s in seqs]
    assert got == want
    assert [s.reused for s in seqs] == [0, 20, 12, 0, 0]  # short steps (chunks of 8) checkpoint every boundary
    assert sched.pool.checkpoints.used == 2 and sched.pool.used_blocks == 0


def test_a_long_answer_keeps_one_checkpoint_past_its_prompt(model):
    """Decoding crosses a block boundary every few tokens: past the prompt only the latest checkpoint stays, and
    the next turn (the conversation so far and a new message) resumes from it with its solo tokens."""
    greedy = SamplingParams()
    sched = Scheduler(model, KVPool(model.spec, 200, block_size=4), max_len=64, prefill_chunk=32)
    seq = sched.submit(GenerationRequest(prompt=tuple(PROMPT), max_tokens=21, sampling=greedy))
    sched.run()
    answer = list([e for e in seq.drain() if isinstance(e, DoneEvent)][0].tokens)
    cps = sched.pool.checkpoints
    assert len(cps.entries) == 2                          # the prompt's (20) and the answer's latest (40)
    turn = PROMPT + answer + [3, 17]
    want = list(itertools.islice(generate_step(model, turn, KVCache(model.spec, 64), greedy), 4))
    nxt = sched.submit(GenerationRequest(prompt=tuple(turn), max_tokens=4, sampling=greedy))
    sched.run()
    assert nxt.reused == 40
    assert list([e for e in nxt.drain() if isinstance(e, DoneEvent)][0].tokens) == want


def main(job: dict) -> dict:
    """The restarted process: load the model and the session, continue decoding, report the tokens."""
    loaded = load_model(job["container"])
    cache, state = SessionFile(job["session"], job["model_hash"], KVSettings(4, 32, 64)).load(_pool(loaded.model))
    tokens, _, digest = _decode(loaded.model, cache, state, job["n"])
    return {"tokens": tokens, "logits": digest.hex()}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
