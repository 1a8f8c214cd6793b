"""Saved sessions: one sequence's KV blocks, tokens and decode state in a file that survives a restart.

A resumed conversation continues byte for byte as if it had never stopped: the file holds the KV rows
exactly as stored (float32 or int8 with their scales), the recurrent layers' states (a hybrid model's
gated DeltaNet layers), the retention state, the sampler's RNG state and the decode history, so nothing
is recomputed.

    sessions = SessionFile(path, model_hash, KVSettings.of(cache))
    sessions.save(cache, SessionState(seen, prompt_len, pending, params, sampler.get_state(), extra))
    ...                                                   # after a restart:
    cache, state = SessionFile(path, model_hash, settings).load(pool)

`SessionState.pending` is the id sampled last and not yet run through the model: a resumed loop runs
it first, so a save needs no logits. `save` refuses a cache whose settings are not the file's; `load`
refuses a file saved for another model hash, KV settings or layer shapes (`SessionError`).

File layout: `MAGIC`, a format version (u32), then records. A record is a 16-byte head (kind u8,
3 pad bytes, payload length u64, crc32 of the 12 bytes before it), the payload, and a 16-byte
blake2b of head + payload. A payload is a JSON meta (u32 length first) describing its arrays,
then their raw bytes. Kinds:

- `H` header, first: format, model hash, KV settings, every layer's array shapes (and, for a model with
  recurrent layers, their state shapes). A file saved for another model or other settings is refused,
  naming both.
- `B` one full block: its index, prefix digest, tokens and every layer's rows. Written once.
- `T` tail: what changes between saves: the partial last block, length, the recurrent layers' states
  after the held tokens, retention state (heat, born, steps, evicted), the decode history and sampler
  state, the caller's `extra`. It
  names the block records it builds on by a hash of their checksums.

`save` appends the blocks not yet in the file and a new tail (the newest complete tail wins; the old
ones are dead). A first save, a cache whose saved blocks changed (truncated, evicted, rewritten; seen
by their ids, tokens, digests and the last row of each block, which any rewrite of it recomputes),
a file changed behind our back, or dead tails outweighing the live bytes rewrite the whole file
atomically instead. A crash while appending leaves a torn end (short, or failing its checksum as the
last record): `load` restores the last complete tail and says what it dropped (`SessionFile.dropped`).
A damaged record anywhere else is an error naming the file: restoring half a state would silently
change the continuation.

A save that fails (a full disk, a read-only folder) raises `SessionSaveError` with the bytes written
of the bytes needed, and leaves the file at its previous save: a failed append is cut off again, a
failed rewrite never replaces the file. `SessionFile` itself takes no lock: a process that may meet
another writer of the same path holds `session_lock(path)` while it uses it, which also removes the
temporaries a writer killed mid-rewrite left behind.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import struct
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np

from engine.atomic import FileLock, atomic_file, remove_temps
from engine.errors import ColibriError
from engine.generation.sampling import SamplingParams
from engine.kv import OVERFLOW, SINK_TOKENS, KVCache, KVPool

MAGIC = b"COLSESS\x00"
FORMAT = 1
_VERSION = struct.Struct("<I")
_HEAD = struct.Struct("<B3xQ")       # kind, payload length
_CRC = struct.Struct("<I")           # crc32 of the head: a damaged length is told apart from a torn end
_HEAD_BYTES = _HEAD.size + _CRC.size
_SUM = 16                            # blake2b digest of head + payload, after the payload
_META = struct.Struct("<I")
HEADER, BLOCK, TAIL = b"H"[0], b"B"[0], b"T"[0]
_PARTS = ("k", "ks", "v", "vs")    # every layer's arrays; latent layers with a sparse-attention indexer add "ik", "iks"


class SessionError(ColibriError):
    """A session file cannot be restored (damaged, empty, or saved for another model or settings)."""


class SessionSaveError(SessionError):
    """A save failed part way (disk full, read-only ...); the file still holds its previous save, if any."""

    def __init__(self, path: Path, reason: str, written: int, total: int, kept: bool):
        self.path, self.reason, self.written, self.total = path, reason, written, total
        fix = "free space and save again" if reason == "disk full" else "fix that and save again"
        super().__init__(f"could not save the session to {path}: {reason} ({written} of {total} bytes written); "
                         f"{'the file keeps its previous save' if kept else 'nothing was saved'}: {fix}")


def session_lock(path: str | os.PathLike) -> FileLock:
    """Hold `path` for this process until the lock's `release` (or exit), and remove stale temporaries.

    Raises `FileInUseError` naming the process that holds it, `SessionError` for a folder or a place
    where the lock cannot be made. Holding it, no live writer of this session exists, so any
    `.NAME.*.tmp` beside it is what a killed rewrite left behind.
    """
    path = Path(path)
    _refuse_folder(path)
    lock = FileLock(path, "session file", "close that chat first, or use another session file")
    try:
        lock.acquire()
    except OSError as exc:
        raise SessionError(f"session file {path}: cannot make its lock {lock.lock_path} ({exc.strerror}); "
                           "use a session file in a folder you can write to") from exc
    remove_temps(path)
    return lock


@dataclass(frozen=True)
class DroppedSave:
    """The end of a file `load` did not restore: the last save, torn by a crash or damaged."""

    offset: int             # where the dropped bytes start (after the last complete tail)
    size: int               # how many bytes were dropped
    reason: str             # what was wrong with them

    def __str__(self) -> str:
        return f"{self.size} bytes from byte {self.offset}: {self.reason}"


@dataclass(frozen=True)
class KVSettings:
    """The KV settings a session is bound to: restoring under others would compute something else."""

    block_size: int
    bits: int
    max_len: int
    overflow: str = "error"
    sink_tokens: int = SINK_TOKENS
    recent_tokens: int | None = None   # None: max_len // 4, as KVCache chooses

    def __post_init__(self) -> None:
        if self.overflow not in OVERFLOW:
            raise SessionError(f"overflow {self.overflow!r}: use one of {', '.join(OVERFLOW)}")
        if self.recent_tokens is None:
            object.__setattr__(self, "recent_tokens", self.max_len // 4)

    @classmethod
    def of(cls, cache: KVCache) -> KVSettings:
        """The settings a cache runs with."""
        return cls(cache.pool.block_size, cache.pool.bits, cache.max_len, cache.overflow,
                   cache.sink_tokens, cache.recent_tokens)


@dataclass(frozen=True)
class SessionState:
    """What a decode loop needs besides the KV cache to continue where it stopped."""

    seen: tuple[int, ...] = ()              # prompt + generated ids: the history logits processors read
    prompt_len: int = 0                     # seen[:prompt_len] is the prompt
    pending: int | None = None              # a sampled id not yet run through the model
    sampling: SamplingParams | None = None  # the request's sampling settings
    sampler: dict | None = None             # Sampler.get_state()
    extra: dict = field(default_factory=dict)   # the caller's own JSON values (chat messages ...)


@dataclass(frozen=True)
class _Saved:
    """A block record in the file, and what identifies the cache block it was taken from."""

    block: int              # pool block id
    tokens: tuple[int, ...]
    digest: bytes           # the cache's prefix digest (b"" if none)
    rows: bytes             # fingerprint of the block's last row in every layer
    record: bytes           # the record's checksum (tails name their blocks by these)


@dataclass(frozen=True)
class _Record:
    kind: int
    offset: int             # of the payload
    length: int
    checksum: bytes
    end: int                # offset after the record

    @property
    def size(self) -> int:
        """Bytes of the whole record: head, payload, checksum."""
        return self.end - self.offset + _HEAD_BYTES


class SessionFile:
    """One saved session: `save` writes (appending when it can), `load` restores into a pool."""

    def __init__(self, path: str | os.PathLike, model_hash: str, settings: KVSettings):
        self.path, self.model_hash, self.settings = Path(path), str(model_hash), settings
        self._saved: list[_Saved] = []      # the block records the file holds, in order
        self._cache: weakref.ref | None = None
        self._evicted = 0
        self._end = 0                       # bytes of the file up to its newest tail
        self._live = 0                      # bytes still needed: magic, header, blocks, newest tail
        self._tail = 0                      # bytes of the newest tail
        self.dropped: DroppedSave | None = None  # what the last `load` left out: a torn or damaged last save

    # --- saving ---

    def save(self, cache: KVCache, state: SessionState) -> None:
        """Write the cache and state: new blocks and a tail appended, or the whole file rewritten."""
        mine = KVSettings.of(cache)
        _refuse_folder(self.path)
        if mine != self.settings:
            raise SessionError(f"session file {self.path}: the cache runs with {_describe(mine)} but the session "
                               f"was opened for {_describe(self.settings)}; open it with KVSettings.of(cache)")
        full = cache.length // cache.pool.block_size
        keep = self._kept(cache, full)
        if keep is None:
            self._rewrite(cache, state)
            return
        new = [self._block_record(cache, i) for i in range(keep, full)]
        blocks = self._saved + [s for s, _ in new]
        tail = _record(TAIL, self._tail_payload(cache, state, blocks))
        live = self._live - self._tail + sum(len(r) for _, r in new) + len(tail)
        dead = self._end - self._live + self._tail
        if dead > live:                     # old tails outweigh the session: start the file afresh
            self._rewrite(cache, state)
            return
        self._append([r for _, r in new] + [tail])
        self._saved, self._tail, self._live = blocks, len(tail), live
        self._end += sum(len(r) for _, r in new) + len(tail)

    def _kept(self, cache: KVCache, full: int) -> int | None:
        """How many blocks the file holds that still match the cache's first ones; None: rewrite the file."""
        known = self._cache() if self._cache is not None else None
        if known is not cache or cache.evicted != self._evicted or len(self._saved) > full:
            return None
        try:
            if self.path.stat().st_size != self._end:
                return None                 # changed behind our back, or a torn append to clear
        except FileNotFoundError:
            return None
        bs = cache.pool.block_size
        for i, s in enumerate(self._saved):
            b = cache.table[i]
            if (s.block != b or s.tokens != tuple(cache.tokens[i * bs : (i + 1) * bs])
                    or s.digest != _digest_of(cache, i) or s.rows != _last_rows(cache.pool, b)):
                return None
        return len(self._saved)

    def _block_record(self, cache: KVCache, i: int) -> tuple[_Saved, bytes]:
        bs, pool, b = cache.pool.block_size, cache.pool, cache.table[i]
        tokens = tuple(int(t) for t in cache.tokens[i * bs : (i + 1) * bs])
        digest = _digest_of(cache, i)
        payload = _pack({"index": i, "digest": digest.hex(), "tokens": list(tokens)}, _block_arrays(pool, b))
        rec = _record(BLOCK, payload)
        return _Saved(b, tokens, digest, _last_rows(pool, b), rec[-_SUM:]), rec

    def _tail_payload(self, cache: KVCache, state: SessionState, blocks: Sequence[_Saved]) -> bytes:
        """Everything but the full blocks; arrays: heat, born, seen, then the partial block's rows, then each
        recurrent layer's state arrays (meta `states`: how many)."""
        bs, n = cache.pool.block_size, cache.length
        full = n // bs
        arrays = [np.asarray(cache.heat, np.float64), np.asarray(cache.born, np.int64),
                  np.asarray(state.seen, np.int64)]
        if n % bs:
            arrays += _block_arrays(cache.pool, cache.table[full])
        states = [a for layer in cache.states for a in layer.state()]
        arrays += states
        meta = {
            "states": len(states),
            "length": n, "blocks": len(blocks), "chain": _chain(blocks).hex(),
            "tokens": [int(t) for t in cache.tokens[full * bs : n]],
            "steps": int(cache.steps), "evicted": int(cache.evicted),
            "prompt_len": int(state.prompt_len), "pending": None if state.pending is None else int(state.pending),
            "sampling": None if state.sampling is None else dataclasses.asdict(state.sampling),
            "sampler": state.sampler, "extra": state.extra,
        }
        try:
            return _pack(meta, arrays)
        except (TypeError, ValueError) as exc:
            raise SessionError(f"session file {self.path}: the state's sampler or extra values are not JSON "
                               f"({exc}); keep them to dicts, lists, strings, numbers and None") from exc

    def _append(self, records: list[bytes]) -> None:
        """Add records after the newest tail, flushed to disk before returning; on failure cut them off again."""
        total = sum(len(r) for r in records)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise self._failed(exc, 0, total) from exc
        try:
            _write_all(fd, records, self._end)
            os.fsync(fd)
        except (_ShortWrite, OSError) as exc:
            written, error = (exc.written, exc.error) if isinstance(exc, _ShortWrite) else (total, exc)
            try:
                os.ftruncate(fd, self._end)     # back to the last good save (a torn end would be dropped anyway)
            except OSError:
                pass
            raise self._failed(error, written, total) from error
        finally:
            os.close(fd)

    def _rewrite(self, cache: KVCache, state: SessionState) -> None:
        """The whole file again, atomically: header, every full block, a tail."""
        bs = cache.pool.block_size
        recs = [self._block_record(cache, i) for i in range(cache.length // bs)]
        saved = [s for s, _ in recs]
        head = _record(HEADER, _pack(self._header(cache.pool), []))
        tail = _record(TAIL, self._tail_payload(cache, state, saved))
        pieces = [MAGIC + _VERSION.pack(FORMAT) + head, *(r for _, r in recs), tail]
        written = 0
        try:
            with atomic_file(self.path, "wb") as f:
                written = _write_all(f.fileno(), pieces, 0)     # unbuffered: a failure knows how far it got
        except _ShortWrite as exc:
            raise self._failed(exc.error, exc.written, sum(len(p) for p in pieces)) from exc.error
        except OSError as exc:                              # making the temporary, fsync or the rename
            raise self._failed(exc, written, sum(len(p) for p in pieces)) from exc
        self._saved, self._tail, self._end, self._live = saved, len(tail), written, written
        self._cache, self._evicted = weakref.ref(cache), cache.evicted

    def _failed(self, exc: OSError, written: int, total: int) -> SessionSaveError:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        return SessionSaveError(self.path, "disk full" if full else exc.strerror or str(exc), written, total,
                                self.path.is_file())

    def _header(self, pool: KVPool) -> dict:
        header = {"format": FORMAT, "model_hash": self.model_hash, "kv": dataclasses.asdict(self.settings),
                  "layers": _layer_shapes(pool)}
        if pool.spec.is_recurrent:          # only then: files of other models keep the header they had
            header["states"] = _state_shapes(pool)
        return header

    # --- loading ---

    def load(self, pool: KVPool) -> tuple[KVCache, SessionState]:
        """The saved sequence restored into blocks of `pool` (prefix-indexed again), and its state.

        Refuses a file saved for another model or other KV settings; a torn or damaged last save falls
        back to the one before it, and `self.dropped` says what was left out (None when nothing was).
        """
        if (pool.block_size, pool.bits) != (self.settings.block_size, self.settings.bits):
            raise SessionError(f"session file {self.path}: the pool has block size {pool.block_size} and "
                               f"{pool.bits}-bit KV but the session was opened for block size "
                               f"{self.settings.block_size} and {self.settings.bits}-bit KV; build the pool to match")
        _refuse_folder(self.path)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise SessionError(f"session file {self.path} does not exist; start a new session") from None
        except OSError as exc:
            raise SessionError(f"session file {self.path} cannot be read ({exc.strerror}); "
                               "check its permissions, or start a new session") from exc
        with f:
            records, torn = self._scan(f)
            if not records or records[0].kind != HEADER:
                raise SessionError(f"session file {self.path} has no header; it is not a Colibri session")
            header, _ = _unpack(_read(f, records[0]), self.path)
            self._check(header, pool)
            tails = [i for i, r in enumerate(records) if r.kind == TAIL]
            if not tails:
                raise SessionError(f"session file {self.path} holds no complete save; start a new session")
            last = tails[-1]
            meta, arrays = _unpack(_read(f, records[last]), self.path)
            by_index: dict[int, _Record] = {}
            for r in records[1:last]:
                if r.kind == BLOCK:
                    by_index[_block_index(f, r, self.path)] = r
            n_blocks = int(meta["blocks"])
            if any(i not in by_index for i in range(n_blocks)) or \
                    _chain_of(by_index[i].checksum for i in range(n_blocks)).hex() != meta["chain"]:
                raise SessionError(f"session file {self.path}: its last save names blocks the file does not "
                                   "hold; the file is damaged, start a new session")
            cache = self._new_cache(pool)
            try:
                saved = self._fill(f, cache, [by_index[i] for i in range(n_blocks)], meta, arrays)
            except BaseException:
                cache.release()
                raise
            size = os.fstat(f.fileno()).st_size
        self._saved, self._cache, self._evicted = saved, weakref.ref(cache), cache.evicted
        self._end, self._tail = records[last].end, records[last].size
        self._live = self._end - sum(r.size for r in records[:last] if r.kind == TAIL)
        # blocks after the last tail with nothing torn: an append cut between its blocks and its tail
        self.dropped = None if self._end == size else DroppedSave(self._end, size - self._end,
                                                                  torn or "its tail is missing")
        return cache, _state(meta, arrays[2])

    def _scan(self, f: BinaryIO) -> tuple[list[_Record], str | None]:
        """Every complete record, checksums verified, and what is wrong with a torn end (dropped; None if
        there is none); damage elsewhere is raised."""
        size = os.fstat(f.fileno()).st_size
        start = f.read(len(MAGIC) + _VERSION.size)
        if start[: len(MAGIC)] != MAGIC:
            raise SessionError(f"{self.path} is not a Colibri session file (no {MAGIC!r} at its start)")
        (version,) = _VERSION.unpack(start[len(MAGIC):])
        if version != FORMAT:
            raise SessionError(f"session file {self.path} has format {version}; this Colibri reads format "
                               f"{FORMAT}: resume it with the version that saved it, or start a new session")
        records: list[_Record] = []
        pos, torn = len(start), None
        while pos < size:
            head = f.read(_HEAD_BYTES)
            if len(head) < _HEAD_BYTES:
                torn = "cut short inside a record head"
                break
            if _CRC.unpack(head[_HEAD.size:])[0] != zlib.crc32(head[: _HEAD.size]):
                if not f.read(size).strip(b"\0") and not head.strip(b"\0"):
                    torn = "zeros a crash left behind"
                    break
                raise self._damaged(pos, "its record head fails its checksum")
            kind, length = _HEAD.unpack(head[: _HEAD.size])
            end = pos + len(head) + length + _SUM
            if end > size:
                torn = "cut short inside a record"
                break
            h = hashlib.blake2b(head, digest_size=_SUM)
            left = length
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    break                                           # shrank while we read: the checksum fails
                h.update(chunk)
                left -= len(chunk)
            checksum = f.read(_SUM)
            if checksum != h.digest():
                if end == size:                                     # the last record, half written or damaged
                    torn = f"its last {chr(kind)!r} record fails its checksum"
                    break
                raise self._damaged(pos, f"its {chr(kind)!r} record fails its checksum")
            records.append(_Record(kind, pos + len(head), length, checksum, end))
            pos = end
        return records, torn

    def _damaged(self, offset: int, problem: str) -> SessionError:
        return SessionError(f"session file {self.path} is damaged at byte {offset}: {problem}; "
                            "it cannot be restored, start a new session")

    def _check(self, header: dict, pool: KVPool) -> None:
        """Refuse a file saved for another model, other KV settings or other layer shapes, naming both."""
        want = self._header(pool)
        diffs = []
        if header.get("model_hash") != want["model_hash"]:
            diffs.append(f"model {header.get('model_hash')} in the file, {want['model_hash']} here")
        for key, value in want["kv"].items():
            if header.get("kv", {}).get(key) != value:
                diffs.append(f"KV {key} {header.get('kv', {}).get(key)} in the file, {value} here")
        if header.get("states") != want.get("states") and not diffs:
            diffs.append(f"recurrent states of shapes {header.get('states')} in the file, {want.get('states')} here")
        if header.get("layers") != want["layers"] and not diffs:
            diffs.append(f"{len(header.get('layers', []))} layers of shapes {header.get('layers')} in the file, "
                         f"{len(want['layers'])} of {want['layers']} here")
        if diffs:
            raise SessionError(f"session file {self.path} was saved for another model or KV settings ("
                               + "; ".join(diffs) + "): resume it with the model and settings it was saved with, "
                               "or start a new session")

    def _new_cache(self, pool: KVPool) -> KVCache:
        s = self.settings
        return KVCache(pool.spec, s.max_len, pool=pool, overflow=s.overflow, sink_tokens=s.sink_tokens,
                       recent_tokens=s.recent_tokens)

    def _fill(self, f: BinaryIO, cache: KVCache, blocks: list[_Record], meta: dict,
              arrays: list[np.ndarray]) -> list[_Saved]:
        """Blocks allocated from the pool and filled, then table, tokens, digests and retention state."""
        pool, bs = cache.pool, cache.pool.block_size
        saved, tokens, digests = [], [], []
        for i, r in enumerate(blocks):
            m, rows = _unpack(_read(f, r), self.path)
            b = pool.allocate()
            cache.table.append(b)
            _put_block(pool, b, rows, self.path)
            block_tokens = tuple(int(t) for t in m["tokens"])
            digest = bytes.fromhex(m["digest"])
            tokens += block_tokens
            digests.append(digest)
            saved.append(_Saved(b, block_tokens, digest, _last_rows(pool, b), r.checksum))
        length = int(meta["length"])
        tokens += [int(t) for t in meta["tokens"]]
        n_states = int(meta.get("states", 0))
        rows = arrays[3 : len(arrays) - n_states]
        states = _states(arrays[len(arrays) - n_states :], pool, self.path)
        if length % bs:
            b = pool.allocate()
            cache.table.append(b)
            _put_block(pool, b, rows, self.path)
        if len(tokens) != length or len(cache.table) * bs < length or len(blocks) != length // bs:
            raise SessionError(f"session file {self.path}: its last save holds {len(tokens)} tokens for a length of "
                               f"{length}; the file is damaged, start a new session")
        cache.restore(cache.table, tokens, length, digests, arrays[0], arrays[1], int(meta["steps"]),
                      int(meta["evicted"]), states)
        return saved


# --- records and payloads ---

class _ShortWrite(Exception):
    """A write that stopped part way: how many bytes reached the file, and why it stopped."""

    def __init__(self, written: int, error: OSError):
        super().__init__(written, error)
        self.written, self.error = written, error


def _write_all(fd: int, pieces: Sequence[bytes], offset: int) -> int:
    """Write the pieces one after another from `offset`; returns the bytes written, or raises `_ShortWrite`."""
    done = 0
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                n = os.pwrite(fd, view, offset + done)
                done += n
                view = view[n:]
    except OSError as exc:
        raise _ShortWrite(done, exc) from exc
    return done


def _refuse_folder(path: Path) -> None:
    if path.is_dir():
        raise SessionError(f"session file {path} is a folder; name a file, e.g. {path / 'chat.session'}")


def _record(kind: int, payload: bytes) -> bytes:
    head = _HEAD.pack(kind, len(payload))
    head += _CRC.pack(zlib.crc32(head))
    h = hashlib.blake2b(head, digest_size=_SUM)
    h.update(payload)
    return head + payload + h.digest()


def _read(f: BinaryIO, r: _Record) -> bytes:
    f.seek(r.offset)
    return f.read(r.length)


def _pack(meta: dict, arrays: Sequence[np.ndarray]) -> bytes:
    """A JSON meta naming each array's dtype and shape, then the arrays' bytes."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    meta = {**meta, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
    text = json.dumps(meta, separators=(",", ":")).encode()
    return b"".join([_META.pack(len(text)), text, *(a.tobytes() for a in arrays)])


def _unpack(payload: bytes, path: Path) -> tuple[dict, list[np.ndarray]]:
    """A payload's meta and its arrays (read-only views of the payload)."""
    try:
        (n,) = _META.unpack_from(payload)
        meta = json.loads(payload[_META.size : _META.size + n])
        arrays, pos = [], _META.size + n
        for dtype, shape in meta["arrays"]:
            dt = np.dtype(dtype)
            count = int(np.prod(shape))
            arrays.append(np.frombuffer(payload, dt, count, pos).reshape(shape))
            pos += count * dt.itemsize
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise SessionError(f"session file {path}: a record's contents are unreadable ({exc}); "
                           "the file was written by something else, start a new session") from exc
    if pos != len(payload):
        raise SessionError(f"session file {path}: a record holds {len(payload)} bytes where its arrays take "
                           f"{pos}; the file is damaged, start a new session")
    return meta, arrays


def _block_index(f: BinaryIO, r: _Record, path: Path) -> int:
    """Which block a block record holds, from its meta alone (its rows are read only if a tail needs them)."""
    f.seek(r.offset)
    (n,) = _META.unpack(f.read(_META.size))
    try:
        return int(json.loads(f.read(n))["index"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SessionError(f"session file {path}: a block record has no index ({exc}); start a new session") from exc


def _state(meta: dict, seen: np.ndarray) -> SessionState:
    sampling = meta.get("sampling")
    if sampling is not None:
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        sampling = SamplingParams(**{k: v for k, v in sampling.items() if k in known})
    return SessionState(tuple(int(t) for t in seen), int(meta["prompt_len"]), meta.get("pending"), sampling,
                        meta.get("sampler"), meta.get("extra") or {})


# --- blocks ---

def _parts(arrays: dict) -> tuple[str, ...]:
    """The names of one layer's arrays, in their saved order: k, ks, v, vs, then any a layer adds (indexer keys);
    none for a recurrent layer (its state is in the tail)."""
    if not arrays:
        return ()
    return _PARTS + tuple(name for name in arrays if name not in _PARTS)


def _layer_shapes(pool: KVPool) -> list[list]:
    """Each layer's arrays per block: [name, dtype, shape], what a block record holds."""
    return [[[name, arrays[name].dtype.str, list(arrays[name].shape[1:])] for name in _parts(arrays)]
            for arrays in pool.layers]


def _state_shapes(pool: KVPool) -> list[list]:
    """Each recurrent layer's state arrays: [dtype, shape] (what a tail holds after the held tokens)."""
    return [[["<f4", list(shape)] for shape in layer.attn.state_shapes]
            for layer in pool.spec.layers if getattr(layer.attn, "state_shapes", None) is not None]


def _states(arrays: Sequence[np.ndarray], pool: KVPool, path: Path) -> list[tuple[np.ndarray, ...]]:
    """A tail's recurrent-state arrays grouped per layer (copies: the layers' states outlive the payload)."""
    shapes = _state_shapes(pool)
    if [[a.dtype.str, list(a.shape)] for a in arrays] != [x for layer in shapes for x in layer]:
        raise SessionError(f"session file {path}: its recurrent states do not match the model's layers; "
                           "the file is damaged, start a new session")
    out, i = [], 0
    for layer in shapes:
        out.append(tuple(np.array(a) for a in arrays[i : i + len(layer)]))
        i += len(layer)
    return out


def _block_arrays(pool: KVPool, b: int) -> list[np.ndarray]:
    return [arrays[name][b] for arrays in pool.layers for name in _parts(arrays)]


def _put_block(pool: KVPool, b: int, rows: Sequence[np.ndarray], path: Path) -> None:
    targets = [(arrays, name) for arrays in pool.layers for name in _parts(arrays)]
    if len(rows) != len(targets) or any(r.shape != a[n].shape[1:] or r.dtype != a[n].dtype
                                        for r, (a, n) in zip(rows, targets)):
        raise SessionError(f"session file {path}: a block's arrays do not match the model's layers; "
                           "the file is damaged, start a new session")
    for r, (arrays, name) in zip(rows, targets):
        arrays[name][b] = r


def _last_rows(pool: KVPool, b: int) -> bytes:
    """A fingerprint of block b: its last position in every layer (rewriting the block recomputes it)."""
    h = hashlib.blake2b(digest_size=16)
    last = pool.block_size - 1
    for latent, arrays in zip(pool.latent, pool.layers):
        for name in _parts(arrays):
            a = arrays[name][b]
            h.update(np.ascontiguousarray(a[last] if latent else a[:, last]).tobytes())
    return h.digest()


def _digest_of(cache: KVCache, i: int) -> bytes:
    """Block i's prefix digest (b"" once the sequence evicted: its blocks no longer match a fresh run)."""
    digests = cache.digests
    return digests[i] if i < len(digests) else b""


def _chain(blocks: Sequence[_Saved]) -> bytes:
    return _chain_of(s.record for s in blocks)


def _chain_of(checksums: Any) -> bytes:
    """One hash over the checksums of a tail's block records: a tail restores only the blocks it was saved with."""
    h = hashlib.blake2b(digest_size=16)
    for c in checksums:
        h.update(c)
    return h.digest()


def _describe(s: KVSettings) -> str:
    return (f"block size {s.block_size}, {s.bits}-bit KV, max_len {s.max_len}, overflow {s.overflow}, "
            f"sinks {s.sink_tokens}, recent {s.recent_tokens}")
