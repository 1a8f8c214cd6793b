"""Safe file writes: atomic replacement, the temporary files a crash leaves, and one writer per file.

`atomic_file` writes a temporary file beside the target, flushes it to disk, then renames it over the
target: a reader sees the old file or the new one, never half of one; a failed write leaves the old file
as it was and no temporary behind. Only a kill between the temporary's creation and its rename leaves
one (`.NAME.XXXXXXXX.tmp`); `remove_temps` clears them once a `FileLock` proves no writer is live.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Iterator

from engine.errors import FileInUseError

_TEMP_SUFFIX = ".tmp"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", public: bool = True) -> Iterator[IO]:
    """Open a temporary file for writing; on a clean exit it replaces `path` (parent folders are made).

    mode "w" (UTF-8 text) or "wb"; public=True gives the file the usual 0o644 instead of mkstemp's 0o600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TEMP_SUFFIX, dir=path.parent)
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


def remove_temps(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files `atomic_file` made for `path` and never renamed; returns them.

    Call it only while no writer of `path` can be running (hold its `FileLock`): a live writer's
    temporary looks the same. mkstemp's random part has no dot, so another file's temporaries
    (`.NAME.b.XXXXXXXX.tmp` of NAME.b) never match.
    """
    path = Path(path)
    pattern = re.compile(re.escape(f".{path.name}.") + r"[^.]+" + re.escape(_TEMP_SUFFIX))
    removed = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed                              # no folder yet: nothing left behind
    for name in names:
        if pattern.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                (path.parent / name).unlink()
                removed.append(path.parent / name)
    return removed


class FileLock:
    """An exclusive hold on `path` for this process: `flock` on a sidecar `.NAME.lock` beside it.

    The sidecar is locked, not the file, because `atomic_file` replaces the file (a new inode) on every
    write. The kernel drops the hold when the process dies, so a crash never leaves it stuck; the sidecar
    stays (deleting it would let two processes lock two different inodes). It holds the holder's pid,
    for the message of whoever is refused. Holds are per open file: a second FileLock on the same path
    is refused even in the same process.
    """

    def __init__(self, path: str | os.PathLike, what: str = "file", fix: str = "stop it, or use another file"):
        self.path, self.what, self.fix = Path(path), what, fix
        self.lock_path = self.path.parent / f".{self.path.name}.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> FileLock:
        """Take the lock or raise `FileInUseError` naming the holder; OSError if the sidecar cannot be made."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise FileInUseError(f"{self.what} {self.path} is in use by {_describe_process(pid)}; {self.fix}",
                                 self.path, pid) from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):          # the pid only names us to others: a full disk may refuse it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Let go of the lock (closing the sidecar releases it); the sidecar file stays."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None                                 # the holder is between truncating and writing it


def _describe_process(pid: int | None) -> str:
    """'process 1234 (colibri chat m --session f)', as far as it can be told."""
    if pid is None:
        return "another process"
    if pid == os.getpid():
        return f"this process ({pid})"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return f"process {pid}"
    if len(argv) > 2 and argv[1:3] == ["-m", "app.cli"]:
        argv = ["colibri", *argv[3:]]               # python -m app.cli ... is `colibri ...`
    elif argv and Path(argv[0]).name.startswith("python") and len(argv) > 1 and Path(argv[1]).name == "colibri":
        argv = ["colibri", *argv[2:]]
    command = " ".join(" ".join(argv).split())     # one line, whatever newlines `python -c` code holds
    return f"process {pid} ({command[:157] + '...' if len(command) > 160 else command})"
