"""Process-wide settings the front ends (CLI, GUI, server) make once, before the engine's first kernel runs."""

from __future__ import annotations

import os


def prepare_process() -> None:
    """Let idle OpenMP threads sleep at once instead of spinning (unless the user chose otherwise).

    numba's parallel kernels run on OpenMP threads, which by default spin between parallel regions.
    When anything else wants a core (another program, Colibri's own reader threads or its window),
    the spinning threads and the preempted one stall every region: measured on 2 cores with one
    busy, mixtral-1.7b decode fell to 1.5 tok/s with spinning and ran at 31 tok/s with passive
    waiting. It must be set before the OpenMP runtime starts, hence here and not in the engine.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
