"""The inspector's Atlas (pytest-qt): the offer to compute it, with progress and cancel, and the current token's
experts without OpenGL (offscreen); the 3D canvas itself needs OpenGL, which the offscreen platform lacks:
`test_atlas_renders_under_xvfb` runs the `gl_*` checks below in a child pytest on the Xvfb display that
pytest-xvfb started.

Snapshots come from a real `Telemetry` driven by a fake clock; atlases from `app.atlas.build.build_atlas`
(`support.inspector`).
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt makes the QApplication

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtTest import QTest

from support.inspector import (
    Generation,
    no_leftovers,  # noqa: F401 - an autouse fixture
    redraw,
    tiny_atlas,
)
from ui.inspector import Inspector
from ui.inspector.atlas import marker_sizes
from ui.inspector.data import AtlasData

REPO = Path(__file__).resolve().parents[2]


def test_atlas_offers_to_compute_with_progress_and_cancel(qtbot, inspector):
    atlas = inspector.atlas
    inspector.tabs.setCurrentWidget(atlas)
    assert atlas.pages.currentIndex() == 0 and not atlas.compute_button.isEnabled()  # no MoE model yet
    inspector.set_model_info(4, 8, None)
    assert atlas.compute_button.isVisible() and atlas.compute_button.isEnabled()
    with qtbot.waitSignal(inspector.atlasRequested, timeout=3000):
        QTest.mouseClick(atlas.compute_button, Qt.MouseButton.LeftButton)
    inspector.set_atlas_progress(0.4)
    assert atlas.progress.isVisible() and atlas.cancel_button.isVisible() and not atlas.compute_button.isVisible()
    assert atlas.progress.value() == 400
    with qtbot.waitSignal(inspector.atlasCancelRequested, timeout=3000):
        QTest.mouseClick(atlas.cancel_button, Qt.MouseButton.LeftButton)
    inspector.set_atlas_progress(None)
    assert not atlas.progress.isVisible() and atlas.compute_button.isVisible()

    inspector.set_atlas(tiny_atlas(4, 8, 3))
    assert atlas.pages.currentIndex() == 1
    assert [r.text() for r in atlas.legend.rows] == ["Topic 0 (12)", "Topic 1 (11)", "Topic 2 (8)", "never chosen (1)"]
    # offscreen Qt has no OpenGL: a message instead of the canvas, and no crash
    assert atlas.canvas is None
    assert atlas.no_gl.isVisible() and "OpenGL" in atlas.no_gl.text()

    inspector.set_atlas(None)
    assert atlas.pages.currentIndex() == 0


def test_atlas_progress_says_the_time_left_at_its_pace(inspector, monkeypatch):
    # the walkthrough's atlas took 1 min 53 s with a bare percentage and no estimate
    import ui.inspector.atlas as atlas_mod

    clock = [100.0]
    monkeypatch.setattr(atlas_mod, "_clock", lambda: clock[0])
    bar = inspector.atlas.progress
    inspector.set_atlas_progress(0.0)
    assert bar.format() == "computing the atlas: 0%"
    clock[0] = 101.0
    inspector.set_atlas_progress(0.01)
    assert bar.format() == "computing the atlas: 1%"                       # no pace yet
    clock[0] = 130.0
    inspector.set_atlas_progress(0.25)
    assert bar.format() == "computing the atlas: 25%, about 1 min 30 s left"   # 30 s for a quarter
    clock[0] = 150.0
    inspector.set_atlas_progress(0.8)
    assert bar.format() == "computing the atlas: 80%, about 10 s left"
    inspector.set_atlas_progress(None)
    clock[0] = 500.0
    inspector.set_atlas_progress(0.5)                                        # a new computation: a new pace
    assert bar.format() == "computing the atlas: 50%"


def test_atlas_tracks_the_current_tokens_experts_without_gl(qtbot, inspector):
    gen = Generation(4, 8)
    gen.decode(3)
    data = tiny_atlas(4, 8, 3)
    inspector.set_atlas(data)
    inspector.tabs.setCurrentWidget(inspector.atlas)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    lit = {tuple(int(v) for v in inspector.atlas.data.keys[r]) for r in inspector.atlas.lit_rows}
    assert lit == {(layer, e) for layer, ids in gen.current() for e in ids}


def test_atlas_gives_its_canvas_the_width_and_labels_the_axes_with_their_shares(qtbot, inspector):
    inspector.resize(620, 800)                       # the inspector docked beside the chat
    data = tiny_atlas(4, 8, 3)
    inspector.set_atlas(data)
    inspector.tabs.setCurrentWidget(inspector.atlas)
    atlas = inspector.atlas
    # the canvas's place (here the no-GL message) spans the pane; the legend sits under it, in columns
    qtbot.waitUntil(lambda: atlas.stage.width() >= 580, timeout=3000)
    assert atlas.stage.height() > 0.6 * atlas.height() > atlas.legend.height()
    assert atlas.legend.geometry().top() >= atlas.stage.geometry().bottom()
    assert atlas.legend.columns >= 3
    assert len({row.geometry().left() for row in atlas.legend.rows}) == atlas.legend.columns

    shares = data["explained_variance"]
    assert len(shares) == 3 and 0 < sum(shares) <= 1 + 1e-6
    names = [f"PC{i + 1} {100 * v:.0f}%" for i, v in enumerate(shares)]
    assert atlas.legend.axes.text().startswith("axes: " + ", ".join(names))
    assert "size: probe selections (bigger = more evidence)" in atlas.legend.notes.text()

    # an atlas made before the shares were recorded still shows, its axes named without them
    inspector.set_atlas({k: v for k, v in data.items() if k != "explained_variance"})
    assert atlas.data.explained_variance == ()
    assert atlas.legend.axes.text().startswith("axes: PC1, PC2, PC3 (this atlas does not record")


def test_markers_grow_with_the_evidence_not_the_specialisation():
    data = AtlasData.from_dict(tiny_atlas(4, 8, 3))
    sizes = marker_sizes(data.selections)                          # [N] px
    order = np.argsort(data.selections, kind="stable")
    assert (np.diff(sizes[order]) >= 0).all()                      # more selections, never a smaller dot
    most, never = int(np.argmax(data.selections)), data.row(0, 1)
    assert data.selections[never] == 0 and sizes[never] == sizes.min() == 4.0 and sizes[most] == 16.0
    # the expert most specialised on least evidence gets no big dot (specialisation once sized the dots)
    sure = data.selections > 0
    lone = np.flatnonzero(sure)[np.argmin(data.selections[sure])]
    assert sizes[lone] < sizes[most]
    # many experts: all smaller (less overlap), in the same order
    many = np.tile(data.selections, 200)
    assert marker_sizes(many).max() < 16.0 and (np.diff(marker_sizes(many)[np.argsort(many, kind="stable")]) >= 0).all()


def test_set_atlas_names_an_unreadable_atlas(qtbot, inspector):
    with pytest.raises(ValueError, match="colibri atlas"):
        inspector.set_atlas({"format": "colibri-atlas", "layers": []})


def test_atlas_renders_under_xvfb(xvfb, tmp_path):
    """Run the gl_* checks in a child pytest on the X server (the offscreen platform has no OpenGL)."""
    if xvfb is None:
        pytest.skip("pytest-xvfb started no X server (Xvfb missing, or --no-xvfb): `apt install xvfb`")
    env = dict(os.environ, QT_QPA_PLATFORM="xcb", DISPLAY=f":{xvfb.display}")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:xvfb", "-p", "no:cacheprovider",
           "-o", "python_functions=gl_*", "--rootdir", str(REPO), "--basetemp", str(tmp_path / "child")]
    child = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the GL checks failed under Xvfb:\n{child.stdout}\n{child.stderr}"
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout


def gl_atlas_renders_lights_picks_and_selects(qtbot, inspector):
    """(Xvfb child only) the canvas draws, routed experts light up, hover names and click selects."""
    from ui.inspector.atlas import gl_problem

    assert gl_problem() is None, gl_problem()
    gen = Generation(8, 16)
    gen.decode(4)
    inspector.set_model_info(8, 16, None)
    inspector.set_atlas(tiny_atlas(8, 16, 5))
    inspector.tabs.setCurrentWidget(inspector.atlas)
    inspector.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, inspector)
    atlas = inspector.atlas
    assert atlas.canvas is not None and atlas.canvas.native.isVisible()
    qtbot.wait(100)

    image = atlas.canvas.render()                                     # [H, W, 4] uint8
    assert image.shape[2] == 4 and image.shape[0] > 100
    assert image[..., :3].std() > 5, "the atlas rendered a blank image"
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 5  # several topic colours, not one fill
    assert atlas._lit.visible and len(atlas.lit_rows) == 16

    # hover and click the point that is nearest to its own screen position (not hidden by another)
    xy = atlas.screen_positions()
    row = next(i for i in range(len(xy)) if atlas.pick(*xy[i]) == i)
    key = (int(atlas.data.keys[row, 0]), int(atlas.data.keys[row, 1]))
    where = QPoint(int(round(xy[row, 0])), int(round(xy[row, 1])))
    QTest.mouseMove(atlas.canvas.native, where)
    qtbot.waitUntil(lambda: atlas.hovered == key, timeout=3000)
    assert f"layer {key[0]}, expert {key[1]}" in atlas.legend.info.text()
    with qtbot.waitSignal(inspector.expertSelected, timeout=3000) as blocker:
        QTest.mouseClick(atlas.canvas.native, Qt.MouseButton.LeftButton, pos=where)
    assert blocker.args == list(key)
    assert atlas._ring.visible and inspector.brain.selected_cell == key

    inspector.close_views()
    assert atlas.canvas is None


def gl_atlas_survives_its_dock_floating(qtbot):
    """(Xvfb child only) floating a dock gives the canvas a new GL context: the atlas is rebuilt, not broken."""
    from PySide6.QtWidgets import QDockWidget, QLabel, QMainWindow

    win = QMainWindow()
    insp = Inspector()
    qtbot.addWidget(win, before_close_func=lambda w: insp.close_views())
    dock = QDockWidget("Inspector")
    dock.setWidget(insp)
    win.setCentralWidget(QLabel("chat"))
    win.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    win.resize(1000, 600)
    win.show()
    qtbot.waitExposed(win)
    gen = Generation(8, 16)
    gen.decode(2)
    insp.set_atlas(tiny_atlas(8, 16, 5))
    insp.tabs.setCurrentWidget(insp.atlas)
    insp.set_snapshot(gen.tel.snapshot())
    redraw(qtbot, insp)
    first = insp.atlas.canvas

    dock.setFloating(True)
    qtbot.waitUntil(lambda: insp.atlas.canvas is not None and insp.atlas.canvas is not first, timeout=5000)
    qtbot.wait(100)
    image = insp.atlas.canvas.render()
    assert image[..., :3].std() > 5, "the atlas went blank when its dock floated"
    assert insp.atlas._points.visible and insp.atlas._lit.visible


def gl_atlas_fills_the_pane_and_fits_every_expert(qtbot, inspector):
    """(Xvfb child only) at 620 x 800 the canvas takes the width; there and in a tall narrow pane no expert is cut,
    and the axes carry their shares."""
    inspector.resize(620, 800)
    data = tiny_atlas(8, 16, 5)
    inspector.set_model_info(8, 16, None)
    inspector.set_atlas(data)
    inspector.tabs.setCurrentWidget(inspector.atlas)
    atlas = inspector.atlas
    qtbot.waitUntil(lambda: atlas.canvas is not None and atlas.canvas.native.isVisible(), timeout=3000)
    qtbot.waitUntil(lambda: atlas.canvas.native.width() >= 580, timeout=3000)
    assert atlas.canvas.native.height() > 0.6 * atlas.height()
    assert list(atlas._axis_text.text) == [f"PC{i + 1} {100 * v:.0f}%"
                                                for i, v in enumerate(data["explained_variance"])]
    _assert_every_expert_shows(atlas)

    inspector.resize(300, 1100)                      # as narrow as the inspector goes, and tall: the canvas is taller
    qtbot.waitUntil(lambda: atlas.canvas.native.height() > 1.5 * atlas.canvas.native.width(), timeout=3000)
    _assert_every_expert_shows(atlas)


def gl_atlas_centres_a_lopsided_cloud_and_labels_its_axes_clear_of_it(qtbot, inspector):
    """(Xvfb child only) a far cluster does not pull the view aside: the experts' extent sits mid-canvas, and the axis
    labels at the axes' ends cover no expert."""
    inspector.resize(620, 800)
    inspector.set_model_info(8, 16, None)
    inspector.set_atlas(_lopsided(tiny_atlas(8, 16, 5)))
    inspector.tabs.setCurrentWidget(inspector.atlas)
    atlas = inspector.atlas
    qtbot.waitUntil(lambda: atlas.canvas is not None and atlas.canvas.native.width() >= 580, timeout=3000)
    _assert_every_expert_shows(atlas)
    xy = atlas.screen_positions()                                        # [N, 2] px
    w, h = atlas.canvas.size
    middle = (xy.min(axis=0) + xy.max(axis=0)) / 2
    assert abs(middle[0] - w / 2) < 0.05 * w and abs(middle[1] - h / 2) < 0.05 * h, (middle, (w, h))
    assert xy[:, 0].max() - xy[:, 0].min() > 0.5 * w                     # and it fills the width, not a third of it

    text = atlas._axis_text
    anchors = text.get_transform("visual", "canvas").map(text.pos)      # [3, 4] homogeneous
    anchors = anchors[:, :2] / anchors[:, 3:4]                           # [3, 2] px: each label's bottom centre
    radius = atlas._sizes() / 2                                          # [N] px
    line = 1.5 * text.font_size * atlas.canvas.dpi / 72                 # px: a label's height, generously
    for (x, y), label in zip(anchors, text.text):
        half = 0.4 * line * len(label)                                   # px: half a label's width, generously
        dx = np.maximum(np.abs(xy[:, 0] - x) - half, 0)                  # [N] from the label's box
        dy = np.maximum(np.maximum(y - line - xy[:, 1], xy[:, 1] - y), 0)
        covered = np.hypot(dx, dy) < radius
        assert not covered.any(), f"{label} is drawn over {int(covered.sum())} experts"


def _lopsided(atlas: dict) -> dict:
    """The atlas with a fifth of its experts moved far along the first axis, as the walkthrough's one far topic."""
    rng = np.random.default_rng(0)
    out = copy.deepcopy(atlas)
    for layer in out["layers"]:
        for x in layer["experts"]:
            if x["expert"] % 5 == 0:
                x["position"] = [3.0 + 0.3 * rng.standard_normal(), *(0.3 * rng.standard_normal(2))]
    return out


def _assert_every_expert_shows(atlas) -> None:
    atlas.canvas.render()                            # the camera takes the canvas's size at a draw
    xy = atlas.screen_positions()                    # [N, 2] px
    w, h = atlas.canvas.size
    assert (xy[:, 0] >= 0).all() and (xy[:, 0] <= w).all(), f"experts cut at the sides: x {xy[:, 0].min():.0f}.." \
        f"{xy[:, 0].max():.0f} of {w}"
    assert (xy[:, 1] >= 0).all() and (xy[:, 1] <= h).all(), f"experts cut at the top or bottom: y " \
        f"{xy[:, 1].min():.0f}..{xy[:, 1].max():.0f} of {h}"
    spread = xy[:, 0].max() - xy[:, 0].min()
    assert spread > 0.3 * min(w, h), f"the experts span {spread:.0f} px of {w} x {h}: too far away to read"
