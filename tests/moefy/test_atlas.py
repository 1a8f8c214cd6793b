"""colibri atlas: statistics on hand-made routing logs, the model hash, the sidecar's binding to its
model, cancellation, and a run on a tiny random MoE."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from app.atlas.build import (
    AtlasCancelled,
    AtlasMismatch,
    default_sidecar,
    model_hash,
    read_atlas,
    report_text,
    run_atlas,
)
from app.atlas.probes import load_probes
from app.atlas.stats import expert_stats, explained_variance, positions_3d, specialisation, topic_distribution
from engine.errors import ColibriError
from support.moefy import add_char_tokenizer, tiny_probes
from support.reference import build_checkpoint

TOKENS = np.array([[100, 100], [300, 300], [50, 50]])  # routed tokens per topic and half: unequal on purpose


def log(*experts: list[list[int]]) -> dict[int, np.ndarray]:
    """One layer's counts [E, topics, 2] from per-expert [[half 0 per topic], [half 1 per topic]]."""
    return {0: np.array([np.array(e).T for e in experts])}


def test_statistics_of_a_hand_made_log():
    stats = expert_stats(log(
        [[40, 0, 0], [20, 0, 0]],          # one topic only
        [[10, 30, 5], [10, 30, 5]],        # the same rate (1 in 10) in every topic: uniform
        [[10, 30, 0], [10, 30, 0]],        # two topics at the same rate
        [[0, 0, 0], [0, 0, 0]],            # never chosen
        [[10, 0, 0], [0, 60, 0]],          # topic 0 in one half, topic 1 in the other
    ), TOKENS)
    one, uniform, two, never, flip = stats
    assert one.selections == 60 and one.topic_counts == (60, 0, 0)
    assert one.distribution == (1.0, 0.0, 0.0) and one.specialisation == pytest.approx(1.0)
    assert one.top_topic == 0 and one.reproduces
    assert uniform.distribution == pytest.approx((1 / 3, 1 / 3, 1 / 3)) and uniform.specialisation == pytest.approx(0.0, abs=1e-12)
    assert two.distribution == pytest.approx((0.5, 0.5, 0.0))
    assert two.specialisation == pytest.approx(1 - math.log(2) / math.log(3))
    assert never.selections == 0 and never.top_topic is None and not never.reproduces and never.specialisation == 0
    assert never.distribution == (0.0, 0.0, 0.0)
    # over both halves topic 1 leads (60/600 against 10/200), but the halves disagree
    assert flip.top_topic == 1 and not flip.reproduces
    assert [s.layer for s in stats] == [0] * 5 and [s.expert for s in stats] == [0, 1, 2, 3, 4]


def test_rates_not_raw_counts_decide_the_topic():
    # 30 tokens of a 600-token topic are a lower rate than 20 of a 100-token topic
    p = topic_distribution(np.array([[20.0, 30.0, 0.0]]), np.array([100, 600, 100]))
    np.testing.assert_allclose(p, [[0.8, 0.2, 0.0]])
    np.testing.assert_allclose(specialisation(np.array([[0.25] * 4, [1, 0, 0, 0], [0, 0, 0, 0]])), [0, 1, 0], atol=1e-12)


def test_positions_keep_hellinger_distances():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6), size=4)  # 4 points: their square roots span 3 dimensions once centred
    pos = positions_3d(p)
    roots = np.sqrt(p)
    for i in range(4):
        for j in range(4):
            assert np.linalg.norm(pos[i] - pos[j]) == pytest.approx(np.linalg.norm(roots[i] - roots[j]), abs=1e-9)
    # similar affinities sit closer than different ones; unused experts sit at the uniform place
    q = np.array([[0.9, 0.1, 0, 0], [0.85, 0.15, 0, 0], [0, 0, 0.1, 0.9], [0, 0, 0, 0], [0.25] * 4])
    pos = positions_3d(q)
    assert np.linalg.norm(pos[0] - pos[1]) < 0.2 * np.linalg.norm(pos[0] - pos[2])
    np.testing.assert_allclose(pos[3], pos[4], atol=1e-12)
    np.testing.assert_array_equal(positions_3d(q), pos)  # deterministic, signs included


def test_explained_variance_is_each_axis_share_of_the_spread():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(6) * 0.3, size=40)
    p[5] = 0                                                    # never chosen: at the uniform place, as positioned
    shares, pos = explained_variance(p), positions_3d(p)
    roots = np.sqrt(np.where(p.sum(axis=1, keepdims=True) > 0, p, 1 / 6))
    total = ((roots - roots.mean(axis=0)) ** 2).sum()
    np.testing.assert_allclose(shares, (pos**2).sum(axis=0) / total, atol=1e-12)
    assert 1 > shares[0] >= shares[1] >= shares[2] > 0 and shares.sum() < 1   # six topics: more than 3 axes
    np.testing.assert_allclose(explained_variance(np.array([[0.5, 0.5], [0.9, 0.1]])), [1, 0, 0], atol=1e-12)
    assert (explained_variance(np.full((3, 4), 0.25)) == 0).all() and (explained_variance(np.zeros((0, 4))) == 0).all()


@pytest.mark.slow
def test_model_hash(tmp_path):
    folder = build_checkpoint(tmp_path / "m", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    first = model_hash(folder)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in folder.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    assert model_hash(copy) == first, "the hash names the model, not where it lies"
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte is always sampled
    weights.write_bytes(bytes(data))
    assert model_hash(copy) != first
    config = json.loads((folder / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert len({first, model_hash(copy)}) == 2
    with pytest.raises(ColibriError, match="no weight files"):
        model_hash(tmp_path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("atlas") / "moe"
    return add_char_tokenizer(build_checkpoint(folder, "mixtral", num_local_experts=4, num_experts_per_tok=2))


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Path:
    return tiny_probes(tmp_path_factory.mktemp("atlas-probes") / "probes", topics=3, prompts=4)


@pytest.mark.slow
def test_atlas_of_a_tiny_moe_is_bound_to_its_model(tmp_path, moe, probes):
    seen = []
    sidecar, atlas = run_atlas(moe, tmp_path / "atlas.json", probes, lambda f, m: seen.append(f))
    assert seen[-1] == 1.0 and seen == sorted(seen)
    assert read_atlas(sidecar, moe) == atlas == json.loads(sidecar.read_text())
    assert atlas["model_hash"] == model_hash(moe) and len(atlas["layers"]) == 3
    topics = load_probes(probes)
    tokens = sum(sum(t["tokens"]) for t in atlas["probes"]["topics"])
    # each routed token chose top-2 of 4 experts, in every layer
    assert tokens == sum(len(p) - 1 for t in topics for p in t.prompts)  # characters, less position 0
    for layer in atlas["layers"]:
        experts = layer["experts"]
        assert [x["expert"] for x in experts] == [0, 1, 2, 3]
        assert sum(x["selections"] for x in experts) == 2 * tokens
        assert all(len(x["position"]) == 3 and len(x["topic_distribution"]) == 3 for x in experts)
    shares = atlas["explained_variance"]                    # three topics: three axes carry all of the spread
    assert len(shares) == 3 and sum(shares) == pytest.approx(1, abs=1e-5) and shares == sorted(shares, reverse=True)
    assert "most specialised experts per topic" in report_text(atlas)
    # another model: its atlas is refused, and run_atlas will not overwrite this one with it
    other = add_char_tokenizer(build_checkpoint(tmp_path / "other", "mixtral", seed=1, num_local_experts=4,
                                                num_experts_per_tok=2))
    with pytest.raises(AtlasMismatch, match="belongs to another model"):
        read_atlas(sidecar, other)
    with pytest.raises(AtlasMismatch, match="belongs to another model"):
        run_atlas(other, sidecar, probes)
    assert read_atlas(sidecar, moe) == atlas
    assert default_sidecar(moe) == moe / "atlas.json"
    assert default_sidecar(tmp_path / "m.gguf") == tmp_path / "m.gguf.atlas.json"


def test_atlas_can_be_cancelled_and_refuses_dense_models(tmp_path, moe, probes):
    with pytest.raises(AtlasCancelled):
        run_atlas(moe, tmp_path / "atlas.json", probes, lambda f, m: not m.startswith("probes"))
    assert not list(tmp_path.iterdir()), "a cancelled atlas writes nothing"
    dense = add_char_tokenizer(build_checkpoint(tmp_path / "dense", "llama"))
    with pytest.raises(ColibriError, match="dense model .* no experts"):
        run_atlas(dense, tmp_path / "atlas.json", probes)


def test_cli_atlas(tmp_path, moe, probes, capsys):
    from app.cli import main

    assert main(["atlas", str(moe), "--out", str(tmp_path / "a.json"), "--probes", str(probes)]) == 0
    out = capsys.readouterr().out
    assert "atlas of moe: 3 MoE layers, 12 experts, 3 topics" in out and f"wrote {tmp_path / 'a.json'}" in out


@pytest.mark.slow
def test_a_container_is_identified_by_its_manifest_hash(tmp_path, moe):
    from app.atlas.build import model_hash
    from app.hub.convert import ConvertSettings, convert
    from engine.formats.container import Container

    out = convert(moe, tmp_path / "q4", ConvertSettings(bits=4), log=lambda m: None)
    assert model_hash(out) == Container.open(out, verify=False).model_hash
    assert model_hash(out) != model_hash(moe)
