"""What the inspector tells of experts (pytest-qt, offscreen): selection between the Brain and the Atlas, a
clicked cell's story, the replay of recorded tokens, and two answers' routing drawn as a difference.

Expert counters come from `engine.offload.story.ExpertLog`; snapshots and atlases from `support.inspector`.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import numpy as np
from PySide6.QtCore import QPointF, Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QToolButton

from engine.offload.story import ExpertLog
from support.inspector import (
    Generation,
    cell_point,
    no_leftovers,  # noqa: F401 - an autouse fixture
    redraw,
    tiny_atlas,
)
from ui.inspector import TIER_CACHED, TIER_DISK, TIER_PINNED
from ui.inspector.brain import BrainView
from ui.inspector.common import fmt_percent


def test_selecting_in_the_brain_highlights_in_the_atlas_and_back(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(2)
    inspector.set_model_info(4, 8, None)
    inspector.set_atlas(tiny_atlas(4, 8, 3))
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    with qtbot.waitSignal(inspector.expertSelected, timeout=3000) as blocker:
        QTest.mouseClick(inspector.brain.view.viewport(), Qt.MouseButton.LeftButton, pos=cell_point(inspector.brain, 2, 6))
    assert blocker.args == [2, 6]
    assert inspector.brain.selected_cell == (2, 6) and inspector.brain.outline.isVisible()
    assert inspector.atlas.selected_key == (2, 6)
    assert "selected: layer 2, expert 6" in inspector.atlas.legend.info.text()

    # the Atlas's own pick ends in its `selected` signal (a real click is checked under Xvfb)
    with qtbot.waitSignal(inspector.expertSelected, timeout=3000) as blocker:
        inspector.atlas.selected.emit(1, 3)
    assert blocker.args == [1, 3]
    assert inspector.brain.selected_cell == (1, 3)
    assert inspector.brain.outline.rect().topLeft() == QPointF(3, 1)


def test_clicking_a_cell_tells_that_experts_story(qtbot, inspector):
    log = ExpertLog(4, 8, 2)                           # counters as a store keeps them
    log.steps[:] = 40
    log.hits[2, 6], log.misses[2, 6], log.reads[2, 6] = 7, 3, 4
    log.ahead_used[2, 6], log.ahead_wasted[2, 6] = 2, 1
    log.hits[1, 3], log.misses[1, 3] = 20, 0
    for token, tier in ((0, TIER_CACHED), (5, TIER_DISK), (9, TIER_CACHED), (12, TIER_PINNED)):
        log.tokens = token
        log.tier((2, 6), tier)
    tiers = np.full((4, 8), TIER_DISK, np.int8)
    tiers[2, 6], tiers[1, 3] = TIER_PINNED, TIER_CACHED
    inspector.set_model_info(4, 8, None)
    inspector.set_tiers(tiers)
    inspector.set_atlas(tiny_atlas(4, 8, 3))
    inspector.set_expert_counts(log.frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    story = inspector.brain.story
    assert not story.isVisible()

    QTest.mouseClick(inspector.brain.view.viewport(), Qt.MouseButton.LeftButton, pos=cell_point(inspector.brain, 2, 6))
    qtbot.waitUntil(story.isVisible, timeout=3000)
    text = story.body.text()
    assert story.title.text() == "layer 2, expert 6"
    assert "tier now: pinned" in text and "chosen by 10 of the layer's 40 steps (25.0%)" in text
    assert "served from memory 7, waited for disk 3" in text and "reads from disk: 4" in text
    assert "read ahead: 2 used, 1 wasted" in text
    assert "tier changes at token: 0: cached, 5: disk, 9: cached, 12: pinned" in text
    assert "atlas topic: Topic 0" in text                # expert 6 prefers topic 6 % 3
    entry = next(x for layer in tiny_atlas(4, 8, 3)["layers"] if layer["layer"] == 2 for x in layer["experts"]
                 if x["expert"] == 6)
    shares = sorted(((p, t) for t, p in enumerate(entry["topic_distribution"])), key=lambda pt: (-pt[0], pt[1]))
    assert shares[0][1] == 0 and shares[0][0] > shares[1][0] > 0
    assert "topic affinities: " + ", ".join(f"Topic {t} {fmt_percent(float(np.float32(p)))}" for p, t in shares) in text

    QTest.mouseClick(inspector.brain.view.viewport(), Qt.MouseButton.LeftButton, pos=cell_point(inspector.brain, 1, 3))
    qtbot.waitUntil(lambda: story.title.text() == "layer 1, expert 3", timeout=3000)
    assert "chosen by 20 of the layer's 40 steps (50.0%)" in story.body.text()
    assert "tier now: cached" in story.body.text() and "tier changes: none kept" in story.body.text()

    log.hits[1, 3] = 30                                  # newer counters follow at the next tick
    inspector.set_expert_counts(log.frozen())
    qtbot.waitUntil(lambda: "chosen by 30 of" in story.body.text(), timeout=3000)
    story.findChild(QToolButton).click()                 # dismissed: no expert selected
    assert not story.isVisible() and inspector.brain.selected_cell is None


def _replay_log() -> ExpertLog:
    """Three decoded tokens over 4 layers of 8 experts, top-2; token t routes to t + layer and 7 - layer, the latter
    read from disk in the odd layers."""
    log = ExpertLog(4, 8, 2)
    for token in (10, 11, 12):
        for layer in range(4):
            ids = [(token + layer) % 8, 7 - layer]
            log.routes.begin(token, layer, ids, {(layer, 7 - layer)} if layer % 2 else set())
    return log


def _flashed(brain: BrainView, colour: tuple[int, int, int]) -> set[tuple[int, int]]:
    hit = np.all(brain.rgba[..., :3] == np.array(colour, np.uint8), axis=-1)
    return {(int(a), int(b)) for a, b in zip(*np.nonzero(hit))}


def test_the_replay_steps_token_by_token_and_marks_disk_reads(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(2)
    inspector.set_model_info(4, 8, None)
    inspector.set_snapshot(gen.tel.snapshot())
    inspector.set_expert_counts(_replay_log().frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    brain, bar = inspector.brain, inspector.brain.replay
    theme = brain.theme
    live = {(layer, e) for layer, ids in gen.current() for e in ids}
    assert bar.live.isChecked() and not bar.active and _flashed(brain, theme.flash) == live

    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.live.click()                               # off live: the last recorded token, whole
    assert moved.args == [12, 4] and bar.active
    chosen = {(layer, (12 + layer) % 8) for layer in range(4)} | {(0, 7), (2, 5)}
    reads = {(1, 6), (3, 4)}
    assert _flashed(brain, theme.flash) == chosen and _flashed(brain, theme.phases["io_wait"]) == reads
    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.back.click()
    assert moved.args == [11, 4]
    assert _flashed(brain, theme.flash) == {(layer, (11 + layer) % 8) for layer in range(4)} | {(0, 7), (2, 5)}
    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.slider.setValue(0)
    assert moved.args == [10, 4] and "token 10 (1 of 3)" in bar.label.text()
    with qtbot.waitSignal(bar.moved, timeout=3000) as moved:
        bar.live.click()                               # back to live: the current token again
    assert not bar.active and _flashed(brain, theme.flash) == live


def test_playing_sweeps_each_token_down_the_layers_at_the_speed_set(qtbot, inspector):
    inspector.set_model_info(4, 8, None)
    inspector.set_expert_counts(_replay_log().frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    bar, brain = inspector.brain.replay, inspector.brain
    bar.speed.setValue(200)
    assert bar._timer.interval() == 5
    seen: list[tuple[int, int]] = []
    bar.moved.connect(lambda token, swept: seen.append((token, swept)))
    bar.live.click()
    bar.seek(1)
    seen.clear()
    bar.play.click()                                   # from token 11, its sweep starting over
    qtbot.waitUntil(lambda: not bar.play.isChecked(), timeout=5000)   # the last token swept: it pauses
    assert seen == [(11, 0), (11, 1), (11, 2), (11, 3), (11, 4), (12, 1), (12, 2), (12, 3), (12, 4)]
    assert not bar._timer.isActive() and bar.play.text() == "▶"
    bar.seek(0)
    bar.moved.connect(lambda token, swept: bar.play.click() if (token, swept) == (10, 2) else None)
    bar.play.click()
    qtbot.waitUntil(lambda: not bar.play.isChecked(), timeout=5000)   # paused mid-sweep: two layers of token 10
    assert not bar._timer.isActive() and (bar.index, bar.swept) == (0, 2)
    assert _flashed(brain, brain.theme.flash) == {(0, 2), (0, 7), (1, 3)}
    assert _flashed(brain, brain.theme.phases["io_wait"]) == {(1, 6)}


def test_two_answers_routing_is_drawn_as_a_difference(qtbot, inspector):
    log = ExpertLog(4, 8, 2)
    for token in (3, 4):                               # answer 1: experts 0 and 5 in every layer
        for layer in range(4):
            log.routes.begin(token, layer, [0, 5])
    for token in (30, 31):                             # answer 2, after a prompt: 1 and 5, and 2 once in layer 0
        for layer in range(4):
            log.routes.begin(token, layer, [1 if token == 30 or layer else 2, 5])
    inspector.set_model_info(4, 8, None)
    inspector.set_expert_counts(log.frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    brain, bar = inspector.brain, inspector.brain.compare
    assert [bar.first.itemText(i) for i in range(bar.first.count())] == ["answer 1: tokens 3-4", "answer 2: tokens 30-31"]
    assert (bar.first.currentIndex(), bar.second.currentIndex()) == (0, 1) and not bar.active
    with qtbot.waitSignal(bar.changed, timeout=3000):
        bar.on.click()
    theme = brain.theme
    a, b = theme.phases["attention"], theme.phases["sampling"]
    assert _flashed(brain, a) == {(layer, 0) for layer in range(4)}          # only answer 1 chose them
    assert _flashed(brain, b) == {(layer, 1) for layer in range(1, 4)}       # answer 2, every token
    assert tuple(brain.rgba[0, 1, :3]) != tuple(b) and tuple(brain.rgba[0, 2, :3]) != tuple(b)   # half its tokens
    assert not {(layer, 5) for layer in range(4)} & (_flashed(brain, a) | _flashed(brain, b))   # both, as often
    assert "4 experts chosen more in A, 5 in B, 4 as often" in bar.summary.text()
    # the summary keeps to the bar's width: it elides, the whole of it in its tooltip
    bar.summary.setText(bar.summary.text() * 6)
    assert bar.minimumSizeHint().width() < bar.summary.fontMetrics().horizontalAdvance(bar.summary.text())
    assert bar.summary.toolTip() == bar.summary.text()
    with qtbot.waitSignal(bar.changed, timeout=3000):
        bar.second.setCurrentIndex(0)                  # an answer against itself: no difference
    assert not _flashed(brain, a) and not _flashed(brain, b)
    bar.on.click()
    assert not bar.active and bar.summary.text() == ""
