"""Screenshots of the real app for the README: `python -m ui.screenshots [--model PATH] [--out DIR]`.

Runs the app under a virtual X display (re-running itself under `xvfb-run` when there is no
display), loads a model, asks it a question, and grabs the main window, each inspector tab and
the dark theme into assets/screenshots/. The default model is the derived MoE (`colibri pull
smollm2-moe`), converted once to a 4-bit container so that its experts stream; without it, the
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

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "assets" / "screenshots"
CACHE = REPO / ".cache" / "screenshots"
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
    from ui.app import MainWindow, configure
    from ui.theme import follow_scheme

    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(["colibri"])
    configure(app)
    follow_scheme(app, Qt.ColorScheme.Light)
    tmp = Path(tempfile.mkdtemp(prefix="colibri-shots-"))
    window = MainWindow(QSettings(str(tmp / "settings.ini"), QSettings.Format.IniFormat),
                        ConversationStore(tmp / "conversations"))
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
        if info.budget_range is not None:          # a budget between the least and all: some experts on disk
            low, high = info.budget_range
            window.bridge.service.update_settings(SettingsChange(memory_budget=low + (high - low) // 3))
            _wait(app, lambda: window.info.settings.memory_budget != high, 60)   # the sliders follow
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
        for i in range(tabs.count() if tabs is not None else 0):
            name = tabs.tabText(i)
            if name == "Atlas" and info.n_experts:
                _atlas(app, window, model)
            tabs.setCurrentIndex(i)
            _settle(app, 1.0)
            _save(window.inspector, out / f"inspector-{name.lower()}.png")
        dialog = window.models.show_convert(str(model))
        _settle(app, 0.5)
        _save(dialog, out / "convert.png")
        dialog.reject()
    finally:
        window.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"screenshots of {model.name} in {out}", file=sys.stderr)
    return 0


def _atlas(app, window, model: Path) -> None:
    """Compute the atlas of the loaded model; a container's atlas is its source folder's (app.atlas.build binds to those)."""
    failed = []
    window.bridge.atlasFailed.connect(failed.append)
    window.error_dialog = None
    window.compute_atlas()
    _wait(app, lambda: window._atlas_request is None, 1800)
    if failed and (model / "manifest.json").is_file():
        import json

        source = Path(json.loads((model / "manifest.json").read_text())["source"]["path"])
        if window.error_dialog is not None:
            window.error_dialog.accept()
        if source.is_dir():
            window.open_model(str(source))
            _wait(app, lambda: window.info is not None and window.info.path == source, 900)
            failed.clear()
            window.compute_atlas()
            _wait(app, lambda: window._atlas_request is None, 1800)


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
