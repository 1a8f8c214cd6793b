"""Usage history: decayed routing counts per (layer, expert), the sidecar file that keeps them
across runs (bound to the model's hash), and re-pinning that follows them without thrashing.

The counts choose which experts to pin and are the prior of the learned cache policy.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from engine.atomic import atomic_file
from engine.errors import DiskFullError, ModelFormatError, is_disk_full

Key = tuple[int, int]                       # (layer, expert)

FORMAT = "colibri-usage-history"
VERSION = 1
_RENORM_HALF_LIVES = 64.0                   # fold the growing increment back in after this many


class UsageHistory:
    """Decayed routing counts per (layer, expert) for one model, stored in a sidecar bound to the model hash."""

    def __init__(self, n_layers: int, n_experts: int, model_hash: str, half_life_tokens: float = 2000.0):
        if n_layers < 1 or n_experts < 1:
            raise ValueError(f"usage history needs >= 1 layer and expert, got {n_layers} x {n_experts}")
        if not half_life_tokens > 0:
            raise ValueError(f"half_life_tokens must be > 0, got {half_life_tokens}")
        self.n_layers, self.n_experts = n_layers, n_experts
        self.model_hash = model_hash
        self.half_life_tokens = float(half_life_tokens)
        self.tokens = 0                                      # tokens recorded in total
        # Lazy decay: a count recorded now is worth 2**(since / half_life) in _raw, so decaying
        # is one float update per token; counts = _raw / _inc.
        self._raw = np.zeros((n_layers, n_experts), np.float64)  # [L, E]
        self._since = 0.0                                    # tokens since _raw was last folded
        self.policy_half_life: float | None = None           # tokens; learned by the store (None: the default)

    @property
    def _inc(self) -> float:
        return 2.0 ** (self._since / self.half_life_tokens)

    @property
    def counts(self) -> np.ndarray:
        """The decayed counts [L, E] float64 (a fresh array)."""
        return self._raw / self._inc

    def record(self, layer: int, ids: np.ndarray) -> None:
        """Count one layer step's routed ids (any shape; each occurrence counts 1)."""
        flat = np.asarray(ids).ravel()                       # [T * k]
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} outside 0..{self.n_layers - 1}")
        if flat.size and (flat.min() < 0 or flat.max() >= self.n_experts):
            raise ValueError(f"expert ids {flat.min()}..{flat.max()} outside 0..{self.n_experts - 1}")
        np.add.at(self._raw[layer], flat, self._inc)

    def record_steps(self, layers: Sequence[int], ids: Sequence[Sequence[int]]) -> None:
        """`record` for several layer steps at once: step j routed `ids[j]` in layer `layers[j]`."""
        rows = np.repeat(np.asarray(layers, np.int64), [len(i) for i in ids])
        flat = np.fromiter((e for step in ids for e in step), np.int64, count=len(rows))
        if rows.size and (rows.min() < 0 or rows.max() >= self.n_layers):
            raise ValueError(f"layers {rows.min()}..{rows.max()} outside 0..{self.n_layers - 1}")
        if flat.size and (flat.min() < 0 or flat.max() >= self.n_experts):
            raise ValueError(f"expert ids {flat.min()}..{flat.max()} outside 0..{self.n_experts - 1}")
        np.add.at(self._raw, (rows, flat), self._inc)

    def end_token(self, n: int = 1) -> None:
        """`n` tokens have passed: every count decays by 0.5 ** (n / half_life_tokens)."""
        self.tokens += n
        self._since += n
        if self._since > _RENORM_HALF_LIVES * self.half_life_tokens:
            self._raw /= self._inc
            self._since = 0.0

    def pinned(self, capacity: int, exclude: Iterable[Key] = ()) -> frozenset[Key]:
        """The `capacity` most used keys outside `exclude` (never-used keys are not pinned)."""
        counts = self.counts.ravel()                         # [L * E]
        for layer, expert in exclude:
            if 0 <= layer < self.n_layers and 0 <= expert < self.n_experts:
                counts[layer * self.n_experts + expert] = 0.0
        order = np.argsort(-counts, kind="stable")[:max(capacity, 0)]  # ties: lower key first
        return frozenset(divmod(int(i), self.n_experts) for i in order if counts[i] > 0)

    def save(self, path: str | os.PathLike) -> None:
        """Write the history to `path` atomically (a temp file in the same folder, fsync, rename).

        A full disk raises DiskFullError and leaves the previous file as it was.
        """
        path = Path(path)
        try:
            with atomic_file(path, "wb") as f:
                np.savez(f, format=np.array(FORMAT), version=np.array(VERSION),
                         model_hash=np.array(self.model_hash),
                         shape=np.array([self.n_layers, self.n_experts], np.int64),
                         half_life_tokens=np.array(self.half_life_tokens),
                         tokens=np.array(self.tokens, np.int64), counts=self.counts,
                         policy_half_life_tokens=np.array(np.nan if self.policy_half_life is None
                                                          else self.policy_half_life))
        except OSError as exc:
            if is_disk_full(exc):
                raise DiskFullError(f"disk full: the usage history {path} was not saved (the previous one is kept); "
                                    "free space and it is saved at the end of the next run") from None
            raise
        _fsync_dir(path.parent)

    @classmethod
    def load(cls, path: str | os.PathLike, model_hash: str, n_layers: int, n_experts: int) -> UsageHistory:
        """Read a history saved by `save`; ModelFormatError if it is for another model or unreadable."""
        path = Path(path)
        fix = "delete it to start a new history"
        if not path.is_file():
            raise ModelFormatError(f"usage history {path} not found")
        try:
            with np.load(path, allow_pickle=False) as z:
                fields = {name: z[name] for name in z.files}  # reads (and CRC-checks) every member
            fmt, version = str(fields["format"]), int(fields["version"])
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise ModelFormatError(f"usage history {path} is corrupt or truncated ({e}): {fix}") from e
        if fmt != FORMAT:
            raise ModelFormatError(f"{path} is not a usage history (format {fmt!r}): {fix}")
        if version > VERSION:
            raise ModelFormatError(f"usage history {path} has version {version}, newer than this "
                                   f"colibri reads ({VERSION}): upgrade colibri or {fix}")
        try:
            saved_hash = str(fields["model_hash"])
            shape = tuple(int(n) for n in fields["shape"])
            half_life, tokens = float(fields["half_life_tokens"]), int(fields["tokens"])
            counts = np.asarray(fields["counts"], np.float64)
            learned = float(fields.get("policy_half_life_tokens", np.nan))   # absent from older files
        except (KeyError, ValueError, TypeError) as e:
            raise ModelFormatError(f"usage history {path} is missing a field ({e}): {fix}") from e
        if saved_hash != model_hash:
            raise ModelFormatError(f"usage history {path} belongs to model {saved_hash}, not {model_hash}: "
                                   "delete it or pass the right model")
        if shape != (n_layers, n_experts) or counts.shape != shape:
            raise ModelFormatError(f"usage history {path} has {counts.shape} counts for a model of "
                                   f"{n_layers} layers x {n_experts} experts: {fix}")
        if not (half_life > 0 and tokens >= 0 and np.all(np.isfinite(counts)) and np.all(counts >= 0)):
            raise ModelFormatError(f"usage history {path} holds invalid values: {fix}")
        history = cls(n_layers, n_experts, model_hash, half_life)
        history.tokens = tokens
        history._raw = counts.copy()
        history.policy_half_life = learned if np.isfinite(learned) and learned > 0 else None
        return history

    @classmethod
    def load_or_new(cls, path: str | os.PathLike, model_hash: str, n_layers: int, n_experts: int, *,
                    half_life_tokens: float = 2000.0) -> UsageHistory:
        """The history at `path`, or a new one when the file is missing (errors as `load` otherwise)."""
        if not os.path.lexists(path):
            return cls(n_layers, n_experts, model_hash, half_life_tokens)
        return cls.load(path, model_hash, n_layers, n_experts)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Repinner:
    """Re-pinning with hysteresis: follows a changing workload without thrashing."""

    def __init__(self, capacity: int, margin: float = 1.25, every_tokens: int = 32):
        if capacity < 0 or not margin >= 1 or every_tokens < 1:
            raise ValueError(f"Repinner needs capacity >= 0, margin >= 1 and every_tokens >= 1, "
                             f"got {capacity}, {margin}, {every_tokens}")
        self.capacity, self.margin, self.every_tokens = capacity, margin, every_tokens
        self._last: int | None = None                       # tokens at the last update

    def update(self, history: UsageHistory, pinned: frozenset, tokens: int) -> tuple[frozenset, frozenset]:
        """(to_pin, to_unpin) at most every `every_tokens` tokens, keeping at most `capacity` pinned.

        Free slots take the most used unpinned keys; a pinned key gives way to an unpinned one
        only when the newcomer's count exceeds its own by `margin`, so near-ties never thrash.
        """
        if self._last is not None and 0 <= tokens - self._last < self.every_tokens:
            return frozenset(), frozenset()
        self._last = tokens
        counts = history.counts                              # [L, E]
        E = history.n_experts

        def count(key: Key) -> float:
            layer, expert = key
            ok = 0 <= layer < history.n_layers and 0 <= expert < E
            return float(counts[layer, expert]) if ok else -1.0  # a stale key goes first

        kept = sorted(pinned, key=lambda k: (count(k), k))  # weakest first
        to_unpin = kept[:max(len(kept) - self.capacity, 0)]  # over capacity: drop the weakest
        kept = kept[len(to_unpin):]
        flat = counts.ravel()
        order = np.argsort(-flat, kind="stable")             # strongest first
        held = set(pinned)
        candidates = [divmod(int(i), E) for i in order[:self.capacity + len(held)] if flat[i] > 0]
        candidates = [k for k in candidates if k not in held]
        to_pin = []
        for key in candidates:
            if len(kept) + len(to_pin) < self.capacity:
                to_pin.append(key)                           # a free slot: no margin needed
            elif kept and count(key) > self.margin * max(count(kept[0]), 0.0):
                to_unpin.append(kept.pop(0))
                to_pin.append(key)
            else:
                break                                        # candidates only weaken from here
        return frozenset(to_pin), frozenset(to_unpin)
