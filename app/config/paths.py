"""Where Colibri keeps its files on the user's machine: the models folder, usage histories, converted GGUFs."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

MODELS_DIR_ENV = "COLIBRI_MODELS_DIR"


def models_dir() -> Path:
    """The models folder: `$COLIBRI_MODELS_DIR` if set, else `<user data dir>/colibri/models`; created on demand."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        path = Path(override).expanduser()
    else:
        # appauthor=False: no "<author>\<app>" nesting on Windows; on Linux this honours XDG_DATA_HOME.
        path = Path(platformdirs.user_data_dir("colibri", appauthor=False)) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def usage_dir() -> Path:
    """Usage histories (one per model hash): `<user data dir>/colibri/usage`, beside the models folder."""
    path = models_dir().parent / "usage"
    path.mkdir(parents=True, exist_ok=True)
    return path


def converted_dir() -> Path:
    """Containers made from GGUF files run under a memory budget: `<user data dir>/colibri/converted`."""
    path = models_dir().parent / "converted"
    path.mkdir(parents=True, exist_ok=True)
    return path
