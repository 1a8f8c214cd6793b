"""The `[tuned]` table of a model's colibri.toml: the settings `colibri tune` measured fastest, and the fingerprint
of the machine, the model and the memory budget they were measured on.

    [tuned]
    prefetch_depth = 2
    io_threads = 4

    [tuned.fingerprint]
    cpu = "Intel(R) Xeon(R) ..."
    ...

The values only change speed, never output; they sit just under the model file's own keys (app.config.settings):
a key the user wrote anywhere above them wins. When the fingerprint differs from this machine's (another CPU,
core count, RAM, numba or engine version, model file, or --max-memory), the values are ignored with a one-line
notice, and `colibri tune MODEL` measures them again. Writing keeps every other line of the file as it was.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from app.config.settings import FILE_NAME, TUNED, physical_cores
from engine.errors import ColibriError

TABLE = TUNED
FINGERPRINT = "fingerprint"


@dataclass(frozen=True)
class Tuned:
    """A [tuned] table as read: its values (by option dest) and the fingerprint they were measured under."""

    values: Mapping[str, Any]
    fingerprint: Mapping[str, Any]


# ---- fingerprints ------------------------------------------------------------------------------


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Processor", "cpu model"):
                return value.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def model_stamp(path: Path) -> str:
    """Size and modification time of a model file, or of every file of a model folder (but colibri.toml and
    hidden files): a re-converted, re-downloaded or edited model gets another stamp."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        return f"{st.st_size}:{st.st_mtime_ns}"
    import hashlib

    digest = hashlib.sha256()
    total = 0
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name != FILE_NAME and not any(p.startswith(".") for p in f.relative_to(path).parts):
            st = f.stat()
            total += st.st_size
            digest.update(f"{f.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{total}:{digest.hexdigest()[:16]}"


def fingerprint(model: Path, budget: int | None) -> dict[str, Any]:
    """What tuned values depend on: this machine, the engine's and numba's versions, the model and the budget."""
    import numba

    from engine import __version__

    return {"cpu": _cpu_model(), "cores": physical_cores(), "ram": _ram_bytes(), "numba": numba.__version__,
            "engine": __version__, "model": model_stamp(model), "budget": budget if budget is not None else "none"}


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The fingerprint's fields that differ (missing ones included), in a stable order."""
    return [k for k in sorted(set(recorded) | set(current)) if recorded.get(k) != current.get(k)]


# ---- reading -----------------------------------------------------------------------------------


def from_data(path: Path, data: Mapping[str, Any]) -> Tuned | None:
    """The [tuned] table of a parsed colibri.toml, or None when it has none."""
    table = data.get(TABLE)
    if table is None:
        return None
    if not isinstance(table, dict) or not isinstance(table.get(FINGERPRINT, {}), dict):
        raise ColibriError(f"{path}: [{TABLE}] must be a table with a [{TABLE}.{FINGERPRINT}] table; remove the "
                           "section and run `colibri tune MODEL` again")
    values = {k.replace("-", "_"): v for k, v in table.items() if k != FINGERPRINT}
    bad = [k for k, v in values.items() if isinstance(v, dict)]
    if bad:
        raise ColibriError(f"{path}: [{TABLE}.{bad[0]}] is not a setting; remove it or run `colibri tune MODEL` again")
    return Tuned(values, dict(table.get(FINGERPRINT, {})))


# ---- writing -----------------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")


def _without_tuned(text: str) -> str:
    """The file's text with its [tuned] and [tuned.*] sections removed, every other line kept as it was."""
    out: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        m = _HEADER.match(line)
        if m:
            name = m.group(1).strip().strip('"')
            inside = name == TABLE or name.startswith(TABLE + ".")
        if not inside:
            out.append(line)
    return "".join(out).rstrip("\n") + ("\n" if out and "".join(out).strip() else "")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        import json

        return json.dumps(value)        # a JSON string is a TOML basic string
    raise ColibriError(f"cannot write {value!r} into colibri.toml")


def tuned_text(values: Mapping[str, Any], fp: Mapping[str, Any]) -> str:
    """The [tuned] section for `values` and fingerprint `fp`."""
    lines = [f"[{TABLE}]", "# written by `colibri tune`: settings that change speed only, measured on this machine;",
             "# ignored when the fingerprint below no longer matches. A key set above this section wins."]
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    lines += ["", f"[{TABLE}.{FINGERPRINT}]"] + [f"{k} = {_toml_value(v)}" for k, v in fp.items()]
    return "\n".join(lines) + "\n"


def write(path: Path, values: Mapping[str, Any], fp: Mapping[str, Any]) -> None:
    """Write (or replace) the [tuned] section of the colibri.toml at `path`, keeping all else; atomic."""
    from engine.atomic import atomic_file

    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    try:
        before = tomllib.loads(old)
    except tomllib.TOMLDecodeError as exc:
        raise ColibriError(f"{path}: not valid TOML ({exc}); fix the file before tuning") from None
    kept = _without_tuned(old)
    new = (kept + "\n" if kept else "") + tuned_text(values, fp)
    after = tomllib.loads(new)          # the user's keys must read back exactly as before
    before.pop(TABLE, None)
    if {k: v for k, v in after.items() if k != TABLE} != before:
        raise ColibriError(f"{path}: cannot add the [{TABLE}] section without changing other settings (is [{TABLE}] "
                           "written as dotted keys?); remove its old entries and run `colibri tune` again")
    with atomic_file(path, "w") as f:
        f.write(new)
