"""Fault injection for tests/faults/: kill a command at a chosen file-system step, or when a file grows; damage bytes.

A *step* is one thing a process does to files under a watched folder: half of a write (every write is split
in two, so a kill can tear it), a rename, an unlink or a truncate. `run_with_kills([(argv, n), ...], watch)`
runs `colibri ARGV` (or a script) once per pair, with every such call counted, and SIGKILLs the run just before
its step n: exact, repeatable kill points anywhere in a run, torn writes included. With n = 0 the run goes to
its end and says how many steps it took, so a seeded RNG can pick points spread over the whole run.
`kill_when(popen, condition)` is the outside view: SIGKILL once a condition on the files holds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[2]

# Runs in the child: counts steps under WATCH and kills itself at step KILL_AT (0: never), then runs the command.
_INJECTOR = r'''
import atexit, builtins, io, os, signal, sys
sys.path.insert(0, os.getcwd())
import json
runs, results, watch = json.loads(sys.argv[1]), sys.argv[2], os.path.realpath(sys.argv[3])
script = sys.argv[4] if len(sys.argv) > 4 else None
kill_at = 0
count = [0]

def step():
    count[0] += 1
    if count[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def watched(path):
    try:
        return os.path.realpath(os.fspath(path)).startswith(watch + os.sep)
    except (TypeError, ValueError):
        return False

def fd_watched(fd):
    try:
        return watched(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return False

class File:
    """A file object whose writes are counted (in two halves) when it lies under the watched folder."""
    def __init__(self, f):
        object.__setattr__(self, "_f", f)
    def write(self, data):
        view = memoryview(data) if not isinstance(data, str) else data
        half = len(view) // 2
        if half:
            self._f.write(view[:half])
            step()
        self._f.write(view[half:])
        step()
        return len(view)
    def __getattr__(self, name):
        return getattr(self._f, name)
    def __setattr__(self, name, value):
        setattr(self._f, name, value)
    def __iter__(self):
        return iter(self._f)
    def __enter__(self):
        self._f.__enter__()
        return self
    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

real_open = io.open
def counted_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    if any(c in mode for c in "wax+") and (fd_watched(file) if isinstance(file, int) else watched(file)):
        return File(f)
    return f
builtins.open = io.open = counted_open

def wrap_path_op(name, nargs=1):
    real = getattr(os, name)
    def op(*a, **kw):
        if any(watched(p) if not isinstance(p, int) else fd_watched(p) for p in a[:nargs]):
            step()
        return real(*a, **kw)
    setattr(os, name, op)
for name, n in (("replace", 2), ("rename", 2), ("unlink", 1), ("remove", 1), ("truncate", 1), ("ftruncate", 1)):
    wrap_path_op(name, n)

def wrap_fd_write(name):
    real = getattr(os, name)
    def op(fd, data, *rest):
        if not fd_watched(fd):
            return real(fd, data, *rest)
        view = memoryview(data)
        half = len(view) // 2
        n = 0
        if half:
            n = real(fd, view[:half], *[r for r in rest])
            step()
            if n < half:
                return n
            rest = tuple(r + n for r in rest)   # pwrite: the offset moves on
        n += real(fd, view[half:], *rest)
        step()
        return n
    setattr(os, name, op)
wrap_fd_write("write")
wrap_fd_write("pwrite")

def command(argv):
    if script is not None:
        sys.argv = ["script", *argv]
        exec(compile(script, "<fault script>", "exec"), {"__name__": "__main__"})
        return 0
    from app.cli import main
    return main(argv)

# imported once here; each run is a fork of this process, so that a kill costs no start-up
import app.cli, engine.loader, app.hub.convert  # noqa: E401
for i, (argv, kill_at) in enumerate(runs):
    out, err = (os.open(f"{results}.{i}.{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for k in ("out", "err"))
    pid = os.fork()
    if pid == 0:
        os.dup2(out, 1)
        os.dup2(err, 2)
        try:
            code = command(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        with real_open(f"{results}.{i}.steps", "w") as f:
            f.write(str(count[0]))
        os._exit(code or 0)
    os.close(out)
    os.close(err)
    _, status = os.waitpid(pid, 0)
    with real_open(f"{results}.{i}.status", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
'''


@dataclass(frozen=True)
class Run:
    """How a run under the injector ended."""

    returncode: int
    stdout: str
    stderr: str
    steps: int | None            # steps counted, when the run ended by itself (None: it was killed)

    @property
    def killed(self) -> bool:
        """Whether SIGKILL ended it."""
        return self.returncode == -signal.SIGKILL


def run_with_kills(runs: Sequence[tuple[Sequence[str], int]], watch: str | os.PathLike, *,
                   script: str | None = None, timeout: float = 600) -> list[Run]:
    """For each (ARGV, POINT), one after another: run `colibri ARGV` (or SCRIPT with ARGV as sys.argv[1:]),
    killed before its step POINT (0: never). The runs are forks of one process that imported Colibri once."""
    results = Path(watch).parent / f".fault-{os.getpid()}-{time.monotonic_ns()}"
    plan = json.dumps([[[str(a) for a in argv], int(n)] for argv, n in runs])
    proc = subprocess.run([sys.executable, "-c", _INJECTOR, plan, str(results), str(watch),
                           *([script] if script is not None else [])],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the fault injector failed ({proc.returncode}): {proc.stderr}")
    out = []
    for i in range(len(runs)):
        part = {k: Path(f"{results}.{i}.{k}") for k in ("out", "err", "steps", "status")}
        steps = int(part["steps"].read_text()) if part["steps"].is_file() else None
        out.append(Run(int(part["status"].read_text()), part["out"].read_text(), part["err"].read_text(), steps))
        for f in part.values():
            f.unlink(missing_ok=True)
    return out


def run_with_kill_at(argv: Sequence[str], watch: str | os.PathLike, kill_at: int = 0, *,
                     script: str | None = None, timeout: float = 600) -> Run:
    """One run of `run_with_kills`."""
    return run_with_kills([(argv, kill_at)], watch, script=script, timeout=timeout)[0]


def kill_points(rng: random.Random, steps: int, n: int) -> list[int]:
    """N distinct kill points spread over a run of STEPS steps: one drawn in each of N equal stretches."""
    edges = [1 + steps * i // n for i in range(n + 1)]
    return [rng.randrange(lo, max(hi, lo + 1)) for lo, hi in zip(edges, edges[1:])]


def kill_when(proc: subprocess.Popen, condition: Callable[[], bool], deadline_s: float = 300) -> bool:
    """SIGKILL PROC as soon as CONDITION holds; False if it ended first. Waits on the process, checking between."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            proc.kill()
            proc.wait()
            return True
        try:
            proc.wait(timeout=0.005)        # the poll interval is a wait on the process itself
            return False
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()
    raise TimeoutError(f"neither the condition nor the end of {proc.args!r} came within {deadline_s} s")


def line_count(path: Path) -> int:
    """Complete lines in a file (0 when missing)."""
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under FOLDER by relative path: for byte-for-byte comparisons of outputs."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def damage(path: Path, rng: random.Random, how: str, region: tuple[int, int] | None = None) -> str:
    """Damage a file in place: "flip" one byte (xor a nonzero mask), "truncate" it, or "append" bytes.

    REGION (start, end) limits where a flip or a cut falls. Returns what was done, for failure messages.
    """
    data = bytearray(path.read_bytes())
    lo, hi = region or (0, len(data))
    hi = min(hi, len(data))
    if how == "flip":
        at = rng.randrange(lo, hi)
        data[at] ^= rng.randrange(1, 256)
        what = f"flipped byte {at} of {len(data)}"
    elif how == "truncate":
        at = rng.randrange(lo, hi)
        del data[at:]
        what = f"cut at byte {at} of {len(path.read_bytes())}"
    elif how == "append":
        extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        data += extra
        what = f"appended {len(extra)} bytes"
    else:
        raise ValueError(f"unknown damage {how!r}")
    path.write_bytes(bytes(data))
    return f"{path.name}: {what}"
