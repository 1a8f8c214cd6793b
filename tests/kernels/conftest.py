"""Fixtures of the kernel tests."""

from __future__ import annotations

import numba
import pytest


@pytest.fixture
def threads():
    """Set numba's thread count inside a test; restored afterwards."""
    before = numba.get_num_threads()
    yield numba.set_num_threads
    numba.set_num_threads(before)
