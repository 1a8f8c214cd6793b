"""Saved sessions: a conversation saved, killed and restored continues byte for byte as if never stopped.

The model is a 4-bit container of a tiny MoE (its logits are bitwise reproducible). Resuming in a
separate process proves nothing survives in memory; the other restores load into a fresh pool in
this process. Run as a script, this file is that separate process (see `main`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from engine.generation.sampling import History, SamplingParams, apply_processors, make_logits_processors, make_sampler
from engine.generation.session import KVSettings, SessionError, SessionFile, SessionState
from engine.kv import KVCache, KVPool
from engine.loader import load_model

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, 17, 5, 99, 42, 8, 23, 61, 7]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.3)   # the penalty reads the history
GREEDY = SamplingParams()


# --- the decode loop, resumable: what generate_step does, from a SessionState ---

def start(prompt: list[int], sampling: SamplingParams, extra: dict | None = None) -> SessionState:
    """The state before the prompt runs: the prompt is the history and nothing is sampled yet."""
    return SessionState(tuple(prompt), len(prompt), None, sampling, None, extra or {})


def decode(model, cache: KVCache, state: SessionState, n: int) -> tuple[list[int], SessionState, bytes]:
    """n more tokens: feed the pending token (or the prompt), process, sample; the new state and the
    last logits' hash."""
    sampler = make_sampler(state.sampling)
    if state.sampler is not None:
        sampler.set_state(state.sampler)
    processors = make_logits_processors(state.sampling)
    seen, pending, out, digest = list(state.seen), state.pending, [], b""
    for _ in range(n):
        logits = model.forward(list(seen) if pending is None else [pending], cache)[-1]   # [V]
        digest = hashlib.blake2b(logits.tobytes(), digest_size=16).digest()
        if processors:
            logits = apply_processors(logits, History(np.asarray(seen, np.int64), state.prompt_len), processors)
        pending = sampler(logits)
        seen.append(pending)
        out.append(pending)
    return out, SessionState(tuple(seen), state.prompt_len, pending, state.sampling, sampler.get_state(),
                             state.extra), digest


def _pool(spec, block_size: int, bits: int = 32, n_blocks: int = 64) -> KVPool:
    return KVPool(spec, n_blocks, block_size=block_size, bits=bits)


def _same_rows(live: KVCache, restored: KVCache) -> bool:
    """Every layer's stored rows of every block the sequences hold are equal, bit for bit."""
    n = -(-live.length // live.pool.block_size)
    return all(np.array_equal(mine[name][restored.table[:n]], theirs[name][live.table[:n]])
               for mine, theirs in zip(restored.pool.layers, live.pool.layers) for name in mine)


def main(job: dict) -> dict:
    """The restarted process: load the model and the session, continue decoding, report the tokens."""
    loaded = load_model(job["container"])
    settings = KVSettings(**job["settings"])
    pool = _pool(loaded.spec, settings.block_size, settings.bits)
    cache, state = SessionFile(job["session"], job["model_hash"], settings).load(pool)
    tokens, _, digest = decode(loaded.model, cache, state, job["n"])
    return {"tokens": tokens, "logits": digest.hex(), "extra": state.extra}


def resume_elsewhere(job: dict) -> dict:
    """Run `main` in a new Python process (nothing shared but the files)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, __file__, json.dumps(job)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- fixtures ---

@pytest.fixture(scope="module")
def container(tmp_path_factory) -> tuple[Path, str]:
    """A 4-bit container of a tiny Mixtral and its model hash."""
    from app.hub.convert import ConvertSettings, convert
    from engine.formats.container import MANIFEST
    from support.reference import build_checkpoint

    src = build_checkpoint(tmp_path_factory.mktemp("src"), "mixtral", num_local_experts=8, num_experts_per_tok=2)
    out = convert(src, tmp_path_factory.mktemp("c") / "moe", ConvertSettings(bits=4), log=lambda m: None)
    return out, json.loads((out / MANIFEST).read_text())["model_hash"]


@pytest.fixture(scope="module")
def loaded(container):
    model = load_model(container[0])
    yield model
    model.close()


@pytest.fixture(scope="module")
def greedy30(loaded) -> tuple[list[int], bytes]:
    """30 greedy tokens never interrupted (block size 4) and the last logits' hash."""
    tokens, _, logits = _uninterrupted(loaded, 4, GREEDY, 30)
    return tokens, logits


def _job(container, path: Path, settings: KVSettings, n: int) -> dict:
    return {"container": str(container[0]), "model_hash": container[1], "session": str(path),
            "settings": asdict(settings), "n": n}


def _uninterrupted(loaded, block_size: int, sampling: SamplingParams, n: int, bits: int = 32, **kw):
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, block_size, bits), **kw)
    return decode(loaded.model, cache, start(PROMPT, sampling), n)


# --- 1. save, kill, restore = uninterrupted ---

def test_a_sampled_session_resumed_in_another_process_gives_the_same_tokens(loaded, container, tmp_path):
    want, _, want_logits = _uninterrupted(loaded, 16, SAMPLED, 24)
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 16))
    first, state, _ = decode(loaded.model, cache, start(PROMPT, SAMPLED, {"messages": ["hi"]}), 10)
    path = tmp_path / "chat.session"
    settings = KVSettings.of(cache)
    SessionFile(path, container[1], settings).save(cache, state)
    got = resume_elsewhere(_job(container, path, settings, 14))
    assert first + got["tokens"] == want
    assert got["logits"] == want_logits.hex()
    assert got["extra"] == {"messages": ["hi"]}


def test_a_greedy_session_saved_many_times_resumes_in_another_process(loaded, container, greedy30, tmp_path):
    want, want_logits = greedy30
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4))
    path = tmp_path / "greedy.session"
    session = SessionFile(path, container[1], KVSettings.of(cache))
    state, done, sizes = start(PROMPT, GREEDY), [], []
    for n in (5, 6, 7):
        tokens, state, _ = decode(loaded.model, cache, state, n)
        done += tokens
        before = path.read_bytes() if path.exists() else b""
        session.save(cache, state)
        assert path.read_bytes()[: len(before)] == before      # appended: earlier bytes untouched
        sizes.append(path.stat().st_size)
    assert sizes[0] < sizes[1] < sizes[2]
    got = resume_elsewhere(_job(container, path, KVSettings.of(cache), 30 - len(done)))
    assert done + got["tokens"] == want
    assert got["logits"] == want_logits.hex()


# --- 2. incremental appends ---

def test_a_longer_session_appends_only_its_new_blocks(loaded, container, tmp_path):
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4))
    path = tmp_path / "grow.session"
    session = SessionFile(path, container[1], KVSettings.of(cache))
    _, state, _ = decode(loaded.model, cache, start(PROMPT, GREEDY), 2)     # 10 positions: 2 full blocks
    session.save(cache, state)
    old = path.read_bytes()
    _, state, _ = decode(loaded.model, cache, state, 16)                    # 26 positions: 6 full blocks
    session.save(cache, state)
    new = path.read_bytes()
    assert new[: len(old)] == old
    data = sum(a[0].nbytes for arrays in cache.pool.layers for a in arrays.values())   # one block, every layer
    grown = len(new) - len(old)
    assert 4 * data < grown < 4 * (data + 1024) + data + 4096               # 4 blocks and a tail


def test_dead_tails_never_outweigh_the_session(loaded, container, tmp_path):
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 16))
    path = tmp_path / "often.session"
    session = SessionFile(path, container[1], KVSettings.of(cache))
    state = start(PROMPT, GREEDY)
    for step in range(12):                                      # a save per token: a tail each, few blocks
        _, state, _ = decode(loaded.model, cache, replace(state, extra={"step": step}), 1)
        session.save(cache, state)
        fresh = tmp_path / "fresh.session"
        SessionFile(fresh, container[1], KVSettings.of(cache)).save(cache, state)
        assert path.stat().st_size <= 2 * fresh.stat().st_size
    restored, got = SessionFile(path, container[1], KVSettings.of(cache)).load(_pool(loaded.spec, 16))
    assert got == state and restored.tokens == cache.tokens and _same_rows(cache, restored)


# --- 3. torn appends and damage ---

def _two_saves(loaded, container, tmp_path):
    """A session saved at 12 positions, then appended to at 25: (path, size after the first save, tokens
    sampled before it, settings)."""
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4))
    path = tmp_path / "torn.session"
    session = SessionFile(path, container[1], KVSettings.of(cache))
    first, state1, _ = decode(loaded.model, cache, start(PROMPT, GREEDY, {"save": 1}), 4)
    session.save(cache, state1)
    size1 = path.stat().st_size
    _, state2, _ = decode(loaded.model, cache, replace(state1, extra={"save": 2}), 13)
    session.save(cache, state2)
    return path, size1, first, KVSettings.of(cache)


@pytest.mark.parametrize("cut", ["tail", "middle", "last byte flipped"])
def test_a_torn_append_falls_back_to_the_previous_save(loaded, container, greedy30, tmp_path, cut):
    path, size1, first, settings = _two_saves(loaded, container, tmp_path)
    data = bytearray(path.read_bytes())
    if cut == "tail":
        del data[-10:]
    elif cut == "middle":
        del data[(size1 + len(data)) // 2 :]
    else:
        data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    session = SessionFile(path, container[1], settings)
    cache, state = session.load(_pool(loaded.spec, 4))
    assert state.extra == {"save": 1} and cache.length == len(PROMPT) + 3
    assert list(state.seen) == PROMPT + first
    rest, state, _ = decode(loaded.model, cache, state, 26)
    assert first + rest == greedy30[0]
    session.save(cache, state)                                              # the torn end is cleared
    cache2, state2 = SessionFile(path, container[1], settings).load(_pool(loaded.spec, 4))
    assert cache2.tokens == cache.tokens and state2.seen == state.seen


@pytest.mark.parametrize("where", ["payload", "head"])
def test_a_damaged_block_is_an_error_naming_the_file(loaded, container, tmp_path, where):
    path, size1, _, settings = _two_saves(loaded, container, tmp_path)
    data = bytearray(path.read_bytes())
    if where == "payload":
        data[size1 // 2] ^= 0x01                                            # inside the first save's blocks
    else:                                                                   # the first block's length field
        (header_len,) = struct.unpack_from("<Q", data, 12 + 4)              # after magic + version, kind + pad
        data[12 + 16 + header_len + 16 + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SessionError, match="is damaged at byte") as err:
        SessionFile(path, container[1], settings).load(_pool(loaded.spec, 4))
    assert str(path) in str(err.value)


# --- 4. bound to the model and the settings ---

def test_another_model_or_other_settings_are_refused_naming_both(loaded, container, tmp_path):
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4))
    _, state, _ = decode(loaded.model, cache, start(PROMPT, GREEDY), 3)
    path = tmp_path / "bound.session"
    settings = KVSettings.of(cache)
    SessionFile(path, container[1], settings).save(cache, state)
    with pytest.raises(SessionError) as err:
        SessionFile(path, "0123abcd", settings).load(_pool(loaded.spec, 4))
    assert str(path) in str(err.value) and container[1] in str(err.value) and "0123abcd" in str(err.value)
    others = [(KVSettings(4, 8, 64), 4, 8), (KVSettings(8, 32, 64), 8, 32), (KVSettings(4, 32, 128, "slide"), 4, 32)]
    for other, block, bits in others:
        with pytest.raises(SessionError) as err:
            SessionFile(path, container[1], other).load(_pool(loaded.spec, block, bits))
        text = str(err.value)
        assert str(path) in text and "in the file" in text and "here" in text, text
    with pytest.raises(SessionError, match="128"):
        SessionFile(path, container[1], KVSettings(4, 32, 128)).load(_pool(loaded.spec, 4))


# --- 5. int8 KV, and the cache's own state restored ---

def test_int8_kv_round_trips(loaded, container, tmp_path):
    want, _, want_logits = _uninterrupted(loaded, 4, GREEDY, 20, bits=8)
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4, bits=8))
    first, state, _ = decode(loaded.model, cache, start(PROMPT, GREEDY), 8)
    path = tmp_path / "int8.session"
    SessionFile(path, container[1], KVSettings.of(cache)).save(cache, state)
    pool = _pool(loaded.spec, 4, bits=8)
    restored, state = SessionFile(path, container[1], KVSettings.of(cache)).load(pool)
    assert restored.tokens == cache.tokens and restored.length == cache.length
    for mine, theirs in zip(pool.layers, cache.pool.layers):
        for name in ("k", "ks", "v", "vs"):
            assert mine[name].dtype == theirs[name].dtype
            assert np.array_equal(mine[name][restored.table], theirs[name][cache.table])
    rest, _, logits = decode(loaded.model, restored, state, 12)
    assert first + rest == want and logits == want_logits


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """A tiny DeepSeek-V3 (multi-head latent attention), float32: the same process gives the same bytes."""
    from support.families import FAMILIES
    from support.reference import build_checkpoint

    model_type, overrides = FAMILIES["deepseek_v3"]
    return load_model(build_checkpoint(tmp_path_factory.mktemp("mla"), model_type, **overrides))


@pytest.mark.parametrize("bits", [32, 8])
def test_latent_attention_round_trips(mla, tmp_path_factory, bits):
    loaded = mla
    want, _, want_logits = _uninterrupted(loaded, 4, SAMPLED, 16, bits=bits)
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4, bits))
    first, state, _ = decode(loaded.model, cache, start(PROMPT, SAMPLED), 6)
    path = tmp_path_factory.mktemp("s") / "mla.session"
    SessionFile(path, "mla", KVSettings.of(cache)).save(cache, state)
    restored, state = SessionFile(path, "mla", KVSettings.of(cache)).load(_pool(loaded.spec, 4, bits))
    assert restored.pool.latent[0] and _same_rows(cache, restored)
    rest, _, logits = decode(loaded.model, restored, state, 10)
    assert first + rest == want and logits == want_logits


def test_restored_blocks_serve_prefix_reuse(loaded, container, tmp_path):
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4))
    _, state, _ = decode(loaded.model, cache, start(PROMPT, GREEDY), 6)
    path = tmp_path / "prefix.session"
    SessionFile(path, container[1], KVSettings.of(cache)).save(cache, state)
    pool = _pool(loaded.spec, 4)
    restored, _ = SessionFile(path, container[1], KVSettings.of(cache)).load(pool)
    assert restored._digests == cache._digests
    other = KVCache(loaded.spec, 64, pool=pool)
    assert other.adopt(cache.tokens[:13]) == 12                             # three full blocks found
    assert other.table == restored.table[:3]


def test_a_truncated_session_saves_what_it_holds_now(loaded, container, tmp_path):
    cache = KVCache(loaded.spec, 64, pool=_pool(loaded.spec, 4))
    path = tmp_path / "cut.session"
    session = SessionFile(path, container[1], KVSettings.of(cache))
    _, state, _ = decode(loaded.model, cache, start(PROMPT, GREEDY), 8)
    session.save(cache, state)
    cache.truncate(10)                                          # a regenerated answer: block 2 rewritten
    _, state, _ = decode(loaded.model, cache, SessionState((*PROMPT, cache.tokens[9], 50), 9, 50, GREEDY), 5)
    session.save(cache, state)
    cache.truncate(5)                                           # the same prompt tokens, now one at a time
    for t in PROMPT[5:-1]:
        loaded.model.forward([t], cache)
    _, state, _ = decode(loaded.model, cache, SessionState(tuple(PROMPT), 9, PROMPT[-1], GREEDY), 7)
    session.save(cache, state)
    cache.pool.layers[1]["v"][cache.table[1]] *= 2              # rewritten in place: same block, same tokens
    session.save(cache, state)
    restored, got = SessionFile(path, container[1], KVSettings.of(cache)).load(_pool(loaded.spec, 4))
    assert restored.tokens == cache.tokens and restored.length == cache.length and got == state
    assert _same_rows(cache, restored)


@pytest.mark.parametrize("overflow", ["retain", "slide"])
def test_retention_state_survives_a_restart(loaded, container, tmp_path, overflow):
    def fresh():
        return KVCache(loaded.spec, 16, pool=_pool(loaded.spec, 4), overflow=overflow)

    want, _, want_logits = decode(loaded.model, fresh(), start(PROMPT, SAMPLED), 30)   # evicts past 16 positions
    cache = fresh()
    path = tmp_path / f"{overflow}.session"
    session = SessionFile(path, container[1], KVSettings.of(cache))
    state, done = start(PROMPT, SAMPLED), []
    for n in (6, 5, 4):
        tokens, state, _ = decode(loaded.model, cache, state, n)
        done += tokens
        session.save(cache, state)
    assert cache.evicted > 0
    restored, state = SessionFile(path, container[1], KVSettings.of(cache)).load(_pool(loaded.spec, 4))
    assert restored.evicted == cache.evicted and restored.steps == cache.steps
    assert np.array_equal(restored.heat, cache.heat) and np.array_equal(restored.born, cache.born)
    rest, _, logits = decode(loaded.model, restored, state, 30 - len(done))
    assert done + rest == want and logits == want_logits


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
