"""Screenshots of the real app for the README: `python -m ui.screenshots [--model PATH] [--out DIR]`.

Runs the app under a virtual X display (re-running itself under `xvfb-run` when there is no
display), warms the model's kernels up first in a child process (as the app does when it prepares a model, so the
figures show decoding, not compiling), loads it as `colibri gui MODEL` does (the budget of its
colibri.toml; a model held whole is given one that leaves some experts on disk), asks it a
question with the Greedy preset (a 135 M model's sampled answers ramble), and grabs the main
window, each inspector tab and the dark theme into assets/screenshots/. The default model is the
derived MoE (`colibri pull smollm2-moe`), a 4-bit container whose experts stream; without it, the
SmolLM2 GGUF. Settings and conversations go to a temporary folder: the user's are not touched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.service.messages import LoadOptions

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "assets" / "screenshots"
SIZE = (1440, 900)
QUESTION = "Write a short Python function that checks whether a word is a palindrome, and explain it in one sentence."


def pick_model(arg: str | None) -> Path:
    """The model to show: the argument, else the derived MoE (a streaming container), else the SmolLM2 GGUF."""
    from app.hub.pull import resolve_model

    if arg:
        return resolve_model(arg)
    try:
        return resolve_model("smollm2-moe")
    except Exception:  # not pulled: fall back to the small dense model
        return resolve_model("smollm2-135m")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder, .gguf or pulled name (default: see above)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where the PNGs go (default {OUT})")
    parser.add_argument("--tokens", type=int, default=160, help="answer length (default 160)")
    args = parser.parse_args(argv)
    if sys.platform.startswith("linux") and not os.environ.get("DISPLAY") and not os.environ.get("_COLIBRI_XVFB"):
        if shutil.which("xvfb-run") is None:
            print("screenshots: no display and no xvfb-run; install xvfb (make system-deps)", file=sys.stderr)
            return 2
        env = {**os.environ, "_COLIBRI_XVFB": "1", "QT_QPA_PLATFORM": "xcb"}
        cmd = ["xvfb-run", "-a", "-s", f"-screen 0 {SIZE[0] + 160}x{SIZE[1] + 160}x24",
               sys.executable, "-m", "ui.screenshots", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env=env, cwd=REPO)
    return shoot(pick_model(args.model), args.out, args.tokens)


def shoot(model: Path, out: Path, tokens: int) -> int:
    """Open the app on model, generate, and save the PNGs; 0 on success."""
    from PySide6.QtCore import QSettings, Qt
    from PySide6.QtWidgets import QApplication

    from app.conversations import ConversationStore
    from app.service.local import SettingsChange
    from app.service.warm import warm_up_apart
    from ui.app import MainWindow, configure
    from ui.theme import follow_scheme

    out.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: warming {model.name}'s kernels up ...", file=sys.stderr)
    print(f"  kernels ready in {warm_up_apart(model):.0f} s", file=sys.stderr)     # in a child, as the app does
    app = QApplication.instance() or QApplication(["colibri"])
    configure(app)
    follow_scheme(app, Qt.ColorScheme.Light)
    tmp = Path(tempfile.mkdtemp(prefix="colibri-shots-"))
    window = MainWindow(QSettings(str(tmp / "settings.ini"), QSettings.Format.IniFormat),
                        ConversationStore(tmp / "conversations"), load_options=gui_options(model))
    try:
        window.resize(*SIZE)
        window.show()
        _wait(app, lambda: window.isVisible(), 10)
        window.open_model(str(model))
        _wait(app, lambda: window.info is not None or window.error_dialog is not None, 900)
        if window.info is None:
            print(f"screenshots: {model} did not load: {window.error_dialog.text()}", file=sys.stderr)
            return 1
        info = window.info
        if info.budget_range is not None and (info.settings.memory_budget or 1 << 62) >= info.budget_range[1]:
            # every expert held: a budget between the least and all, so that some stream from disk
            low, high = info.budget_range
            window.bridge.service.update_settings(SettingsChange(memory_budget=low + (high - low) // 3))
            _wait(app, lambda: window.info.settings.memory_budget != high, 60)   # the sliders follow
        window.chat.preset_picker.choose("Greedy")
        window.chat.max_tokens.setValue(tokens)
        window.chat.send(QUESTION)
        _wait(app, lambda: not window.chat.generating, 900)
        _settle(app, 1.5)
        _save(window, out / "main.png")
        follow_scheme(app, Qt.ColorScheme.Dark)
        _settle(app, 1.0)
        _save(window, out / "main-dark.png")
        follow_scheme(app, Qt.ColorScheme.Light)
        _settle(app, 0.5)
        tabs = getattr(window.inspector, "tabs", None)
        names = [tabs.tabText(i) for i in range(tabs.count())] if tabs is not None else []
        # the Atlas last: computing a container's atlas reopens its source folder (see _atlas)
        for name in sorted(names, key=lambda name: name == "Atlas"):
            if name == "Atlas" and info.n_experts:
                _atlas(app, window, model)
            tabs.setCurrentIndex(names.index(name))
            if name == "Cache" and info.n_experts:     # its replay runs on a worker thread
                _wait(app, lambda: window.inspector.cache.replays > 0, 120)
            _settle(app, 1.0)
            _save(window.inspector, out / f"inspector-{name.lower()}.png")
        dialog = window.models.show_convert(str(_source(model) or model))
        _settle(app, 0.5)
        _save(dialog, out / "convert.png")
        dialog.reject()
    finally:
        window.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"screenshots of {model.name} in {out}", file=sys.stderr)
    return 0


def gui_options(model: Path) -> LoadOptions:
    """How `colibri gui MODEL` loads model: the flags' defaults under the settings files (its colibri.toml too)."""
    from app.cli import build_parser
    from app.commands._memory import load_options
    from app.config import settings

    parser = build_parser()
    argv = ["gui", str(model)]
    args = parser.parse_args(argv)
    settings.configure(parser, args, argv, "gui")
    return load_options(args)


def _atlas(app, window, model: Path) -> None:
    """Compute the atlas of the loaded model; a container's atlas is its source folder's (app.atlas.build binds to those)."""
    failed = []
    window.bridge.atlasFailed.connect(failed.append)
    window.error_dialog = None
    window.compute_atlas()
    _wait(app, lambda: window._atlas_request is None, 1800)
    source = _source(model)
    if failed and source is not None:
        if window.error_dialog is not None:
            window.error_dialog.accept()
        if source.is_dir():
            window.open_model(str(source))
            _wait(app, lambda: window.info is not None and window.info.path == source, 900)
            failed.clear()
            window.compute_atlas()
            _wait(app, lambda: window._atlas_request is None, 1800)


def _source(model: Path) -> Path | None:
    """The folder a container was converted from (None: model is not a container)."""
    if not (model / "manifest.json").is_file():
        return None
    import json

    return Path(json.loads((model / "manifest.json").read_text())["source"]["path"])


def _wait(app, condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"screenshots: waited {seconds:.0f} s in vain")
        app.processEvents()
        time.sleep(0.01)


def _settle(app, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)


def _save(widget, path: Path) -> None:
    """Grab what the X server shows (OpenGL views included), else what Qt renders."""
    from PySide6.QtWidgets import QApplication

    screen = widget.screen() or QApplication.primaryScreen()
    top_left = widget.mapToGlobal(widget.rect().topLeft())
    pixmap = screen.grabWindow(0, top_left.x(), top_left.y(), widget.width(), widget.height())
    if pixmap.isNull() or os.environ.get("QT_QPA_PLATFORM") == "offscreen":
        pixmap = widget.grab()
    pixmap.save(str(path))
    print(f"  {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
