"""The inspector's Brain grid (pytest-qt, offscreen): the current token's experts flash, colours follow tiers
and heat, hover names a cell, labels sit at cell centres; and the tiers it draws, from a store or a resident model.

Snapshots come from a real `Telemetry` driven by a fake clock, atlases from `app.atlas.build.build_atlas`
(`support.inspector`).
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import numpy as np
from PySide6.QtGui import QColor, QPalette
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QToolTip

from engine.spec import MoESpec
from support.inspector import (
    GB,
    Generation,
    cell_point,
    no_leftovers,  # noqa: F401 - an autouse fixture
    redraw,
    tiny_atlas,
)
from ui.inspector import TIER_CACHED, TIER_DISK, TIER_NONE, TIER_PINNED, TIER_RESIDENT, resident_tiers, tiers_from_store
from ui.inspector.common import theme_for


def test_brain_flashes_the_current_tokens_experts_and_names_a_hovered_cell(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(6)
    tiers = np.full((4, 8), TIER_DISK, np.int8)
    tiers[:, :2] = TIER_PINNED
    tiers[:, 2:5] = TIER_CACHED
    inspector.set_model_info(4, 8, 2 * GB)
    inspector.set_tiers(tiers)
    inspector.set_atlas(tiny_atlas(4, 8, 3))
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    brain = inspector.brain
    image = brain.image.image                                  # [L, E, 4] as handed to the ImageItem
    assert image.shape == (4, 8, 4)
    flash = np.array(brain.theme.flash, np.uint8)
    routed = np.zeros((4, 8), bool)
    for layer, ids in gen.current():
        routed[layer, list(ids)] = True
    assert routed.sum() == 8
    assert (image[routed][:, :3] == flash).all()
    assert not (image[~routed][:, :3] == flash).all(axis=1).any()

    # on screen, too (not transposed): the pixel at a routed cell's centre is the flash colour
    layer, (expert, _) = gen.current()[2]
    shot = brain.view.viewport().grab().toImage()
    pixel = shot.pixelColor(cell_point(brain, layer, expert))
    assert (pixel.red(), pixel.green(), pixel.blue()) == tuple(int(c) for c in flash)

    # hover: the tooltip names layer, expert, tier, selections and the atlas topic
    QTest.mouseMove(brain.view.viewport(), cell_point(brain, 3, 1))
    qtbot.waitUntil(lambda: brain.hovered == (3, 1), timeout=3000)
    text = brain.hover_text(3, 1)
    assert text.splitlines()[0] == "layer 3, expert 1"
    assert "tier: pinned" in text
    assert "selections: " in text
    assert "atlas topic: Topic 1" in text                     # expert 1 prefers topic 1
    assert QToolTip.text() == text
    assert "atlas: never chosen by the probes" in brain.hover_text(0, 1)

    # once the answer ends, the last token's experts are history: nothing flashes
    inspector.set_generating(False)
    redraw(qtbot, inspector)
    assert not (brain.image.image[..., :3] == flash).all(axis=-1).any()
    inspector.set_generating(True)
    redraw(qtbot, inspector)
    assert (brain.image.image[routed][:, :3] == flash).all()


def test_brain_colours_follow_tiers_and_heat(qtbot):
    theme = theme_for(QPalette(QColor(250, 250, 250)))
    from ui.inspector.brain import grid_rgba

    tiers = np.array([[TIER_PINNED, TIER_CACHED, TIER_DISK, TIER_NONE]], np.int8)
    heat = np.array([[4.0, 4.0, 4.0, 0.0]], np.float32)
    rgba = grid_rgba(theme, (1, 4), tiers, heat, ())
    assert len({tuple(px) for px in rgba[0, :3]}) == 3          # three tiers, three colours
    cold = grid_rgba(theme, (1, 4), tiers, heat * np.array([[1, 0, 0, 0]], np.float32), ())

    def luma(px: np.ndarray) -> float:
        return float(px[:3].astype(float) @ np.array([0.299, 0.587, 0.114]))

    # hot is brighter than cold for every tier, on the light theme and the dark one (the legend says so)
    for t in (theme, theme_for(QPalette(QColor(30, 30, 30)))):
        hot, chill = grid_rgba(t, (1, 4), tiers, heat, ()), grid_rgba(t, (1, 4), tiers, heat * 0, ())
        for e in range(3):
            assert luma(hot[0, e]) > luma(chill[0, e]) + 40, (t.dark, e)
        hue = np.argmax(t.tiers[TIER_CACHED])                     # the tier's hue stays: green leads when cold too
        assert np.argmax(chill[0, 1, :3]) == hue and np.argmax(hot[0, 1, :3]) == hue
    assert luma(cold[0, 1]) < luma(rgba[0, 1])
    # never routed, an expert in RAM still reads apart from one on disk, on either theme
    for t in (theme, theme_for(QPalette(QColor(30, 30, 30)))):
        frozen = grid_rgba(t, (1, 4), tiers, np.zeros((1, 4), np.float32), ()).astype(int)
        assert np.abs(frozen[0, 1, :3] - frozen[0, 2, :3]).sum() > 100          # cached vs disk
        assert np.abs(frozen[0, 0, :3] - frozen[0, 2, :3]).sum() > 100          # pinned vs disk
    wider = grid_rgba(theme, (2, 6), tiers, heat, ((1, (5, 9)),))  # grids grow; ids outside are ignored
    assert tuple(wider[1, 5, :3]) == theme.flash


def test_the_current_token_is_cleared_when_the_answer_ends_and_the_model_goes(qtbot, inspector):
    gen = Generation()
    gen.decode(3)
    inspector.set_model_info(4, 8, None)
    inspector.set_generating(True)
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    flash = np.array(inspector.brain.theme.flash, np.uint8)
    flashing = lambda: int(np.all(inspector.brain.rgba[..., :3] == flash, axis=-1).sum())  # noqa: E731
    assert flashing() == 8                                # two experts in each of four layers
    inspector.set_generating(False)
    redraw(qtbot, inspector)
    assert flashing() == 0
    inspector.set_generating(True)
    redraw(qtbot, inspector)
    assert flashing() == 8
    inspector.forget_model()                              # unloaded: nothing of it stays, the current token least
    redraw(qtbot, inspector)
    assert inspector.brain.rgba is None and inspector.brain.status.text().startswith("no experts")


def test_brain_labels_whole_layers_and_experts_at_cell_centres_on_256_experts(qtbot, inspector):
    gen = Generation(4, 256)
    gen.decode(2)
    inspector.set_model_info(4, 256, None)
    inspector.tabs.setCurrentWidget(inspector.brain)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)

    brain = inspector.brain
    assert brain.rgba.shape == (4, 256, 4)
    for axis, n, most in (("left", 4, 4), ("bottom", 256, 12)):
        (ticks,) = brain.plot.getAxis(axis)._tickLevels            # what setTicks was given
        labels = [int(label) for _, label in ticks]               # whole indices, never "0.5"
        assert labels[0] == 0 and labels[-1] < n and len(labels) <= most
        assert [pos for pos, _ in ticks] == [i + 0.5 for i in labels]
    # the last expert of the last layer is a cell like any other: hover names it
    QTest.mouseMove(brain.view.viewport(), cell_point(brain, 3, 255))
    qtbot.waitUntil(lambda: brain.hovered == (3, 255), timeout=3000)
    assert brain.hover_text(3, 255).startswith("layer 3, expert 255")


class _Layer:
    def __init__(self, ffn: object):
        self.ffn = ffn


class _Spec:
    def __init__(self, layers: list[_Layer]):
        self.layers = tuple(layers)
        self.n_layers = len(layers)


def test_tiers_from_a_store_and_for_a_resident_model():
    spec = _Spec([_Layer(None), _Layer(MoESpec(4, 2, 8)), _Layer(MoESpec(4, 2, 8))])  # layer 0 dense

    class Store:
        recipes = {(layer, e): None for layer in (1, 2) for e in range(4)}
        built = {(1, 0): None, (1, 2): None, (2, 3): None}
        pinned = {(1, 0)}

    Store.spec = spec
    tiers = tiers_from_store(Store())
    assert tiers.dtype == np.int8 and tiers.shape == (3, 4)
    assert tiers.tolist() == [[TIER_NONE] * 4,
                              [TIER_PINNED, TIER_DISK, TIER_CACHED, TIER_DISK],
                              [TIER_DISK, TIER_DISK, TIER_DISK, TIER_CACHED]]
    assert resident_tiers(spec).tolist() == [[TIER_NONE] * 4, [TIER_RESIDENT] * 4, [TIER_RESIDENT] * 4]


def test_the_answer_pickers_show_whole_answers_and_no_key_entry_breaks(qtbot, inspector):
    # the walkthrough saw the A/B pickers cut to "answer 2" / "answer 3" and the key wrap "brighter =" / "routed
    # more lately", in a pane about 600 px wide
    from PySide6.QtGui import QTextDocument

    from engine.offload.story import ExpertLog

    log = ExpertLog(4, 8, 2)
    for first in (3, 300, 1030):                       # three answers, a prompt between each
        for token in (first, first + 1):
            for layer in range(4):
                log.routes.begin(token, layer, [0, 5])
    inspector.resize(600, 700)
    inspector.set_model_info(4, 8, 2 * GB)
    inspector.set_tiers(np.full((4, 8), TIER_DISK, np.int8))
    inspector.set_expert_counts(log.frozen())
    inspector.tabs.setCurrentWidget(inspector.brain)
    redraw(qtbot, inspector)
    bar, legend = inspector.brain.compare, inspector.brain.legend
    assert bar.first.count() == 3 and bar.first.itemText(2) == "answer 3: tokens 1030-1031"
    for box in (bar.first, bar.second):
        longest = max(box.fontMetrics().horizontalAdvance(box.itemText(i)) for i in range(box.count()))
        qtbot.waitUntil(lambda box=box: box.width() >= box.sizeHint().width(), timeout=3000)
        assert box.sizeHint().width() > longest

    doc = QTextDocument()
    doc.setDefaultFont(legend.key.font())
    doc.setHtml(legend.key.text())
    doc.setTextWidth(legend.key.contentsRect().width())
    text = doc.toRawText().replace("\u00a0", " ")      # positions as the document's

    def line(pos: int) -> tuple[int, int]:
        block = doc.findBlock(pos)
        return block.blockNumber(), block.layout().lineForTextPosition(pos - block.position()).lineNumber()

    assert doc.size().height() > 1.5 * legend.key.fontMetrics().lineSpacing()     # the key does wrap here
    entries = [words for _colours, words in legend.entries]
    assert "brighter = routed more lately" in entries
    for words in entries:
        start = text.index(words)
        assert line(start) == line(start + len(words) - 1), f"{words!r} breaks across lines"
