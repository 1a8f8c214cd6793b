"""The Brain's colour maps and filters (pytest-qt, offscreen): each map colours a small frame as its key says, the
filters dim exactly the experts they leave out, the key follows the map, and the choice outlives the Inspector.

Counters come from an `engine.offload.story.ExpertLog` filled by hand, atlases from `app.atlas.build.build_atlas`
(`support.inspector.tiny_atlas`), snapshots from a real `Telemetry` on a fake clock.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import numpy as np
import pytest
from PySide6.QtCore import QSettings
from PySide6.QtGui import QColor, QPalette
from PySide6.QtTest import QTest

from engine.offload.story import ExpertLog
from support.inspector import (
    GB,
    Generation,
    cell_point,
    no_leftovers,  # noqa: F401 - an autouse fixture
    redraw,
    tiny_atlas,
)
from ui.inspector import TIER_CACHED, TIER_DISK, TIER_NONE, TIER_PINNED, TIER_RESIDENT, Inspector
from ui.inspector.brain import grid_rgba
from ui.inspector.brain_legend import KEY_MAP, KEY_TIERS, KEY_TOPIC, TIERS, BrainLegend
from ui.inspector.colours import (
    AHEAD,
    DIMMED,
    MAP_AHEAD,
    MAP_RECENCY,
    MAP_TIERS,
    MAP_TOPIC,
    RECENCY,
    ramp_colour,
    topic_grid,
)
from ui.inspector.common import theme_for, tier_name
from ui.inspector.data import AtlasData

LIGHT, DARK = theme_for(QPalette(QColor(250, 250, 250))), theme_for(QPalette(QColor(30, 30, 30)))


def _luma(px: np.ndarray) -> float:
    return float(px[:3].astype(float) @ np.array([0.299, 0.587, 0.114]))


def _hue(px: np.ndarray) -> float:
    return QColor(*(int(c) for c in px[:3])).hsvHueF()


def _counts():
    """Layer 0 of 4 experts after 10 tokens: expert 0 chosen by the last token, 1 at token 2, 2 never, 3 at token 8;
    expert 0's reads ahead all used, 1's all wasted, 2 none, 3 one of each."""
    log = ExpertLog(1, 4, 2)
    for token, ids in ((2, [0, 1]), (8, [3, 0]), (9, [0])):
        log.tokens = token
        log.chose(0, ids)
    log.tokens = 10
    log.ahead_used[0] = [3, 0, 0, 1]
    log.ahead_wasted[0] = [0, 2, 0, 1]
    return log.frozen()


@pytest.mark.parametrize("theme", [LIGHT, DARK], ids=["light", "dark"])
def test_each_map_colours_a_small_frame(theme):
    counts, tiers = _counts(), np.full((1, 4), TIER_DISK, np.int8)
    recency = grid_rgba(theme, (1, 4), tiers, None, (), MAP_RECENCY, None, counts)[0, :, :3]
    assert tuple(recency[0]) == ramp_colour(RECENCY, 1.0)              # the latest token's: the bright end
    assert _luma(recency[0]) > _luma(recency[3]) > _luma(recency[1])    # 1 token ago, then 7
    assert tuple(recency[1]) == ramp_colour(RECENCY, 0.0)              # the longest unchosen: the dark end
    assert tuple(recency[2]) == theme.unused                          # never chosen: the grey

    ahead = grid_rgba(theme, (1, 4), tiers, None, (), MAP_AHEAD, None, counts)[0, :, :3]
    assert tuple(ahead[0]) == ramp_colour(AHEAD, 1.0) and tuple(ahead[1]) == ramp_colour(AHEAD, 0.0)
    assert tuple(ahead[3]) == ramp_colour(AHEAD, 0.5) and tuple(ahead[2]) == theme.unused
    assert np.abs(ahead[0].astype(int) - ahead[1]).sum() > 200          # the two ends are far apart

    # without counters (a model held whole) both maps are all grey
    for name in (MAP_RECENCY, MAP_AHEAD):
        assert (grid_rgba(theme, (1, 4), tiers, None, (), name)[0, :, :3] == theme.unused).all()

    # Topic: two topics, two hues; a hot expert of a topic brighter than a cold one; no topic the grey, hot or not
    topics = np.array([[0, 1, 0, -1]])
    heat = np.array([[5.0, 5.0, 0.0, 5.0]], np.float32)
    topic = grid_rgba(theme, (1, 4), tiers, heat, (), MAP_TOPIC, topics)[0, :, :3]
    assert abs(_hue(topic[0]) - _hue(topic[1])) > 0.1
    assert tuple(topic[0]) == theme.topic(0) and _luma(topic[0]) > _luma(topic[2]) + 20
    assert abs(_hue(topic[2]) - _hue(topic[0])) < 0.02                    # cold keeps the hue
    assert tuple(topic[3]) == theme.unused
    # the flash and cells without experts are as under every map
    codes = np.array([[TIER_DISK, TIER_DISK, TIER_DISK, TIER_NONE]], np.int8)
    flashed = grid_rgba(theme, (1, 4), codes, heat, ((0, (1,)),), MAP_TOPIC, topics)[0]
    assert tuple(flashed[1, :3]) == theme.flash
    assert tuple(flashed[3, :3]) == tuple(grid_rgba(theme, (1, 4), codes, heat, (), MAP_TIERS)[0, 3, :3])


@pytest.mark.parametrize("theme", [LIGHT, DARK], ids=["light", "dark"])
def test_a_cold_disk_cell_keeps_its_hue_and_the_key_shows_cells_as_drawn(qtbot, theme):
    codes = np.array([[TIER_DISK, TIER_CACHED, TIER_PINNED, TIER_RESIDENT]], np.int8)
    cold = grid_rgba(theme, (1, 4), codes, np.zeros((1, 4), np.float32), ())[0, :, :3]    # never routed
    hot = grid_rgba(theme, (1, 4), codes, np.ones((1, 4), np.float32), ())[0, :, :3]      # the hottest
    disk = cold[0].astype(int)
    # a never-routed expert on disk is neither near black (it was rgb(51, 55, 63) on the light theme) nor lost in
    # the background, and it has the hue of a hot one: a slate blue
    assert _luma(cold[0]) > 80 and np.abs(disk - theme.background).sum() > 250
    assert QColor(*disk).hsvSaturationF() > 0.2 and 0.5 < _hue(cold[0]) < 0.65
    assert abs(_hue(cold[0]) - _hue(hot[0])) < 0.02 and _luma(hot[0]) > _luma(cold[0]) + 40
    assert np.abs(disk - cold[3]).sum() > 60 and np.abs(hot[0].astype(int) - hot[3]).sum() > 100   # not resident

    # the key's swatch of each tier is a cold cell beside a hot one, exactly as the grid draws them
    legend = BrainLegend(theme)
    qtbot.addWidget(legend)
    legend.show_key((), False)
    swatches = {text: colours for colours, text in legend.entries}
    order = [TIER_DISK, TIER_CACHED, TIER_PINNED, TIER_RESIDENT]
    for code in TIERS:
        i = order.index(code)
        assert swatches[tier_name(code)] == (tuple(int(c) for c in cold[i]), tuple(int(c) for c in hot[i]))
    assert f"rgb{tuple(int(c) for c in cold[0])}" in legend.key.text()


def test_the_topic_grid_takes_each_experts_strongest_topic():
    atlas = AtlasData.from_dict(tiny_atlas(4, 8, 3))
    grid = topic_grid(atlas, (5, 9))                       # a grid wider than the atlas: -1 beyond it
    assert grid[1, :8].tolist() == [e % 3 for e in range(8)]
    assert grid[0, 1] == -1                                 # never chosen by the probes
    assert (grid[4] == -1).all() and (grid[:, 8] == -1).all()
    assert (topic_grid(None, (2, 2)) == -1).all()


def _shown(qtbot, insp: Inspector, counts=None) -> np.ndarray:
    """The Brain of a 4 x 8 model with tiers, an atlas and a decoded answer in view; its tiers."""
    gen = Generation(4, 8)
    gen.decode(6)
    tiers = np.full((4, 8), TIER_DISK, np.int8)
    tiers[:, :2] = TIER_PINNED
    tiers[:, 2:5] = TIER_CACHED
    insp.set_model_info(4, 8, 2 * GB)
    insp.set_tiers(tiers)
    insp.set_atlas(tiny_atlas(4, 8, 3))
    insp.set_expert_counts(counts)
    insp.tabs.setCurrentWidget(insp.brain)
    insp.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, insp)
    return tiers


def _dimmed(theme, before: np.ndarray) -> np.ndarray:
    bg = np.array(theme.background, np.float32)
    return (before[..., :3] * np.float32(DIMMED) + bg * np.float32(1 - DIMMED)).astype(np.uint8)


def test_filters_dim_exactly_the_experts_they_leave_out(qtbot, inspector):
    tiers = _shown(qtbot, inspector)
    brain, legend = inspector.brain, inspector.brain.legend
    whole = brain.rgba.copy()

    legend.tier_boxes[TIER_DISK].setChecked(False)             # the Brain draws again at once
    changed = (brain.rgba != whole).any(axis=-1)
    assert (changed == (tiers == TIER_DISK)).all()
    assert (brain.rgba[changed][:, :3] == _dimmed(brain.theme, whole[changed])).all()
    assert brain.rgba.shape == whole.shape                     # the geometry stays

    legend.tier_boxes[TIER_DISK].setChecked(True)
    assert (brain.rgba == whole).all()
    assert [legend.topics.itemText(i) for i in range(legend.topics.count())] == \
        ["all topics", "Topic 0", "Topic 1", "Topic 2"]
    legend.topics.setCurrentIndex(2)                           # Topic 1 alone
    assert legend.topic() == 1
    topics = topic_grid(inspector._atlas, (4, 8))
    changed = (brain.rgba != whole).any(axis=-1)
    assert (changed == (topics != 1)).all() and changed[0, 1]   # never chosen by the probes: no topic 1 either

    # both: a cell is dimmed when either filter leaves it out; hover still finds a dimmed cell
    legend.tier_boxes[TIER_PINNED].setChecked(False)
    changed = (brain.rgba != whole).any(axis=-1)
    assert (changed == ((topics != 1) | (tiers == TIER_PINNED))).all()
    QTest.mouseMove(brain.view.viewport(), cell_point(brain, 2, 0))
    qtbot.waitUntil(lambda: brain.hovered == (2, 0), timeout=3000)
    assert brain.hover_text(2, 0).startswith("layer 2, expert 0")
    # the filters dim the next frames too: the flash gone, the same cells are dimmed
    inspector.set_generating(False)
    redraw(qtbot, inspector)
    filtered = brain.rgba.copy()
    legend.tier_boxes[TIER_PINNED].setChecked(True)
    legend.topics.setCurrentIndex(0)
    plain = brain.rgba
    assert (filtered[changed][:, :3] == _dimmed(brain.theme, plain[changed])).all()
    assert (filtered[~changed] == plain[~changed]).all()


def test_the_maps_on_the_inspector_follow_counters_and_atlas_and_the_key_follows_the_map(qtbot, inspector):
    log = ExpertLog(4, 8, 2)
    for token in range(5):
        log.tokens = token
        for layer in range(4):
            log.chose(layer, [token, 7])                       # expert t chosen by token t, expert 7 by all
    log.tokens = 5
    log.ahead_used[2, 3], log.ahead_wasted[2, 4] = 4, 4
    _shown(qtbot, inspector, log.frozen())
    inspector.set_generating(False)                            # no flash over the colours
    redraw(qtbot, inspector)
    brain, legend = inspector.brain, inspector.brain.legend
    key = lambda: [text for _, text in legend.entries]       # noqa: E731
    assert key()[:4] == ["pinned", "cached", "disk", "resident"] and "brighter = routed more lately" in key()
    tiers_key = legend.key.text()

    legend.set_colour_map(MAP_RECENCY)
    image = brain.rgba[..., :3]
    assert _luma(image[1, 4]) > _luma(image[1, 2]) > _luma(image[1, 0])   # chosen at tokens 4, 2 and 0
    assert tuple(image[1, 7]) == ramp_colour(RECENCY, 1.0) and tuple(image[1, 5]) == brain.theme.unused
    assert key()[:4] == ["chosen by the latest token", "a while ago", "longest unchosen", "never chosen"]
    assert legend.key.text() != tiers_key
    assert "last chosen: 2 tokens ago" in brain.hover_text(1, 2).splitlines()
    assert "last chosen: never" in brain.hover_text(1, 5).splitlines()

    legend.set_colour_map(MAP_AHEAD)
    image = brain.rgba[..., :3]
    assert tuple(image[2, 3]) == ramp_colour(AHEAD, 1.0) and tuple(image[2, 4]) == ramp_colour(AHEAD, 0.0)
    assert (image[0] == brain.theme.unused).all()
    assert key()[:4] == ["reads ahead all used", "half used", "all wasted", "no reads ahead"]
    assert "read ahead: 4 used, 0 wasted" in brain.hover_text(2, 3)

    legend.set_colour_map(MAP_TOPIC)
    image = brain.rgba[..., :3]
    assert tuple(image[0, 1]) == brain.theme.unused                        # never chosen by the probes
    assert abs(_hue(image[1, 3]) - _hue(image[1, 4])) > 0.1                 # topics 0 and 1
    assert [colours for colours, _ in legend.entries[:3]] == [(brain.theme.topic(t),) for t in range(3)]
    assert key()[:4] == ["Topic 0", "Topic 1", "Topic 2", "no atlas topic"]
    with pytest.raises(ValueError, match="no colour map"):
        legend.set_colour_map("rainbow")

    # without counters or an atlas, the key says what is missing
    inspector.set_expert_counts(None)
    legend.set_colour_map(MAP_RECENCY)
    redraw(qtbot, inspector)
    assert key()[-3] == "no expert cache counters: its experts are not streamed" and (brain.rgba[..., :3] == brain.theme.unused).all()
    inspector.set_atlas(None)
    legend.set_colour_map(MAP_TOPIC)
    redraw(qtbot, inspector)
    assert "no atlas yet: compute one in the Atlas tab" in key() and not legend.topics.isEnabled()


def test_the_map_and_filters_outlive_the_inspector(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)

    def opened() -> Inspector:
        insp = Inspector(settings=settings)
        qtbot.addWidget(insp, before_close_func=lambda w: w.close_views())
        insp.resize(900, 600)
        insp.show()
        qtbot.waitExposed(insp)
        return insp

    first = opened()
    assert first.brain.legend.colour_map == MAP_TIERS and first.brain.legend.shown_tiers == \
        {TIER_PINNED, TIER_CACHED, TIER_DISK, 3}
    _shown(qtbot, first)
    legend = first.brain.legend
    legend.set_colour_map(MAP_RECENCY)
    legend.tier_boxes[TIER_CACHED].setChecked(False)
    legend.topics.setCurrentIndex(3)                           # Topic 2
    assert settings.value(KEY_MAP) == MAP_RECENCY and settings.value(KEY_TOPIC) == "topic2"
    first.close_views()
    first.close()

    second = opened()
    legend = second.brain.legend
    assert legend.colour_map == MAP_RECENCY and legend.shown_tiers == {TIER_PINNED, TIER_DISK, 3}
    assert legend.topic() is None and not legend.topics.isEnabled()   # no atlas yet: the topic waits for one
    _shown(qtbot, second)
    assert legend.topic() == 2 and legend.topics.currentText() == "Topic 2"
    legend.topics.setCurrentIndex(0)
    for box in legend.tier_boxes.values():
        box.setChecked(False)
    assert settings.value(KEY_TOPIC) == "" and settings.value(KEY_TIERS) == ""
    second.close_views()
    second.close()
    third = opened()
    assert third.brain.legend.shown_tiers == frozenset()          # none shown is a choice too
