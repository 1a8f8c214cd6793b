"""The upcycle's heartbeat: a long step (a cold calibration chat compiling kernels) is never silent."""

from __future__ import annotations

import threading

import pytest

from app.moefy.upcycle import MoefyCancelled, Waiting, heartbeat


def test_a_long_step_is_said_again_with_the_time_so_far_until_it_ends():
    said: list[str] = []
    beaten = threading.Event()

    def say(text: str) -> None:
        said.append(text)
        if len(said) == 3:
            beaten.set()

    with heartbeat(say, "calibration chats: chinese", every=0.01):
        assert beaten.wait(10.0), said   # the body outlasts two beats
    assert said[0] == "calibration chats: chinese"
    assert all(line.startswith("calibration chats: chinese (") and line.endswith(" s so far)") for line in said[1:3])
    # the lines after the first say that the step goes on without a measure (a front end's busy bar)
    assert not isinstance(said[0], Waiting) and all(isinstance(line, Waiting) for line in said[1:3])
    assert not [t for t in threading.enumerate() if t.name == "colibri-heartbeat"]   # silent once it ended


def test_a_cancel_raised_by_a_beat_stops_the_step_when_its_body_returns():
    raised = threading.Event()

    def say(text: str) -> None:
        if "so far" in text:
            raised.set()
            raise MoefyCancelled("cancelled")

    with pytest.raises(MoefyCancelled):
        with heartbeat(say, "routers", every=0.01):
            assert raised.wait(10.0)
