"""The packaged desktop app (packaging/): PyInstaller builds the one-folder bundle, whose program opens a
tiny model under a virtual display, answers a chat message and exits 0, twice (numba's cache cold,
then warm, in the user's cache folder); nothing is written inside the bundle; the desktop entry
is valid and install.sh installs and removes the app. Size and start-up times are printed
(`pytest -s tests/packaging/test_package.py`) and kept in the build folder's report.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from support.tiny_chat import tiny_moe

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
TOKENS = 8


def _files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")}


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, dict]:
    """The built bundle (without the demo GGUF, to keep it quick) and the build's figures."""
    root = tmp_path_factory.mktemp("package")
    start = time.monotonic()
    result = subprocess.run([str(PACKAGING / "build.sh"), "--no-demo", "--dist", str(root / "dist"),
                             "--work", str(root / "work")], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"the build failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    app = root / "dist" / "colibri"
    assert (app / "colibri").is_file() and os.access(app / "colibri", os.X_OK)
    return app, {"build_s": round(time.monotonic() - start, 1), "size_mb": round(_du(app) / 1e6)}


def _user_env(home: Path) -> dict[str, str]:
    """A fresh user: HOME and XDG folders in home, no cache or models folder chosen by the test session."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLIBRI_", "NUMBA_", "XDG_", "QT_QPA_PLATFORM"))}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), XDG_CONFIG_HOME=str(home / ".config"),
               XDG_DATA_HOME=str(home / ".local/share"), HF_HUB_OFFLINE="1")
    return env


def _self_test(program: Path, model: Path, env: dict[str, str]) -> dict:
    cmd = [str(program), str(model), "--self-test", "Hello, who are you?", "--self-test-tokens", str(TOKENS)]
    if not env.get("DISPLAY"):  # pytest-xvfb gives the session a display; without it, a virtual one of our own
        cmd = ["xvfb-run", "-a", *cmd]
    start = time.monotonic()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.stdout}\n{result.stderr[-5000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return {**report, "wall_s": round(wall, 2)}


@pytest.mark.slow
def test_the_packaged_app_opens_a_model_answers_and_exits_cleanly(bundle, tmp_path):
    app, figures = bundle
    model = tiny_moe(tmp_path / "tiny-chat-moe")
    home = tmp_path / "home"
    env = _user_env(home)
    before = _files(app)
    cold = _self_test(app / "colibri", model, env)
    warm = _self_test(app / "colibri", model, env)
    for run in (cold, warm):
        assert run["ok"] and run["frozen"] and run["tokens"] == TOKENS and run["finish_reason"] == "length"
        assert run["window_shown_s"] <= run["model_loaded_s"] <= run["first_token_s"] <= run["done_s"]
    assert warm["text"] == cold["text"]                     # the cached kernels give the same answer
    cache = Path(cold["numba_cache_dir"])
    assert cache.is_relative_to(home / ".cache") and any(cache.rglob("*.nbi")), "numba's cache is not in use"
    assert (home / ".local/share/colibri/conversations").is_dir() and (home / ".config/colibri").is_dir()
    assert _files(app) == before, "the app wrote inside its own folder"
    report = {**figures, "cold": cold, "warm": warm}
    (app.parent.parent / "report.json").write_text(json.dumps(report, indent=1))
    print(f"\npackage: {figures['size_mb']} MB, built in {figures['build_s']} s")
    for name, run in (("cold numba cache", cold), ("warm numba cache", warm)):
        print(f"  {name}: window shown {run['window_shown_s']} s, model loaded {run['model_loaded_s']} s, "
              f"first token {run['first_token_s']} s, exit after {run['wall_s']} s")


@pytest.mark.slow
def test_the_packaged_cli_runs_too(bundle, tmp_path):
    app, _ = bundle
    result = subprocess.run([str(app / "colibri"), "--cli", "--version"], env=_user_env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "colibri" in (result.stdout + result.stderr).lower()
    # the child processes the app starts: the first run's stand-in (-m) and its warm-up (--cli warm)
    standin = subprocess.run([str(app / "colibri"), "-m", "app.hub.standin", "--help"], env=_user_env(tmp_path),
                             capture_output=True, text=True, timeout=120)
    assert standin.returncode == 0 and "python -m app.hub.standin" in standin.stdout, standin.stderr
    warm = subprocess.run([str(app / "colibri"), "--cli", "warm", "--help"], env=_user_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert warm.returncode == 0 and "compile" in warm.stdout, warm.stderr


@pytest.mark.slow
def test_the_bundle_carries_the_chinese_translation(bundle):
    app, _ = bundle
    assert (app / "_internal" / "ui" / "i18n" / "colibri_zh_CN.qm").is_file()      # where ui.language looks
    assert list(app.rglob("qtbase_zh_CN.qm"))                                   # Qt's own, for its buttons


def test_the_desktop_entry_is_valid():
    entry = PACKAGING / "colibri.desktop"
    validator = shutil.which("desktop-file-validate")
    assert validator, "desktop-file-validate is missing: `make test` installs desktop-file-utils"
    result = subprocess.run([validator, str(entry)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout
    lines = entry.read_text().splitlines()
    assert lines[0] == "[Desktop Entry]"
    keys = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    assert keys["Type"] == "Application" and keys["Name"] == "Colibri" and keys["Icon"] == "colibri"
    assert keys["Exec"].split()[0] == "colibri" and keys["Terminal"] == "false"
    assert keys["StartupWMClass"] == "colibri"     # QGuiApplication.setDesktopFileName("colibri") matches it


def test_install_puts_app_icon_and_entry_in_the_users_folders_and_uninstall_removes_them(tmp_path):
    fake = tmp_path / "dist" / "colibri"        # install.sh copies any built folder; a stand-in is enough
    (fake / "_internal").mkdir(parents=True)
    (fake / "colibri").write_text("#!/bin/sh\necho colibri\n")
    (fake / "colibri").chmod(0o755)
    prefix = tmp_path / "home" / ".local"
    env = {**os.environ, "PREFIX": str(prefix), "HOME": str(tmp_path / "home")}
    subprocess.run([str(PACKAGING / "install.sh"), "--from", str(fake)], env=env, check=True, capture_output=True)
    app = prefix / "share/colibri/app/colibri"
    entry = prefix / "share/applications/colibri.desktop"
    assert app.is_file() and (prefix / "bin/colibri").resolve() == app.resolve()
    assert (prefix / "share/icons/hicolor/256x256/apps/colibri.png").is_file()
    assert (prefix / "share/icons/hicolor/scalable/apps/colibri.svg").is_file()
    assert f"Exec={app} %f" in entry.read_text().splitlines()
    assert subprocess.run(["desktop-file-validate", str(entry)], capture_output=True).returncode == 0
    subprocess.run([str(PACKAGING / "install.sh"), "--uninstall"], env=env, check=True, capture_output=True)
    left = [p for p in prefix.rglob("*") if p.is_file() and p.name not in ("icon-theme.cache", "mimeinfo.cache")]
    assert not left and not app.exists()
