"""`colibri doctor`: what this machine offers Colibri, each finding with a verdict and, when wrong, the fix.

Each check is a function returning a `Check`. `iter_checks` runs them one by one under a guard,
so a check that breaks becomes a "warn" line naming the error instead of a traceback: a
diagnostic tool must not fail on the machines that need it most. Probes that can hang or kill the
process (an OpenGL context through a broken driver) run in a subprocess with a timeout. The
sources are Linux's (/proc/meminfo, /proc/cpuinfo, /proc/mounts, /sys/dev/block); elsewhere those
checks say they cannot tell.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import functools
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.config.sizes import format_size
from app.plan.budget import process_rss

VERDICTS = ("ok", "warn", "fail")
PROBE_BYTES = 64 * 10**6         # the scratch file timed for disk reads: ~50 ms at SSD speed, < 1 s on a disk
SLOW_DISK_GBS = 0.3             # below this, streamed experts make decode disk-bound at a few tokens per second
LOW_FREE_BYTES = 10 * 10**9     # room for one converted mid-sized model
GUI_PROBE_SECONDS = 20.0
_NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "fuse.sshfs", "afs", "ceph", "glusterfs"}
_MEMORY_FS = {"tmpfs", "ramfs"}
_SOFTWARE_GL = ("llvmpipe", "softpipe", "swrast", "software")


@dataclass(frozen=True)
class Check:
    """One finding: what was looked at, what was found, the verdict and (when not ok) what to do."""

    name: str
    value: str
    verdict: str             # "ok" | "warn" | "fail"
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"Check {self.name!r}: verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def as_dict(self) -> dict[str, str | None]:
        """Plain JSON-ready values."""
        return dataclasses.asdict(self)


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


# ---- memory ---------------------------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per field ("MemTotal:  24684084 kB" -> {"MemTotal": 25276502016})."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup (a container's), or None when there is none.

    /proc/meminfo shows the host's memory inside a container; a budget above the cgroup limit gets
    the process killed, so the limit is what counts.
    """
    try:
        lines = _read("/proc/self/cgroup").splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0":
            candidates += [f"/sys/fs/cgroup{path.rstrip('/')}/memory.max", "/sys/fs/cgroup/memory.max"]
        elif "memory" in controllers.split(","):
            candidates += [f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.limit_in_bytes",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    for candidate in candidates:
        try:
            text = _read(candidate).strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:   # "max" or a huge number: no limit
            return int(text)
    return None


def check_memory(meminfo: Mapping[str, int] | None = None, limit: int | None = None) -> Check:
    """Total and available memory (and a container's limit), with the budget that leaves room for the rest.

    Without `meminfo` this machine's /proc/meminfo and cgroup limit are read; with it, `limit` is taken as given.
    """
    if meminfo is None:
        meminfo, limit = parse_meminfo(_read("/proc/meminfo")), cgroup_memory_limit()
    total, available = meminfo["MemTotal"], meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    others = max(total - available - process_rss(), 0)   # counts against any budget: run's cache gives way to it
    value = f"{format_size(total)} total, {format_size(available)} available (other programs hold {format_size(others)})"
    if limit is not None and limit < total:
        available = min(available, limit)
        value += f", container limit {format_size(limit)}"
    if available < 10**9:
        return Check("memory", value, "warn", "less than 1 GB is free: close programs that hold memory, since even a "
                     "small model's working set would swap or be killed")
    return Check("memory", value + f"; --max-memory {format_size(0.8 * available).replace(' ', '')} leaves room "
                 "for the rest", "ok")


def _zram_only() -> bool:
    """Whether every swap area in /proc/swaps is zram (swap compressed into memory, not a disk)."""
    try:
        devices = [line.split()[0] for line in _read("/proc/swaps").splitlines()[1:] if line.strip()]
    except OSError:
        return False
    return bool(devices) and all("zram" in d for d in devices)


def check_swap(meminfo: Mapping[str, int] | None = None) -> Check:
    """Swap size and use: a machine already swapping will swap out the model's resident weights too."""
    m = parse_meminfo(_read("/proc/meminfo")) if meminfo is None else meminfo
    total, used = m.get("SwapTotal", 0), m.get("SwapTotal", 0) - m.get("SwapFree", 0)
    if total == 0:
        return Check("swap", "none (past available memory a process is killed, not slowed)", "ok")
    value = f"{format_size(used)} of {format_size(total)} used" + (" (zram: compressed in memory)" if _zram_only()
                                                                   else "")
    if used > 10**9 and used > total / 2:
        return Check("swap", value, "warn", "the system is swapping already: close programs or pass a smaller "
                     "--max-memory, or decode stalls on swapped-out weights")
    return Check("swap", value, "ok")


def check_swappiness(text: str | None = None, zram_only: bool | None = None) -> Check:
    """vm.swappiness: high values let the kernel swap out resident weights to keep file cache."""
    value = int((_read("/proc/sys/vm/swappiness") if text is None else text).strip())
    zram_only = _zram_only() if zram_only is None else zram_only
    if value <= 60 or zram_only:   # zram swaps into compressed memory: high values are its intended setting
        return Check("vm.swappiness", str(value), "ok")
    return Check("vm.swappiness", f"{value} (above the default 60: the kernel swaps memory out readily)", "warn",
                 "`sudo sysctl vm.swappiness=10`, and add `vm.swappiness=10` to /etc/sysctl.d/99-colibri.conf to "
                 "keep it: resident weights then stay in memory while streamed reads make file cache")


# ---- the models folder's disk ----------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """One line of /proc/mounts."""

    device: str
    point: str
    fstype: str


def parse_mounts(text: str) -> list[Mount]:
    """/proc/mounts lines (the kernel's octal escapes, such as \\040 for a space, undone)."""
    def unescape(s: str) -> str:
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)

    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append(Mount(unescape(parts[0]), unescape(parts[1]), parts[2]))
    return out


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount holding `path`: the last-mounted of the longest mount points that contain it."""
    real = os.path.realpath(path)
    best = None
    for m in mounts:
        inside = real == m.point or real.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


@dataclass(frozen=True)
class DiskInfo:
    """Where the models folder lies."""

    folder: Path
    fstype: str | None
    disk: str | None          # the whole disk's name in /sys/block (vda, nvme0n1, dm-0)
    rotational: bool | None   # None: cannot tell
    free: int


def _sys_disk(dev: int) -> Path | None:
    """/sys/block's folder of the disk holding device number `dev` (a partition's parent disk)."""
    link = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not link.exists():
        return None
    real = link.resolve()
    return real.parent if (real / "partition").exists() else real


def disk_info(folder: Path) -> DiskInfo:
    """File system, disk, rotational flag and free space of the folder."""
    try:
        mount = mount_of(folder, parse_mounts(_read("/proc/mounts")))
    except OSError:
        mount = None
    dev = None
    if mount is not None and mount.device.startswith("/dev/"):
        try:
            st = os.stat(mount.device)
            dev = st.st_rdev if stat.S_ISBLK(st.st_mode) else None
        except OSError:
            pass
    if dev is None:   # btrfs and overlays give anonymous st_dev numbers: then no disk is found
        dev = os.stat(folder).st_dev
    disk = _sys_disk(dev)
    rotational = None
    if disk is not None:
        try:
            rotational = _read(str(disk / "queue" / "rotational")).strip() == "1"
        except OSError:
            pass
    return DiskInfo(folder, mount.fstype if mount else None, disk.name if disk else None, rotational,
                    shutil.disk_usage(folder).free)


def _describe_disk(d: DiskInfo) -> str:
    kind = {True: "rotational", False: "non-rotational", None: "rotational: unknown"}[d.rotational]
    return f"{d.fstype or 'unknown file system'} on {d.disk or 'an unknown disk'} ({kind})"


def check_models_folder(folder: Path) -> Check:
    """The models folder's file system and free space."""
    d = disk_info(folder)
    value = f"{folder}: {_describe_disk(d)}, {format_size(d.free)} free"
    move = "point COLIBRI_MODELS_DIR at a folder on a local SSD"
    if d.free < 10**9:
        return Check("models folder", value, "fail", f"less than 1 GB free: no model can be pulled or converted; "
                     f"free space or {move}")
    if d.fstype in _NETWORK_FS:
        return Check("models folder", value, "warn", f"{d.fstype} is a network file system: streamed experts "
                     f"arrive at network speed; {move}")
    if d.fstype in _MEMORY_FS:
        return Check("models folder", value, "warn", f"{d.fstype} keeps files in memory: models there take the "
                     f"memory streaming is meant to save, and vanish at reboot; {move}")
    if d.free < LOW_FREE_BYTES:
        return Check("models folder", value, "warn", f"under {format_size(LOW_FREE_BYTES)} free: a converted model "
                     f"may not fit; free space or {move}")
    return Check("models folder", value, "ok")


@contextmanager
def scratch_file(folder: Path, nbytes: int) -> Iterator[Path]:
    """A file of `nbytes` random bytes in `folder`, flushed to the disk, removed afterwards.

    Random bytes, so that a compressing file system (btrfs, zfs) cannot make the read look fast.
    """
    fd, name = tempfile.mkstemp(dir=folder, prefix=".colibri-probe-")
    try:
        with os.fdopen(fd, "wb") as f:
            chunk = os.urandom(min(nbytes, 4 << 20))
            left = nbytes
            while left > 0:
                left -= f.write(chunk[:left])
            f.flush()
            os.fsync(f.fileno())
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def measure_disk_read(folder: Path, nbytes: int = PROBE_BYTES) -> float:
    """Cold read speed (GB/s) of a scratch file in `folder`, read as expert streaming reads (O_DIRECT where allowed)."""
    from engine.offload.io import measure_read_bandwidth

    with scratch_file(folder, nbytes) as path:
        return measure_read_bandwidth(str(path), nbytes) / 1e9


def direct_io_works(folder: Path) -> bool:
    """Whether files in `folder` can be read with O_DIRECT (around the page cache)."""
    from engine.offload.io import PAGE, DirectIOUnavailable, IOPool, aligned_empty

    with scratch_file(folder, PAGE) as path:
        try:
            with IOPool(1, direct=True) as pool:
                pool.read(str(path), 0, PAGE, aligned_empty(PAGE))
        except DirectIOUnavailable:
            return False
    return True


def check_disk_read(folder: Path) -> Check:
    """A short measured cold read in the models folder, judged with the disk's rotational flag."""
    d = disk_info(folder)
    if d.free < 4 * PROBE_BYTES:
        return Check("disk read", f"not measured: only {format_size(d.free)} free", "warn",
                     "free space in the models folder, then run `colibri doctor` again")
    gbs = measure_disk_read(folder)
    value = f"{gbs:.2f} GB/s cold ({format_size(PROBE_BYTES)} read as experts stream)"
    if gbs < SLOW_DISK_GBS:
        what = "a spinning disk" if d.rotational else "a slow disk"
        return Check("disk read", value, "warn", f"{what}: models larger than --max-memory will decode at disk speed; "
                     "keep them on an SSD (set COLIBRI_MODELS_DIR), or give a --max-memory that holds them")
    if d.rotational:
        value += "; the disk calls itself rotational but reads like an SSD (virtual disks often do)"
    return Check("disk read", value, "ok")


def check_direct_io(folder: Path) -> Check:
    """Whether O_DIRECT works in the models folder."""
    if direct_io_works(folder):
        return Check("O_DIRECT", "works: streamed experts bypass the page cache", "ok")
    fstype = disk_info(folder).fstype or "this file system"
    return Check("O_DIRECT", f"refused by {fstype}", "warn",
                 "streamed experts are read through the page cache and then dropped, slower and with a second "
                 "copy in memory meanwhile; keep models on ext4, xfs or btrfs (set COLIBRI_MODELS_DIR)")


# ---- CPU and numba ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says about the first CPU."""

    model: str
    flags: frozenset[str]


def parse_cpuinfo(text: str) -> CpuInfo:
    """The model name and feature flags of the first processor (x86 "flags", ARM "Features")."""
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and flags is None:
            flags = frozenset(value.split())
    return CpuInfo(model or platform.processor() or platform.machine(), flags or frozenset())


def cpu_features(flags: frozenset[str]) -> dict[str, bool]:
    """The vector units the kernels care about: AVX2 (with FMA), AVX-512 and AMX."""
    return {"AVX2": {"avx2", "fma"} <= flags, "AVX-512": "avx512f" in flags, "AMX": "amx_tile" in flags}


def check_cpu(info: CpuInfo | None = None, cpu_name: str | None = None) -> Check:
    """CPU model, usable cores and vector features; whether numba compiles for this CPU."""
    info = parse_cpuinfo(_read("/proc/cpuinfo")) if info is None else info
    if cpu_name is None:
        from numba.core import config

        cpu_name = config.CPU_NAME or "host"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # every x86-64 CPU lists sse2, no ARM CPU does; without flags, ask Python what this machine is
    x86 = "sse2" in info.flags if info.flags else platform.machine().lower() in ("x86_64", "amd64")
    value = f"{info.model}, {cores} cores"
    if x86:
        feats = cpu_features(info.flags)
        value += "; " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in feats.items())
    if cpu_name != "host":
        return Check("CPU", value + f"; numba compiles for {cpu_name!r}", "warn",
                     "unset NUMBA_CPU_NAME so that the kernels are compiled for this CPU's vector units")
    if x86 and not cpu_features(info.flags)["AVX2"]:
        return Check("CPU", value, "warn", "without AVX2 and FMA the kernels run on 128-bit vectors, several times "
                     "slower; nothing to set: most x86 CPUs since 2013 have them")
    return Check("CPU", value, "ok")


def check_numba() -> Check:
    """The threading layer numba was asked for and the one it really started, after one parallel run."""
    import numba
    import numpy as np

    asked = numba.config.THREADING_LAYER
    try:
        from app.bench.decode import reduction_kernel  # any parallel kernel starts the threading layer

        reduction_kernel()(np.ones(1024, np.float32))
    except Exception as exc:   # e.g. NUMBA_THREADING_LAYER names a layer that cannot load
        return Check("numba threads", f"asked for {asked!r}; a parallel kernel failed: {exc}".splitlines()[0], "fail",
                     "unset NUMBA_THREADING_LAYER, or install what it needs (OpenMP: `apt install libgomp1`; "
                     "TBB: `pip install tbb`)")
    layer = numba.threading_layer()
    value = f"{layer} (asked for {asked!r}), {numba.get_num_threads()} threads, numba {numba.__version__}"
    if layer == "workqueue":
        cure = ("unset NUMBA_THREADING_LAYER" if asked == "workqueue" else
                "install an OpenMP runtime (`apt install libgomp1`) or `pip install tbb`")
        return Check("numba threads", value, "warn", f"workqueue is numba's fallback and cannot run parallel kernels "
                     f"from two threads at once; {cure}")
    return Check("numba threads", value, "ok")


# ---- the desktop app ---------------------------------------------------------------------------

# Run in a subprocess: loading Qt's platform plugin or a GL driver can abort or hang the process.
_GUI_PROBE = r"""
import json, sys
out = {}
try:
    import PySide6
    from PySide6.QtGui import QGuiApplication, QOffscreenSurface, QOpenGLContext
    out["pyside"] = PySide6.__version__
    app = QGuiApplication(sys.argv[:1])
    out["platform"] = QGuiApplication.platformName()
    if sys.argv[1:] == ["gl"]:
        context = QOpenGLContext()
        out["context"] = bool(context.create())
        surface = QOffscreenSurface()
        surface.create()
        if out["context"] and context.makeCurrent(surface):
            f = context.functions()
            out["renderer"] = str(f.glGetString(0x1F01))  # GL_RENDERER
            out["version"] = str(f.glGetString(0x1F02))   # GL_VERSION
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
print(json.dumps(out), flush=True)
"""


def gui_probe(env: Mapping[str, str], timeout: float = GUI_PROBE_SECONDS) -> dict:
    """What a fresh process sees of Qt and OpenGL; {"crash": ...} or {"timeout": ...} when it dies or hangs.

    Without a display Qt runs offscreen (no OpenGL context is tried), which still shows whether
    PySide6 and its libraries load.
    """
    from app.config.runtime import display_problem

    env = dict(env)
    gl = display_problem(env) is None and not env.get("QT_QPA_PLATFORM", "").startswith(("offscreen", "minimal"))
    if not gl:
        env["QT_QPA_PLATFORM"] = env.get("QT_QPA_PLATFORM") or "offscreen"
    try:
        done = subprocess.run([sys.executable, "-c", _GUI_PROBE] + (["gl"] if gl else []), env=env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout, "gl": gl}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) | {"gl": gl}
    except (IndexError, json.JSONDecodeError):
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return {"crash": f"exit {done.returncode}" + (f": {last}" if last else ""), "gl": gl}


def check_display(env: Mapping[str, str] | None = None) -> Check:
    """Whether a window can open: DISPLAY, WAYLAND_DISPLAY or QT_QPA_PLATFORM."""
    from app.config.runtime import display_problem

    env = os.environ if env is None else env
    problem = display_problem(dict(env))
    if problem is not None:
        return Check("display", "none (DISPLAY and WAYLAND_DISPLAY unset)", "warn",
                     "`colibri gui` needs a desktop session (or `ssh -X`, or `xvfb-run colibri gui`); "
                     "in a terminal, use `colibri chat`")
    platform_ = env.get("QT_QPA_PLATFORM", "")
    if platform_.startswith(("offscreen", "minimal")):
        return Check("display", f"QT_QPA_PLATFORM={platform_}: windows are drawn but never shown", "warn",
                     "unset QT_QPA_PLATFORM to see `colibri gui`, or use `colibri chat` in the terminal")
    shown = [f"{k}={env[k]}" for k in ("WAYLAND_DISPLAY", "DISPLAY", "QT_QPA_PLATFORM") if env.get(k)]
    return Check("display", ", ".join(shown) or "native", "ok")


def check_qt(probe: Mapping) -> Check:
    """Whether PySide6 imports and a Qt application starts on this display."""
    if "timeout" in probe:
        return Check("Qt", f"starting Qt hung for {probe['timeout']:.0f} s", "warn",
                     "a broken display or GL driver; try `LIBGL_ALWAYS_SOFTWARE=1 colibri gui`")
    if "crash" in probe:
        return Check("Qt", f"starting Qt killed the process ({probe['crash']})", "warn",
                     "`QT_DEBUG_PLUGINS=1 colibri gui` names the library Qt misses (Debian: libxcb-cursor0, "
                     "libxkbcommon-x11-0, libegl1 ...); meanwhile use `colibri chat`")
    if "pyside" not in probe:
        return Check("Qt", f"PySide6 does not import ({probe.get('error', 'unknown error')})", "warn",
                     "`pip install 'PySide6-Essentials>=6.9,<6.12'` (or reinstall colibri); meanwhile use "
                     "`colibri chat`")
    if "error" in probe:
        return Check("Qt", f"PySide6 {probe['pyside']} imports, but: {probe['error']}", "warn",
                     "`QT_DEBUG_PLUGINS=1 colibri gui` says what Qt misses")
    return Check("Qt", f"PySide6 {probe['pyside']}, platform {probe.get('platform', '?')}", "ok")


def check_opengl(probe: Mapping) -> Check:
    """An OpenGL context in a fresh process (needs a display), else whether libGL/libEGL can be found."""
    install = "install Mesa's OpenGL (Debian: `apt install libgl1 libegl1 libgl1-mesa-dri`)"
    if probe.get("gl") and "context" in probe:
        if not probe["context"]:
            return Check("OpenGL", "no context could be created", "warn",
                         f"{install}, or your GPU's driver; the app's 3-D expert view needs it")
        renderer = probe.get("renderer", "?")
        software = any(s in renderer.lower() for s in _SOFTWARE_GL)
        return Check("OpenGL", f"{probe.get('version', '?')}, {renderer}" + (" (software, on the CPU)" if software
                                                                              else ""), "ok")
    libs = {name: ctypes.util.find_library(name) for name in ("GL", "EGL")}
    found = ", ".join(f"lib{n} {'found' if p else 'missing'}" for n, p in libs.items())
    if not all(libs.values()):
        return Check("OpenGL", found, "warn", f"{install}; the app's 3-D expert view needs it")
    return Check("OpenGL", f"{found}; no context tried" + ("" if probe.get("gl") else " without a display"), "ok")


# ---- running them -------------------------------------------------------------------------------


CHECK_NAMES = ("memory", "swap", "vm.swappiness", "models folder", "disk read", "O_DIRECT", "CPU", "numba threads",
               "display", "Qt", "OpenGL")


def _steps(folder: Callable[[], Path], env: Mapping[str, str]) -> list[tuple[str, Callable[[], Check]]]:
    probe = functools.cache(lambda: gui_probe(env))   # one subprocess serves both Qt and OpenGL
    return [
        ("memory", check_memory),
        ("swap", check_swap),
        ("vm.swappiness", check_swappiness),
        ("models folder", lambda: check_models_folder(folder())),
        ("disk read", lambda: check_disk_read(folder())),
        ("O_DIRECT", lambda: check_direct_io(folder())),
        ("CPU", check_cpu),
        ("numba threads", check_numba),
        ("display", lambda: check_display(env)),
        ("Qt", lambda: check_qt(probe())),
        ("OpenGL", lambda: check_opengl(probe())),
    ]


def _guarded(name: str, fn: Callable[[], Check]) -> Check:
    """fn() under the check's name; an error it raises becomes a warn line naming it."""
    try:
        return dataclasses.replace(fn(), name=name)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return Check(name, f"could not check ({text})", "warn",
                     "report this with the output of `colibri doctor --json`")


def iter_checks(models: Path | None = None, env: Mapping[str, str] | None = None) -> Iterator[Check]:
    """Each check's result as soon as it is known (models: the folder to test, default the models folder)."""
    from app.config.paths import models_dir

    folder = functools.cache(lambda: Path(models) if models is not None else models_dir())
    for name, fn in _steps(folder, os.environ if env is None else env):
        yield _guarded(name, fn)


def run_checks(models: Path | None = None, env: Mapping[str, str] | None = None) -> list[Check]:
    """Every check, in CHECK_NAMES order."""
    return list(iter_checks(models, env))


_MARKS = {"ok": "  ok  ", "warn": " WARN ", "fail": " FAIL "}


def format_check(c: Check) -> str:
    """One aligned line (and an indented fix line when there is a fix)."""
    width = max(len(n) for n in CHECK_NAMES)
    head = f"[{_MARKS[c.verdict]}] {c.name:<{width}}  "
    return head + c.value + (f"\n{'':{len(head)}}fix: {c.fix}" if c.fix else "")


def exit_code(checks: list[Check]) -> int:
    """1 when any check failed, else 0 (warnings do not fail)."""
    return 1 if any(c.verdict == "fail" for c in checks) else 0
