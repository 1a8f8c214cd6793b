"""Imports point down only (ui -> app -> engine): the engine imports no Qt, no web framework, no app/ui."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

QT = {"PySide6", "PySide2", "PyQt5", "PyQt6", "shiboken6", "shiboken2", "qtpy", "pyqtgraph", "vispy"}
WEB = {"fastapi", "starlette", "uvicorn", "flask", "aiohttp", "django", "tornado", "sanic", "quart"}
ENGINE_FORBIDDEN = QT | WEB | {"app", "ui"}
APP_FORBIDDEN = {"ui"} | QT  # app/ drives the engine for every front end: the GUI's Qt stays in ui/
_IMPORT_FUNCS = {"import_module", "__import__"}


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """The dotted module name of PATH below ROOT (the folder holding the top package), and whether it is a package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module SOURCE imports, as (line, absolute dotted name): relative imports resolved, nested ones included.

    A relative import that climbs above the top package resolves to a name starting with '.'.
    Calls of importlib.import_module / __import__ with a literal name count as imports too.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".") if package else []
            up = node.level - 1  # `from . import` stays in the package, each further dot goes one up
            if node.level == 0:
                base = ""
            elif up >= len(parts):  # climbs out of the top package: keep the dots to report it
                base = "." * node.level
            else:
                base = ".".join(parts[: len(parts) - up]) + "."
            if node.module:
                found.append((node.lineno, base + node.module))
            else:  # `from . import x`: x is a module of the package
                found += [(node.lineno, base + alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _IMPORT_FUNCS and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(source: str, module: str, is_package: bool, forbidden: set[str]) -> list[str]:
    """The imports of SOURCE whose top-level package is in FORBIDDEN, or that climb out of the top package."""
    top = module.split(".")[0]
    out = []
    for line, name in imported_modules(source, module, is_package):
        if name.startswith("."):
            out.append(f"{module}:{line}: relative import {name} climbs out of {top}")
        elif name.split(".")[0] in forbidden:
            out.append(f"{module}:{line}: imports {name}")
    return out


def _tree_violations(package: str, forbidden: set[str], skip=lambda module: False) -> list[str]:
    out = []
    for path in sorted((REPO / package).rglob("*.py")):
        module, is_package = module_name(path, REPO)
        if not skip(module):
            out += violations(path.read_text(encoding="utf-8"), module, is_package, forbidden)
    return out


# ---- the checker catches what it must -----------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "import PySide6.QtWidgets",
        "from PyQt6 import QtCore",
        "import numpy, fastapi",
        "def f():\n    import pyqtgraph as pg",
        "class A:\n    def f(self):\n        from app.cli import main",
        "from ui import views",
        "try:\n    import vispy\nexcept ImportError:\n    pass",
        "import importlib\nimportlib.import_module('uvicorn')",
        "__import__('flask')",
        "from ... import app",  # from engine.formats.x climbs out of engine
        "from .... import ui",
    ],
)
def test_checker_flags_a_forbidden_import(source: str) -> None:
    assert violations(source, "engine.formats.x", False, ENGINE_FORBIDDEN)


@pytest.mark.parametrize(
    "source",
    [
        "import numpy as np\nfrom numba import njit",
        "from . import gguf_meta",
        "from .. import errors",
        "from ..models import llama",
        "from engine.errors import ColibriError",
        "import application_helpers",  # only the top-level name counts
        "x = {'app': 1}\nprint('PySide6')",
    ],
)
def test_checker_accepts_allowed_imports(source: str) -> None:
    assert violations(source, "engine.formats.x", False, ENGINE_FORBIDDEN) == []


def test_checker_resolves_relative_imports() -> None:
    assert imported_modules("from .. import errors", "engine.formats.x", False) == [(1, "engine.errors")]
    assert imported_modules("from . import spec", "engine", True) == [(1, "engine.spec")]
    assert imported_modules("from .blocks import moe", "engine.models", True) == [(1, "engine.models.blocks")]
    assert imported_modules("from .. import app", "engine", True) == [(1, "..app")]
    assert imported_modules("from ...x import y", "engine.formats.r", False) == [(1, "...x")]


# ---- the tree obeys the rules ---------------------------------------------------------------------


def test_engine_sources_import_no_qt_web_app_or_ui() -> None:
    assert _tree_violations("engine", ENGINE_FORBIDDEN) == []


def test_app_imports_ui_only_in_the_gui_entry_point() -> None:
    in_gui = lambda module: module.rpartition(".")[2].startswith("gui")  # noqa: E731
    assert _tree_violations("app", APP_FORBIDDEN, skip=in_gui) == []


def test_ui_imports_no_web_framework_and_nothing_climbs_out() -> None:
    assert _tree_violations("ui", WEB) == []


def test_the_engine_service_and_conversations_load_no_qt() -> None:
    script = "import sys, app.service.local, app.conversations, app.commands.gui; " \
             f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({sorted(QT | {'ui'})!r})))"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_importing_every_engine_module_loads_no_forbidden_package() -> None:
    script = textwrap.dedent(
        f"""
        import json, importlib, pkgutil, sys
        import engine
        failed = []
        for info in pkgutil.walk_packages(engine.__path__, "engine.", onerror=failed.append):
            try:
                importlib.import_module(info.name)
            except Exception as exc:  # reported, and the other modules are still checked
                failed.append(f"{{info.name}}: {{type(exc).__name__}}: {{exc}}")
        loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({sorted(ENGINE_FORBIDDEN)!r}))
        print(json.dumps({{"loaded": loaded, "failed": failed}}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [], "importing the engine loaded forbidden packages"
    assert report["failed"] == [], "engine modules that cannot be imported (so not checked)"
