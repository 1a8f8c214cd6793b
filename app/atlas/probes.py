"""The probe prompts in `assets/probes/`: prompts by topic, written for Colibri, and held-out text.

One JSON file per topic: `{"topic": "python", "title": "Python code", "prompts": ["...", ...]}`.
They drive `colibri atlas` (routing per topic), the default calibration text of `colibri moefy`
(the dense model answers them) and the bit planner's calibration. `heldout.txt` is text written
apart from the probes, for perplexity checks on text the calibration never saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ColibriError

# assets/ sits beside the `app` package, in the source tree and in an installed wheel alike
PROBES_DIR = Path(__file__).resolve().parents[2] / "assets" / "probes"
HELDOUT_FILE = "heldout.txt"


@dataclass(frozen=True)
class ProbeTopic:
    """One topic's prompts."""

    topic: str                 # short id, the file's stem: "python"
    title: str                 # for people: "Python code"
    prompts: tuple[str, ...]


def load_probes(folder: Path | None = None) -> list[ProbeTopic]:
    """Every topic in FOLDER (default: the shipped probes), sorted by topic id."""
    folder = Path(folder) if folder is not None else PROBES_DIR
    if not folder.is_dir():
        raise ColibriError(f"{folder}: no such probes folder; pass a folder of <topic>.json files")
    topics = [_read_topic(path) for path in sorted(folder.glob("*.json"))]
    if len(topics) < 2:
        raise ColibriError(f"{folder}: {len(topics)} topic file(s); probes need at least two <topic>.json files")
    return topics


def _read_topic(path: Path) -> ProbeTopic:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ColibriError(f"{path}: not a readable JSON file ({exc}); fix or remove it") from None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ColibriError(f'{path}: expected {{"topic": ..., "prompts": ["...", ...]}} with non-empty prompt strings')
    topic = str(data.get("topic") or path.stem)
    return ProbeTopic(topic, str(data.get("title") or topic), tuple(prompts))


def heldout_text(folder: Path | None = None) -> str:
    """The held-out text beside the probes (not produced from them); the shipped one if FOLDER has none."""
    path = Path(folder) / HELDOUT_FILE if folder is not None else PROBES_DIR / HELDOUT_FILE
    if not path.is_file():
        path = PROBES_DIR / HELDOUT_FILE
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ColibriError(f"{path}: cannot read the held-out text ({exc}); reinstall Colibri") from None
