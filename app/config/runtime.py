"""Process-wide settings the front ends (CLI, GUI, server) make once, before the engine's first kernel runs,
and whether this process can open a window at all."""

from __future__ import annotations

import os
import sys


def prepare_process() -> None:
    """Let idle OpenMP threads sleep at once instead of spinning (unless the user chose otherwise).

    numba's parallel kernels run on OpenMP threads, which by default spin between parallel regions.
    When anything else wants a core (another program, Colibri's own reader threads or its window),
    the spinning threads and the preempted one stall every region, on a small machine by an order of
    magnitude. It must be set before the OpenMP runtime starts, hence here and not in the engine.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def display_problem(env: dict[str, str] | None = None, platform: str | None = None) -> str | None:
    """Why no window can open here, or None when one can."""
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux") or env.get("QT_QPA_PLATFORM"):
        return None
    if env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"):
        return None
    return ("no display: neither DISPLAY nor WAYLAND_DISPLAY is set, so no window can open; chat in the terminal "
            "with `colibri chat`, or run the app under a virtual display: `xvfb-run colibri gui`")


def colibri_command(*args: str) -> list[str]:
    """The argv that runs `colibri ARGS` as a child process of this one: the packaged app's own program with --cli
    when frozen (PyInstaller), else this interpreter on app.cli."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "--cli", *args]
    return [sys.executable, "-m", "app.cli", *args]
