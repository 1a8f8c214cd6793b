"""Frame rates of the inspector's Brain and Atlas at the seeds' scale: `python -m ui.fps`.

The reference engine's headline model, GLM-5.2, routes among 19,456 experts (76 MoE layers of 256). This
script builds both views at that size with synthetic data and feeds them a new token per frame: its top-8
experts in every layer, heat that decays and grows as the inspector's does, tiers that change. Each frame is
painted before the next one starts (a synchronous repaint, as if the inspector's timer never had to wait),
and the frames per second of wall time are printed: the Brain's grid (pyqtgraph, a 76 x 256 image, with an
expert's story retold beside it from counters at that scale) and the Atlas's 3D points (vispy, every frame a full
GL draw of 19,456 markers and the 608 lit ones). The Brain is measured again while the Cache tab's replay of a
trace of 4,096 layer steps runs on its worker thread, as it does while that tab is in view; with `--maps`, under each
of its colour maps (ui/inspector/colours.py) with the disk tier and all atlas topics but one filtered out.

The Atlas needs OpenGL: run it under a display; on a machine without a GPU that is Mesa's llvmpipe, in
software (`xvfb-run -s "-screen 0 1280x1024x24" python -m ui.fps`). With QT_QPA_PLATFORM=offscreen only
the Brain is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np

LAYERS, EXPERTS, TOP_K = 76, 256, 8      # 19,456 experts, as GLM-5.2
SELECTED = (3, 17)                        # the expert whose story the Brain tells
DECAY = 0.97                              # heat kept per token


def _frames(n: int, seed: int = 0) -> list:
    """N frames of one token each: its routing, the decayed heat and tiers that drift."""
    from ui.inspector.data import TIER_CACHED, TIER_DISK, TIER_PINNED, Frame

    rng = np.random.default_rng(seed)
    heat = np.zeros((LAYERS, EXPERTS), np.float32)
    tiers = rng.choice(np.array([TIER_DISK, TIER_CACHED, TIER_PINNED], np.int8), size=(LAYERS, EXPERTS),
                       p=[0.7, 0.25, 0.05])
    popular = rng.zipf(1.5, size=(LAYERS, EXPERTS)).astype(np.float64)   # a few experts take most tokens
    popular /= popular.sum(axis=1, keepdims=True)
    counts = _counts(rng)
    frames = []
    for _ in range(n):
        current = tuple((layer, tuple(int(e) for e in rng.choice(EXPERTS, TOP_K, replace=False, p=popular[layer])))
                        for layer in range(LAYERS))
        heat *= DECAY
        for layer, ids in current:
            heat[layer, list(ids)] += 1.0
            tiers[layer, list(ids)] = TIER_CACHED
        snapshot = SimpleNamespace(heat=heat.copy(), current=current)
        frames.append(Frame(snapshot=snapshot, shape=(LAYERS, EXPERTS), budget=None, tiers=tiers.copy(),  # type: ignore[arg-type]
                            atlas=None, selected=SELECTED, counts=counts))
    return frames


def _counts(rng: np.random.Generator):
    """The store's per-expert counters at this scale, their ring of tier changes full."""
    from engine.offload.story import ExpertLog

    log = ExpertLog(LAYERS, EXPERTS, TOP_K)
    for grid in (log.hits, log.misses, log.reads, log.ahead_used, log.ahead_wasted):
        grid[:] = rng.integers(0, 500, grid.shape)
    log.steps[:] = 10_000
    log.tokens = 1000
    log.last[:] = rng.integers(-1, log.tokens, log.last.shape)      # the token that last chose each, -1 never
    n = len(log.ring)
    log.ring["token"] = np.arange(n) // 64
    log.ring["layer"], log.ring["expert"] = rng.integers(0, LAYERS, n), rng.integers(0, EXPERTS, n)
    log.ring["tier"] = rng.integers(0, 3, n)
    log.changed = n
    return log.frozen()


def _trace(seed: int = 0):
    """A cache trace at this scale: 4,096 layer steps of zipf-popular routing, a cache of 2,000 slots."""
    from engine.offload.quality import CacheTrace

    rng = np.random.default_rng(seed)
    popular = rng.zipf(1.5, size=(LAYERS, EXPERTS)).astype(np.float64)
    popular /= popular.sum(axis=1, keepdims=True)
    steps = tuple((layer, tuple(int(e) for e in rng.choice(EXPERTS, TOP_K, replace=False, p=popular[layer])))
                  for layer in (i % LAYERS for i in range(4096)))
    return CacheTrace(steps, 2000, 1 << 22, LAYERS * EXPERTS, "learned", 4.0 * LAYERS, TOP_K * LAYERS, 0.1,
                      popular, popular, 0, 0)


def _atlas_data(seed: int = 0):
    from ui.inspector.data import AtlasData

    rng = np.random.default_rng(seed)
    keys = np.array([(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)], np.int64)
    positions = rng.standard_normal((len(keys), 3)).astype(np.float32)
    positions /= np.linalg.norm(positions, axis=1).max()
    topics = tuple(f"topic{i}" for i in range(12))
    top = rng.integers(-1, len(topics), len(keys))
    return AtlasData(keys, positions, top, rng.random(len(keys)).astype(np.float32),
                     rng.integers(0, 200, len(keys)), topics, topics,
                     {(int(a), int(b)): i for i, (a, b) in enumerate(keys)})


def brain_fps(app, frames: list, seconds: float, colour_map: str | None = None) -> dict:
    """Frames per second of the Brain redrawing and repainting one frame after another for about SECONDS; with a
    colour map named, under that map with the disk tier and all topics but one filtered out (dimmed)."""
    from ui.inspector.brain import BrainView
    from ui.inspector.common import theme_for
    from ui.inspector.data import TIER_DISK

    view = BrainView(theme_for(app.palette()))
    view.resize(1000, 640)
    view.show()
    app.processEvents()
    if colour_map is not None:
        view.legend.set_colour_map(colour_map)
        view.legend.tier_boxes[TIER_DISK].setChecked(False)
        view.legend.set_atlas(frames[0].atlas)
        view.legend.topics.setCurrentIndex(1)
    view.redraw(frames[0])                  # the first frame sizes the axes: not timed
    view.view.viewport().repaint()
    drawn, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        view.redraw(frames[drawn % len(frames)])
        view.view.viewport().repaint()
        app.processEvents()
        drawn += 1
    elapsed = time.perf_counter() - t0
    view.close()
    return {"frames": drawn, "seconds": round(elapsed, 3), "fps": round(drawn / elapsed, 1)}


def brain_replaying_fps(app, frames: list, seconds: float) -> dict:
    """`brain_fps` while the Cache tab's replay runs on its worker thread (started again as each one ends), and the
    replays that ended meanwhile."""
    from engine.offload.quality import cache_quality

    trace, stop, ended = _trace(), threading.Event(), [0]

    def replay() -> None:
        while not stop.is_set():
            if cache_quality(trace, cancelled=stop.is_set) is not None:
                ended[0] += 1

    worker = threading.Thread(target=replay, name="cache-replay")
    worker.start()
    try:
        result = brain_fps(app, frames, seconds)
    finally:
        stop.set()
        worker.join()
    return {**result, "replays": ended[0]}


def atlas_fps(app, frames: list, seconds: float) -> dict:
    """Canvas draws per second of the Atlas lighting each frame's experts for about SECONDS, and the draw time;
    or why it cannot draw (no OpenGL)."""
    from ui.inspector.atlas import AtlasView, gl_problem
    from ui.inspector.common import theme_for

    problem = gl_problem()
    if problem is not None:
        return {"skipped": problem}
    view = AtlasView(theme_for(app.palette()))
    view.resize(1000, 640)
    view.show()
    view.set_atlas(_atlas_data())
    app.processEvents()
    canvas = view.canvas
    if canvas is None:
        return {"skipped": view.no_gl.text()}
    draws = [0]
    canvas.events.draw.connect(lambda event: draws.__setitem__(0, draws[0] + 1), position="last")
    canvas.native.repaint()                 # the first draw uploads the points: not timed
    app.processEvents()
    draws[0], shown, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        view.redraw(frames[shown % len(frames)])
        view._view.camera.azimuth += 1.0    # the user turning the atlas: every frame a full draw
        canvas.native.repaint()
        app.processEvents()
        shown += 1
    elapsed = time.perf_counter() - t0
    result = {"draws": draws[0], "seconds": round(elapsed, 3), "fps": round(draws[0] / elapsed, 1),
              "draw_ms": round(view.draw_cost * 1000, 1), "renderer": _renderer()}
    view.close_gl()
    view.close()
    return result


def _renderer() -> str:
    from PySide6.QtGui import QOffscreenSurface, QOpenGLContext

    surface = QOffscreenSurface()
    surface.create()
    context = QOpenGLContext()
    if not context.create() or not context.makeCurrent(surface):
        return "unknown"
    try:
        from OpenGL import GL  # type: ignore[import-not-found]

        return GL.glGetString(GL.GL_RENDERER).decode()
    except Exception:       # PyOpenGL is optional: vispy uses its own GL bindings
        functions = context.functions()
        return str(functions.glGetString(0x1F01))   # GL_RENDERER
    finally:
        context.doneCurrent()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ui.fps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="time each view is measured (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--maps", action="store_true",
                        help="measure the Brain under each colour map too, with a tier and a topic filtered out")
    args = parser.parse_args(argv)
    from PySide6.QtWidgets import QApplication

    from ui.inspector.colours import MAPS

    app = QApplication.instance() or QApplication(sys.argv[:1])
    frames = _frames(64)
    result = {"experts": LAYERS * EXPERTS, "brain": brain_fps(app, frames, args.seconds),
              "brain_replaying": brain_replaying_fps(app, frames, args.seconds),
              "atlas": atlas_fps(app, frames, args.seconds)}
    if args.maps:
        atlas = _atlas_data()
        mapped = [dataclasses.replace(f, atlas=atlas) for f in frames]
        result["brain_maps"] = {name: brain_fps(app, mapped, args.seconds, name) for name in MAPS}
    if args.json:
        print(json.dumps(result))
        return 0
    b, a = result["brain"], result["atlas"]
    print(f"{LAYERS * EXPERTS} experts ({LAYERS} layers x {EXPERTS}, top-{TOP_K} per layer)")
    r = result["brain_replaying"]
    print(f"Brain: {b['fps']:.1f} frames/s ({b['frames']} in {b['seconds']:.1f} s)")
    print(f"Brain while the Cache tab replays: {r['fps']:.1f} frames/s ({r['frames']} in {r['seconds']:.1f} s, "
          f"{r['replays']} replays ended)")
    for name, m in result.get("brain_maps", {}).items():
        print(f"Brain, {name} map, disk tier and all topics but one dimmed: {m['fps']:.1f} frames/s "
              f"({m['frames']} in {m['seconds']:.1f} s)")
    if "skipped" in a:
        print(f"Atlas: not measured: {a['skipped']}")
    else:
        print(f"Atlas: {a['fps']:.1f} draws/s ({a['draws']} in {a['seconds']:.1f} s), {a['draw_ms']:.1f} ms per draw, "
              f"on {a['renderer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
