"""The errors the engine raises for a user's mistake: each names the problem and the fix."""

from __future__ import annotations

import errno


class ColibriError(Exception):
    """A problem a user can fix; front ends print the message without a traceback."""


class ModelFormatError(ColibriError):
    """A model file or folder is missing, truncated, inconsistent or of an unknown kind."""


class UnsupportedArchitectureError(ColibriError):
    """The checkpoint's architecture has no module in `engine.models`."""


class TokenizerError(ColibriError):
    """The tokenizer or chat template cannot be built or used."""


class GenerationError(ColibriError):
    """A request cannot be served as asked (prompt too long, bad sampling settings ...)."""


class FileInUseError(ColibriError):
    """Another process holds the file's lock (`engine.atomic.FileLock`): two writers would overwrite each other."""

    def __init__(self, message: str, path: object, pid: int | None):
        super().__init__(message)
        self.path, self.pid = path, pid      # pid: the holder, None if it could not be read


# errno values meaning "no room left": a full disk, a used-up quota, a file past the size limit
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFullError(ColibriError):
    """A write ran out of space (`DISK_FULL_ERRNOS`); the message says what was kept and how to go on."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether EXC is an OSError of `DISK_FULL_ERRNOS`."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS
