"""`colibri synth`: random checkpoints that transformers and Colibri read alike, with a working tokenizer."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from app import cli
from app.bench.synth import (
    SHAPES,
    config_for,
    corpus_lines,
    plan_checkpoint,
    tensor_chunk,
    write_checkpoint,
)
from engine.errors import ColibriError
from support.reference import load_reference, reference_logits, relative_error

SMALL = ["mixtral-tiny", "olmoe-tiny", "llama-tiny", "glm4-moe-tiny", "glm5-tiny", "gpt-oss-tiny"]
IDS = [1, 5, 300, 17, 900, 42, 7, 1000, 3]
SENTENCES = [
    "Hello world!",
    "def area(r):\n    return 3.14159 * r ** 2  # a circle",
    "  two  spaces,\ttabs and\nnew lines ",
    "naïve café, 日本語 and an emoji 🙂",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    """A slice of the default training text, read once."""
    return corpus_lines(40_000)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> dict[str, Path]:
    """Each small shape written once in float32."""
    root = tmp_path_factory.mktemp("synth")
    for name in SMALL:
        write_checkpoint(name, root / name, dtype="f32", seed=1, corpus=corpus)
    return {name: root / name for name in SMALL}


@pytest.mark.parity
@pytest.mark.parametrize("name", SMALL)
def test_small_shape_matches_transformers(folders: dict[str, Path], name: str) -> None:
    from engine.kv import KVCache
    from engine.loader import load_model

    loaded = load_model(folders[name])
    ours = loaded.model.forward(IDS, KVCache(loaded.spec, 64), all_logits=True)
    ref = reference_logits(load_reference(folders[name]), IDS)
    assert ours.shape == ref.shape == (len(IDS), SHAPES[name].config["vocab_size"])
    assert relative_error(ours, ref) < 1e-4


@pytest.mark.parity
def test_bf16_sharded_checkpoint_loads_alike(tmp_path: Path, corpus: list[str]) -> None:
    from engine.kv import KVCache
    from engine.loader import load_model

    out = tmp_path / "mixtral-bf16"
    plan = write_checkpoint("mixtral-tiny", out, corpus=corpus, shard_bytes=1 << 20)  # default dtype: bf16
    assert plan.sharded and len(plan.files) >= 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {t.name for t in plan.tensors}
    assert index["metadata"]["total_size"] == plan.nbytes == sum((out / f).stat().st_size for f in plan.files) \
        - sum(_header_size(out / f) for f in plan.files)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_model(out)
    ours = loaded.model.forward(IDS, KVCache(loaded.spec, 64), all_logits=True)
    assert relative_error(ours, reference_logits(load_reference(out), IDS)) < 1e-4


def _header_size(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


@pytest.mark.parity
@pytest.mark.parametrize("name", list(SHAPES))
def test_config_round_trips_through_autoconfig(tmp_path: Path, name: str) -> None:
    from transformers import AutoConfig

    ours = config_for(SHAPES[name], "bf16")
    (tmp_path / "config.json").write_text(json.dumps(ours))
    cfg = AutoConfig.from_pretrained(tmp_path)
    # a vision-language family's text model has its own config class (Qwen3_5MoeTextConfig)
    assert type(cfg).__name__ in {ours["architectures"][0].replace("ForCausalLM", suffix)
                                  for suffix in ("Config", "TextConfig")}
    cfg.save_pretrained(tmp_path / "again")
    theirs = json.loads((tmp_path / "again" / "config.json").read_text())
    theirs.pop("transformers_version")
    ours.pop("transformers_version")
    assert theirs == ours


def test_written_config_is_the_plan(folders: dict[str, Path]) -> None:
    for name, folder in folders.items():
        assert json.loads((folder / "config.json").read_text()) == config_for(SHAPES[name], "f32")
        assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parity
@pytest.mark.parametrize("name", SMALL)
def test_tokenizer_json_agrees_with_sentencepiece(folders: dict[str, Path], name: str) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    folder = folders[name]
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ours = Tokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert sp.get_piece_size() == ours.vocab_size == SHAPES[name].config["vocab_size"]
    assert (ours.bos_token_id, ours.eos_token_id) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    for text in SENTENCES:
        ids = sp.encode(text)
        assert ours.encode(text) == [sp.bos_id(), *ids] == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.decode(ids) == sp.decode(ids) == text


def test_big_shapes_counted_without_writing() -> None:
    mixtral = plan_checkpoint("mixtral-1.7b")
    h, layers, experts, ffn, vocab = 1024, 16, 64, 512, 32000
    attn = h * 16 * 64 * 4                              # q, k, v, o: 16 heads of 64, as many KV heads
    per_layer = attn + 2 * h + experts * h + experts * 3 * h * ffn
    assert mixtral.total_params == layers * per_layer + 2 * vocab * h + h == 1_744_339_968
    assert mixtral.active_params == mixtral.total_params - layers * (experts - 8) * 3 * h * ffn == 335_053_824
    assert mixtral.nbytes == 2 * mixtral.total_params
    assert len(mixtral.files) == 2 and mixtral.sharded

    olmoe = plan_checkpoint("olmoe-7b")
    h, ffn, vocab = 2048, 1024, 50304
    per_layer = 4 * h * h + 2 * h + 2 * h + experts * h + experts * 3 * h * ffn   # q/k norms over all heads
    assert olmoe.total_params == 16 * per_layer + 2 * vocab * h + h == 6_919_161_856
    assert round(olmoe.active_params / 1e9, 2) == 1.28    # OLMoE-1B-7B: "1B active, 7B total"
    assert len(olmoe.files) == 7

    for plan in (mixtral, olmoe):
        per_file: dict[str, int] = {}
        for t in plan.tensors:
            assert t.offset == per_file.get(t.file, 0)     # contiguous inside each file
            per_file[t.file] = t.offset + t.nbytes
        assert max(per_file.values()) <= 2_000_000_000
        assert sum(per_file.values()) == plan.nbytes
        names = [t.name for t in plan.tensors]
        assert len(names) == len(set(names))
        assert all(t.init == "ones" for t in plan.tensors if t.name.endswith("norm.weight"))


def test_glm5_256e_counted_without_writing() -> None:
    from engine.spec import MLASpec, MoESpec

    plan = plan_checkpoint("glm5-256e")
    moe = [layer.ffn for layer in plan.spec.layers if isinstance(layer.ffn, MoESpec)]
    assert len(moe) == 5 and len(plan.spec.layers) == 6
    assert all((m.n_experts, m.top_k) == (256, 8) for m in moe)
    assert all(isinstance(layer.attn, MLASpec) and layer.attn.indexer is not None for layer in plan.spec.layers)
    h, ffn = 1024, 256
    experts = [t for t in plan.tensors if ".mlp.experts." in t.name]
    assert len(experts) == 5 * 256 * 3                    # gate, up, down of every routed expert
    assert sum(t.size for t in experts) == 5 * 256 * 3 * h * ffn
    assert plan.total_params - plan.active_params == 5 * (256 - 8) * 3 * h * ffn
    assert 2e9 < plan.nbytes == 2 * plan.total_params < 4e9          # a few GB in bf16
    assert len(plan.files) == 2 and max(t.offset + t.nbytes for t in plan.tensors) <= 2_000_000_000


def test_gpt_oss_experts_are_stored_fused() -> None:
    plan = plan_checkpoint("gpt-oss-tiny", "f32")
    names = {t.name: t.shape for t in plan.tensors}
    e, h, i = 8, 128, 128
    assert names["model.layers.0.mlp.experts.gate_up_proj"] == (e, h, 2 * i)
    assert names["model.layers.0.mlp.experts.down_proj_bias"] == (e, h)
    assert names["model.layers.0.mlp.router.weight"] == (e, h)
    assert not any(".experts.0." in n or ".mlp.gate." in n for n in names)
    routed = 4 * e * (2 * h * i + 2 * i + i * h + h)      # fused weights and biases of 4 layers
    assert plan.total_params - plan.active_params == routed * (e - 2) // e


def test_weights_are_seeded_normal_and_independent_of_layout() -> None:
    t = next(t for t in plan_checkpoint("mixtral-tiny", "f32").tensors if t.name == "model.embed_tokens.weight")
    a = np.frombuffer(tensor_chunk(t, 0, seed=3, dtype="f32"), np.float32)
    assert a.size == t.size and abs(a.std() - 0.02) < 1e-3 and abs(a.mean()) < 1e-3
    assert np.array_equal(a, np.frombuffer(tensor_chunk(t, 0, seed=3, dtype="f32"), np.float32))
    assert not np.array_equal(a, np.frombuffer(tensor_chunk(t, 0, seed=4, dtype="f32"), np.float32))
    bf16 = np.frombuffer(tensor_chunk(t, 0, seed=3, dtype="bf16"), np.uint16)
    widened = (bf16.astype(np.uint32) << 16).view(np.float32)
    assert np.abs(widened - a).max() <= np.abs(a).max() * 2.0 ** -8    # the same values, rounded


def test_same_seed_same_folder(tmp_path: Path, corpus: list[str]) -> None:
    for name in ("a", "b"):
        write_checkpoint("llama-tiny", tmp_path / name, seed=7, corpus=corpus)
    write_checkpoint("llama-tiny", tmp_path / "c", seed=8, corpus=corpus)
    for file in (tmp_path / "a").iterdir():
        assert file.read_bytes() == (tmp_path / "b" / file.name).read_bytes(), file.name
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == (tmp_path / "c" / "tokenizer.model").read_bytes()


def test_interrupted_synth_leaves_nothing(tmp_path: Path, corpus: list[str]) -> None:
    def interrupt(done: int, total: int, what: str) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    out = tmp_path / "model"
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint("mixtral-tiny", out, corpus=corpus, progress=interrupt, shard_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ColibriError, match="already exists"):
        write_checkpoint("llama-tiny", tmp_path / "taken")


def test_missing_sentencepiece_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes `import sentencepiece` fail
    with pytest.raises(ColibriError, match=r"pip install 'colibri\[bench\]'"):
        write_checkpoint("llama-tiny", tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_cli_list_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["synth", "--list"]) == 0
    out = capsys.readouterr().out
    for name in SHAPES:
        assert name in out
    assert "1.744 B params" in out and "6.919 B params" in out
    assert cli.main(["synth", "no-such-shape", "somewhere"]) == 2
    assert "colibri: error: unknown shape 'no-such-shape'" in capsys.readouterr().err
    assert cli.main(["synth", "llama-tiny"]) == 2
    assert "give a SHAPE and an OUT folder" in capsys.readouterr().err
    assert cli.main(["synth", "llama-tiny", "x", "--dtype", "f8"]) == 2
    assert "--dtype 'f8'" in capsys.readouterr().err


def test_cli_writes_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["synth", "llama-tiny", str(tmp_path / "m"), "--dtype", "f16", "--seed", "5"]) == 0
    err = capsys.readouterr().err
    assert "synth llama-tiny: 100%" in err and "wrote" in err
    files = {p.name for p in (tmp_path / "m").iterdir()}
    assert files == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
                     "tokenizer.json", "tokenizer_config.json"}
    assert math.isclose(plan_checkpoint("llama-tiny", "f16").nbytes,
                        (tmp_path / "m" / "model.safetensors").stat().st_size, rel_tol=0.01)
