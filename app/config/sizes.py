"""Byte sizes as users write them: 9GB, 512MB, 1.5G, 800M; a bare number means gigabytes."""

from __future__ import annotations

import re

from engine.errors import ColibriError
from engine.offload.budget import format_bytes as format_size  # noqa: F401 - one formatting rule for engine and app

_UNITS = {"": 10**9, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """'9GB' -> 9_000_000_000 bytes; a bare number is gigabytes."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ColibriError(f"{what} {text!r}: write a size such as 9GB, 512MB or 1.5 (gigabytes)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ColibriError(f"{what} {text!r}: must be more than zero")
    return value
