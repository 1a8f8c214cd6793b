"""A real full disk for tests: a size-limited tmpfs in a private mount namespace, no privileges needed.

`unshare -rm` makes a user and mount namespace where we may mount a tmpfs; writes past its size fail
with a real ENOSPC. Two ways to use one:

    proc = run_on_small_disk([sys.executable, "-m", "app.cli", ...], 2 << 20, tmp_path / "disk", text=True)

runs a command with the tmpfs mounted at the folder (only it sees the tmpfs), and

    with small_disk(2 << 20, tmp_path / "disk") as disk:     # a Path this process can write to
        fill(disk, leave=64 << 10)

keeps a holder process alive and yields the tmpfs as seen through `/proc/HOLDER/root`, so this process
and any child of it write to it like any folder. A machine without `unshare` or user namespaces fails
loudly with the reason: the tests that need a full disk must not silently pass.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, Sequence

PAGE = 4096


def _unshare() -> str:
    found = shutil.which("unshare")
    if found is None:
        raise RuntimeError("`unshare` (util-linux) is not installed: the full-disk tests need it to mount a small "
                           "tmpfs without privileges; install util-linux")
    return found


def _mount_script(size_bytes: int) -> str:
    """sh -c script: mount a tmpfs of size_bytes at $1, then run the rest ("$@" after a shift)."""
    size = -(-size_bytes // PAGE) * PAGE
    return f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$1" || exit 97; shift; exec "$@"'


def run_on_small_disk(argv: Sequence[str], size_bytes: int, mount_dir: str | os.PathLike,
                      **subprocess_kwargs) -> subprocess.CompletedProcess:
    """Run argv with a fresh tmpfs of size_bytes (rounded up to pages) mounted at mount_dir, seen only by it.

    mount_dir is made if missing. Returns subprocess.run's result; raises RuntimeError if the tmpfs
    cannot be mounted (exit 97), with unshare's message.
    """
    mount_dir = Path(mount_dir)
    mount_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"capture_output": True, **subprocess_kwargs}
    proc = subprocess.run([_unshare(), "-rm", "sh", "-c", _mount_script(size_bytes), "sh", str(mount_dir), *argv],
                          **kwargs)
    if proc.returncode == 97:
        raise RuntimeError(f"could not mount a tmpfs at {mount_dir} in a user namespace: {proc.stderr!r}")
    return proc


@contextlib.contextmanager
def small_disk(size_bytes: int, mount_dir: str | os.PathLike) -> Iterator[Path]:
    """A tmpfs of size_bytes this process can use: yields its path (under /proc/HOLDER/root); gone on exit."""
    mount_dir = Path(mount_dir).resolve()
    mount_dir.mkdir(parents=True, exist_ok=True)
    # the holder says "ready" once mounted, then waits for its stdin to close
    holder = subprocess.Popen([_unshare(), "-rm", "sh", "-c", _mount_script(size_bytes), "sh", str(mount_dir),
                               "sh", "-c", "echo ready; exec cat >/dev/null"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        if line.strip() != "ready":
            holder.wait(timeout=30)
            raise RuntimeError(f"could not mount a tmpfs at {mount_dir} in a user namespace "
                               f"(exit {holder.returncode}): {holder.stderr.read()!r}")
        yield Path(f"/proc/{holder.pid}/root") / mount_dir.relative_to("/")
    finally:
        holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        holder.stdout.close()
        holder.stderr.close()


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes still free on the file system holding path."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk: str | os.PathLike, leave: int, name: str = "filler") -> Path:
    """Take the disk's free space but `leave` bytes (rounded down to pages) with one file; returns it."""
    filler = Path(disk) / name
    with open(filler, "ab") as f:
        left = free_bytes(disk) - (leave // PAGE) * PAGE
        chunk = b"\0" * (1 << 20)
        while left > 0:
            n = os.write(f.fileno(), chunk[: min(left, len(chunk))])
            left -= n
    return filler
