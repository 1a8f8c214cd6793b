"""Atomic file writes: a temporary file beside the target, flushed to disk, then renamed over it.

A reader sees the old file or the new one, never half of one; a failed write leaves the old file
as it was and no temporary behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", public: bool = True) -> Iterator[IO]:
    """Open a temporary file for writing; on a clean exit it replaces `path` (parent folders are made).

    mode "w" (UTF-8 text) or "wb"; public=True gives the file the usual 0o644 instead of mkstemp's 0o600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if public:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
