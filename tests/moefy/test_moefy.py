"""colibri moefy: parity of the upcycled checkpoint with transformers, equality with the dense model
without perturbation, seeded determinism, routers, refusals, atomic output, the default model, and
one end-to-end run on SmolLM2 with the perplexity and balance bounds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import app.hub.pull as pull_mod
from app.moefy.router import fit_router, route_top_k
from app.moefy.upcycle import MoefyCancelled, MoefyOptions, format_report, moefy
from app.moefy.write import f32_to_bf16, mixtral_config, write_weights
from engine.errors import ColibriError
from engine.formats.hf import SafetensorsFolder
from engine.kv import KVCache
from engine.loader import load_model
from support.moefy import add_char_tokenizer, tiny_probes
from support.reference import build_checkpoint, load_reference, reference_logits, relative_error

IDS = [5, 17, 42, 8, 99, 3, 64, 120, 7, 33, 58, 90, 11, 140, 2, 75]



def tiny_dense(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama with a character tokenizer."""
    return add_char_tokenizer(build_checkpoint(folder, "llama", seed=seed, **overrides))


def tiny_options(probes: Path, **kw) -> MoefyOptions:
    base = dict(experts=4, top_k=1, dtype="float32", calib_prompts=3, heldout_prompts=2, answer_tokens=8, probes=probes)
    return MoefyOptions(**{**base, **kw})


def colibri_logits(folder: Path, ids: list[int] = IDS) -> np.ndarray:
    loaded = load_model(folder)
    return loaded.model.forward(ids, KVCache(loaded.spec, 64), all_logits=True)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return tiny_dense(tmp_path_factory.mktemp("dense") / "llama")


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Path:
    return tiny_probes(tmp_path_factory.mktemp("probes") / "probes")


@pytest.mark.parity
@pytest.mark.parametrize("top_k", [1, 2])
def test_transformers_and_colibri_agree_on_the_upcycled_model(tmp_path, dense, probes, top_k):
    out = tmp_path / "moe"
    report = moefy(dense, out, tiny_options(probes, top_k=top_k))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    assert config["num_experts_per_tok"] == top_k
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert json.loads((out / "moefy_report.json").read_text()) == report
    ours = colibri_logits(out)
    ref = reference_logits(load_reference(out), IDS)
    assert relative_error(ours, ref) < 1e-4


def test_without_perturbation_the_moe_is_the_dense_model_whatever_the_router(tmp_path, dense, probes):
    out = tmp_path / "moe"
    moefy(dense, out, tiny_options(probes, noise=0.0))
    want = colibri_logits(dense)
    np.testing.assert_allclose(colibri_logits(out), want, rtol=0, atol=1e-5 * np.abs(want).max())
    # any router: random ones, top-1 and top-2 (whose weights sum to 1)
    loaded = load_model(dense)
    source = SafetensorsFolder(dense)
    for top_k in (1, 2):
        other = tmp_path / f"random-router-k{top_k}"
        other.mkdir()
        rng = np.random.default_rng(top_k)
        routers = {i: rng.standard_normal((4, loaded.spec.hidden_size)).astype(np.float32) for i in range(loaded.spec.n_layers)}
        (other / "config.json").write_text(json.dumps(mixtral_config(loaded.spec, 4, top_k, "float32")))
        write_weights(other / "model.safetensors", loaded.spec, source, routers, 0.0, 0, "float32", {"format": "pt"})
        np.testing.assert_allclose(colibri_logits(other), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_routing_is_deterministic_for_a_seed(tmp_path, dense, probes):
    def weights_digest(folder: Path) -> str:
        return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()

    moefy(dense, tmp_path / "a", tiny_options(probes, seed=7))
    moefy(dense, tmp_path / "b", tiny_options(probes, seed=7))
    moefy(dense, tmp_path / "c", tiny_options(probes, seed=8))
    assert weights_digest(tmp_path / "a") == weights_digest(tmp_path / "b")
    a, c = SafetensorsFolder(tmp_path / "a"), SafetensorsFolder(tmp_path / "c")
    gate = "model.layers.1.block_sparse_moe.gate.weight"
    np.testing.assert_array_equal(a.load(gate), SafetensorsFolder(tmp_path / "b").load(gate))
    assert not np.array_equal(a.load(gate), c.load(gate))
    # experts are distinct bytes, the same for the same seed
    e0, e1 = (a.load(f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight") for e in (0, 1))
    assert not np.array_equal(e0, e1)


def test_router_reproduces_nearest_centroid_and_balances():
    rng = np.random.default_rng(0)
    common = np.zeros(32)
    common[3] = 20.0  # a large shared direction, as real feed-forward inputs have
    centres = rng.standard_normal((4, 32)) * 3
    sizes = [400, 200, 100, 50]  # uneven clusters
    x = np.concatenate([common + c + 0.3 * rng.standard_normal((n, 32)) for c, n in zip(centres, sizes)]).astype(np.float32)
    labels = np.repeat(np.arange(4), sizes)
    router = fit_router(x, 4, 1, seed=0, balance=False)
    picks = route_top_k(x, router, 1)[:, 0]
    for k in range(4):  # each cluster goes, whole, to one expert of its own
        assert len(set(picks[labels == k])) == 1
    assert len(set(picks)) == 4
    np.testing.assert_array_equal(router, fit_router(x, 4, 1, seed=0, balance=False))
    # balancing evens out the shares of structureless data
    blob = (common + rng.standard_normal((2000, 32))).astype(np.float32)
    shares = np.bincount(route_top_k(blob, fit_router(blob, 8, 2, seed=1), 2).reshape(-1), minlength=8) / 4000
    assert shares.min() > 0.8 / 8 and shares.max() < 1.2 / 8


@pytest.mark.parity
def test_bf16_rounding_matches_torch():
    import torch

    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 10.0 ** np.random.default_rng(1).integers(-8, 8, 10000)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(f32_to_bf16(x), want)


def test_refuses_what_it_cannot_upcycle(tmp_path, probes):
    qwen = add_char_tokenizer(build_checkpoint(tmp_path / "qwen", "qwen2"))
    with pytest.raises(ColibriError, match="Qwen2ForCausalLM; moefy upcycles dense Llama-family models"):
        moefy(qwen, tmp_path / "out", tiny_options(probes))
    mixtral = build_checkpoint(tmp_path / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ColibriError, match="already a Mixture-of-Experts"):
        moefy(mixtral, tmp_path / "out", tiny_options(probes))
    biased = tiny_dense(tmp_path / "biased", attention_bias=True)
    with pytest.raises(ColibriError, match="attention biases"):
        moefy(biased, tmp_path / "out", tiny_options(probes))
    with pytest.raises(ColibriError, match="no model folder or .gguf"):
        moefy(tmp_path / "absent", tmp_path / "out", tiny_options(probes))
    with pytest.raises(ColibriError, match="--top-k 4"):
        moefy(qwen, tmp_path / "out", tiny_options(probes, top_k=4))
    assert not (tmp_path / "out").exists()


def test_output_is_atomic(tmp_path, dense, probes):
    seen = []

    def cancel_while_writing(fraction, message):
        seen.append(message)
        return not message.startswith("writing experts: layer 2")

    with pytest.raises(MoefyCancelled):
        moefy(dense, tmp_path / "moe", tiny_options(probes), cancel_while_writing)
    assert any(m.startswith("calibration chats") for m in seen)
    assert list(tmp_path.iterdir()) == [], "a cancelled moefy leaves nothing behind"
    (tmp_path / "moe").mkdir()
    with pytest.raises(ColibriError, match="already exists"):
        moefy(dense, tmp_path / "moe", tiny_options(probes))


def test_calibration_file(tmp_path, dense, probes):
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    fractions: list[float] = []
    report = moefy(dense, tmp_path / "moe", tiny_options(probes, calib=calib), lambda f, m: fractions.append(f))
    assert fractions == sorted(fractions) and fractions[-1] == 1.0, "progress only goes forward, to the end"
    assert report["calibration"]["source"] == str(calib)
    n = len(calib.read_text())
    assert report["calibration"]["tokens"] == n - -(-n // 512)  # every char but position 0 of each 512-token passage


def test_without_evaluation_the_same_model_is_written_and_its_report_says_so(tmp_path, dense, probes):
    measured = moefy(dense, tmp_path / "measured", tiny_options(probes))
    messages: list[str] = []
    fractions: list[float] = []

    def progress(fraction: float, message: str) -> None:
        fractions.append(fraction)
        messages.append(message)
    report = moefy(dense, tmp_path / "quick", tiny_options(probes, evaluate=False), progress)
    assert measured["perplexity"] is not None and report["perplexity"] is None and report["expert_shares"] is None
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "quick" / name).read_bytes() == (tmp_path / "measured" / name).read_bytes(), name
    assert not any(m.startswith(("held-out", "perplexity")) for m in messages), "nothing is measured"
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert "not measured" in format_report(report)
    assert json.loads((tmp_path / "quick" / "moefy_report.json").read_text())["perplexity"] is None


def test_the_upcycled_model_is_prepared_once(tmp_path, monkeypatch):
    """`smollm2-moe-bf16` is moefy of the pulled SmolLM2, made once (the default model, its 4-bit container, is
    made from it: tests/hub/test_pull.py)."""
    models = tmp_path / "models"
    source = models / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source.parent.mkdir(parents=True)
    source.write_bytes(b"GGUF")
    calls = []

    def fake_moefy(src, out, options, progress):
        calls.append((Path(src), Path(out), options.experts, options.evaluate))
        progress(0.5, "halfway")
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")
        return {"perplexity": {"heldout_text": {"change": 0.001}}}

    monkeypatch.setattr("app.moefy.upcycle.moefy", fake_moefy)
    with pytest.raises(ColibriError, match="run `colibri pull smollm2-moe-bf16` first"):
        pull_mod.resolve_model("smollm2-moe-bf16", models_dir=models)
    lines: list[str] = []
    path = pull_mod.pull("smollm2-moe-bf16", models_dir=models, log=lines.append)
    assert path == models / "smollm2-135m-moe-e8"
    assert calls == [(source, path, 8, False)], "a first run is not kept waiting by the report's measurements"
    assert any("50% halfway" in line for line in lines) and "is ready" in lines[-1]
    assert pull_mod.resolve_model("smollm2-moe-bf16", models_dir=models) == path
    assert pull_mod.pull("smollm2-moe-bf16", models_dir=models, log=lines.append) == path
    assert len(calls) == 1, "prepared once, then reused"


@pytest.mark.slow
def test_smollm2_upcycled_keeps_perplexity_and_balance(tmp_path, smollm2_gguf):
    """The real thing, on a small calibration set: perplexity within 2%, every expert within the share bounds."""
    probes = tiny_probes(tmp_path / "probes", topics=12, prompts=12)
    options = MoefyOptions(probes=probes, calib_prompts=6, heldout_prompts=3, answer_tokens=4)
    report = moefy(smollm2_gguf, tmp_path / "moe", options)
    for name in ("heldout_text", "heldout_chats"):
        assert abs(report["perplexity"][name]["change"]) < 0.02, report["perplexity"]
    chats = report["expert_shares"]["heldout_chats"]
    assert chats["within_bounds"], (chats["min_times_e"], chats["max_times_e"])
    assert len(chats["per_layer"]) == 30 and all(len(row) == 8 for row in chats["per_layer"])
    loaded = load_model(tmp_path / "moe")
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    cache = KVCache(loaded.spec, 128)
    logits = loaded.model.forward(ids, cache)
    answer = []
    for _ in range(8):
        answer.append(int(logits[-1].argmax()))
        logits = loaded.model.forward([answer[-1]], cache)
    assert "Paris" in loaded.tokenizer.decode(answer)
