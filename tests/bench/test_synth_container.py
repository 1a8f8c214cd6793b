"""`colibri synth SHAPE OUT --bits B`: a quantized container written directly, as `colibri convert` writes one."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from app import cli
from app.bench.synth import (
    SHAPES,
    container,
    corpus_lines,
    plan_checkpoint,
    plan_container,
    write_checkpoint,
    write_container,
)
from engine.errors import DiskFullError
from engine.formats.container import Container
from engine.formats.manifest import check_manifest
from engine.quant import BITS, QuantizedTensor

PROMPT = [1, 5, 300, 17, 900, 42, 7, 1000, 3]

# Published parameter counts (model cards), in billions
PUBLISHED = {"qwen3-30b-a3b": 30.5, "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8, "glm-4.5-air": 106.0,
             "qwen2.5-32b": 32.8, "glm-5": 744.0, "minimax-m2": 230.0, "granite-3.0-3b-a800m": 3.3,
             "phi-3.5-moe": 41.9, "deepseek-v2-lite": 15.7, "deepseek-v2": 236.0, "qwen3-next-80b-a3b": 80.0,
             "qwen3.5-35b-a3b": 35.0}


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    """A slice of the default tokenizer text, read once."""
    return corpus_lines(20_000)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """mixtral-tiny at 4 bits, written once."""
    out = tmp_path_factory.mktemp("c") / "mixtral-tiny-q4"
    write_container("mixtral-tiny", out, bits=4, seed=3, corpus=corpus)
    return out


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_have_their_published_parameter_counts(name: str) -> None:
    plan = plan_checkpoint(name)
    assert abs(plan.total_params / 1e9 / PUBLISHED[name] - 1) < 0.01
    assert 0 < plan.active_params < plan.total_params or name == "qwen2.5-32b"


def test_layers_keeps_each_layers_published_shapes() -> None:
    full, cut = plan_checkpoint("glm-5"), plan_checkpoint("glm-5", layers=5)
    assert cut.spec.n_layers == 5 and cut.config["num_hidden_layers"] == 5
    assert len(cut.config["mlp_layer_types"]) == len(cut.config["indexer_types"]) == 5
    shapes = {t.name: t.shape for t in full.tensors}
    layer_tensors = [t for t in cut.tensors if t.name.startswith("model.layers.")]
    assert layer_tensors and all(shapes[t.name] == t.shape for t in layer_tensors)
    assert {t.name for t in cut.tensors} - {t.name for t in layer_tensors} == \
        {t.name for t in full.tensors if not t.name.startswith("model.layers.")}


@pytest.mark.parametrize("bits", BITS)
def test_generated_matrices_are_valid_and_have_a_trained_models_scale(bits: int) -> None:
    """Every generated buffer holds what its format allows, and the weights have std 0.02 and mean about 0."""
    from concurrent.futures import ThreadPoolExecutor

    shape = (64, 1024)
    with ThreadPoolExecutor(1) as pool:
        gen = container._GeneratedQuant(pool, "w", shape, bits, 32, seed=0, std=0.02)
        meta, buffers = gen.to_buffers()
        arrays = {k: np.concatenate([np.asarray(c).reshape(-1) for c in b.chunks()]).view(b.dtype).reshape(b.shape)
                  for k, b in buffers.items()}
    w = QuantizedTensor.from_buffers(meta, arrays).dequantize()
    assert w.shape == shape
    assert abs(w.std() / 0.02 - 1) < 0.05
    assert abs(w.mean()) < 0.02 * 0.05


@pytest.mark.parametrize("name", ["mixtral-tiny", "glm5-tiny", "gpt-oss-tiny"])
def test_container_is_the_one_convert_writes(tmp_path: Path, corpus: list[str], name: str) -> None:
    """Same manifest as `colibri convert --bits 4` of the shape's bf16 checkpoint: every entry, buffer table,
    expert extent and the plan; only the random bytes (checksums) and the source differ."""
    from app.hub.convert import ConvertSettings, convert

    write_checkpoint(name, tmp_path / "bf16", seed=1, corpus=corpus)
    convert(tmp_path / "bf16", tmp_path / "converted", ConvertSettings(bits=4), log=lambda m: None)
    write_container(name, tmp_path / "synth", bits=4, corpus=corpus)
    ours = json.loads((tmp_path / "synth" / "manifest.json").read_text())
    theirs = json.loads((tmp_path / "converted" / "manifest.json").read_text())
    check_manifest(ours, "manifest.json")

    def strip(entries: list[dict]) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "crc32"} for e in entries]

    assert ours.keys() == theirs.keys()
    assert ours["config"] == theirs["config"] and ours["plan"] == theirs["plan"]
    assert list(ours["tensors"]) == list(theirs["tensors"])
    assert strip(list(ours["tensors"].values())) == strip(list(theirs["tensors"].values()))
    assert strip(ours["experts"]) == strip(theirs["experts"])
    for f in ("dense.bin", "experts-00000.bin"):
        assert (tmp_path / "synth" / f).stat().st_size == (tmp_path / "converted" / f).stat().st_size


def _greedy(out: Path, capsys: pytest.CaptureFixture, *extra: str) -> list[int]:
    capsys.readouterr()
    code = cli.main(["run", str(out), "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", "12", "--json",
                     "--ctx", "64", "--no-history", *extra])
    assert code == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]


def test_runs_resident_and_streamed_alike(tiny: Path, capsys: pytest.CaptureFixture) -> None:
    from engine.kv import KVCache
    from engine.loader import OffloadOptions, load_model
    from engine.offload.store import StoreSettings

    Container.open(tiny)                       # the manifest validates, its hash and every checksum match
    resident = _greedy(tiny, capsys)
    assert resident == _greedy(tiny, capsys, "--max-memory", "12MB")
    assert len(set(resident)) > 1
    # and streamed through a cache of a few experts: what is read from disk gives the same tokens
    probe = load_model(tiny, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    slot = probe.store.slot_bytes
    probe.close()
    loaded = load_model(tiny, offload=OffloadOptions(StoreSettings(capacity=3 * slot, policy="lru"), 0))
    try:
        cache, tokens = KVCache(loaded.spec, 64), []
        token = int(loaded.model.forward(PROMPT, cache)[-1].argmax())
        for _ in range(12):
            tokens.append(token)
            token = int(loaded.model.forward([token], cache)[-1].argmax())
        stats = loaded.store.stats()
    finally:
        loaded.close()
    assert tokens == resident
    assert stats.hits.get("disk", 0) > len(Container.open(tiny, verify=False).extents)   # read, and read again


def test_same_seed_same_bytes(tmp_path: Path, tiny: Path, corpus: list[str]) -> None:
    write_container("mixtral-tiny", tmp_path / "again", bits=4, seed=3, corpus=corpus)
    write_container("mixtral-tiny", tmp_path / "other", bits=4, seed=4, corpus=corpus)
    for f in ("manifest.json", "dense.bin", "experts-00000.bin", "tokenizer.json"):
        assert (tmp_path / "again" / f).read_bytes() == (tiny / f).read_bytes()
    assert (tmp_path / "other" / "experts-00000.bin").read_bytes() != (tiny / "experts-00000.bin").read_bytes()


def test_an_interrupted_write_resumes_to_the_same_bytes(tmp_path: Path, tiny: Path, corpus: list[str]) -> None:
    out = tmp_path / "m"
    calls = []

    def stop(done: int, total: int, what: str) -> None:
        calls.append(what)
        if "layer 1" in what:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_container("mixtral-tiny", out, bits=4, seed=3, corpus=corpus, progress=stop)
    assert not out.exists() and (tmp_path / "m.partial").is_dir()
    write_container("mixtral-tiny", out, bits=4, seed=3, corpus=corpus)
    assert not (tmp_path / "m.partial").exists()
    for f in ("manifest.json", "dense.bin", "experts-00000.bin"):
        assert (out / f).read_bytes() == (tiny / f).read_bytes()


def test_too_little_disk_is_refused_before_writing(tmp_path: Path, corpus: list[str], monkeypatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(container.shutil, "disk_usage", lambda p: usage._replace(free=1 << 20))
    with pytest.raises(DiskFullError, match="needs"):
        write_container("mixtral-tiny", tmp_path / "m", bits=4, corpus=corpus)
    assert list(tmp_path.iterdir()) == []


def test_writing_holds_a_fixed_working_set(tmp_path: Path, corpus: list[str], monkeypatch) -> None:
    """A 2-layer slice of mixtral-1.7b (about 100 MB at 4 bits) is written with a Python peak of a few chunks."""
    monkeypatch.setattr(container, "GEN_BYTES", 256 << 10)
    cplan = plan_container("mixtral-1.7b", 4, layers=2)
    write_container("llama-tiny", tmp_path / "warm", bits=4, corpus=corpus)      # imports and compiles first
    tracemalloc.start()
    try:
        write_container("mixtral-1.7b", tmp_path / "m", bits=4, layers=2, corpus=corpus[:4000])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    written = sum(p.stat().st_size for p in (tmp_path / "m").glob("*.bin"))
    assert written >= cplan.nbytes > 90e6
    assert peak < written / 5, f"peak {peak / 1e6:.1f} MB while writing {written / 1e6:.0f} MB"


def test_cli_writes_a_container(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["synth", "llama-tiny", str(tmp_path / "d"), "--bits", "8", "--group", "64", "--layers", "2"]) == 0
    c = Container.open(tmp_path / "d")
    assert c.config["num_hidden_layers"] == 2
    q = c.load("model.layers.1.mlp.down_proj.weight")
    assert (q.bits, q.group) == (8, 64)
    assert "bits per weight" in capsys.readouterr().err


def test_shapes_list_names_the_releases() -> None:
    for name in PUBLISHED:
        assert "release" in SHAPES[name].summary
