"""`colibri convert FILE.gguf OUT` without a width keeps the file's K-quant blocks as published: the container holds
the GGUF's bytes and computes the same logits, bit for bit, as running the file directly."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from app.hub.convert import ConvertSettings, convert
from engine.errors import ColibriError
from engine.formats.container import Container
from engine.loader import load_model
from engine.quant import KQuantTensor
from support.gguf_writer import kquant_moe_gguf
from support.offload import greedy_logits

Q = gguf.GGMLQuantizationType
PROMPT = [3, 17, 5, 99, 42, 8, 23, 61]
STEPS = 6
# Qwen3-MoE tensor names in Hugging Face and GGUF (experts: the stack and the expert's index in it)
_DENSE = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output"}
_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """(the GGUF, its container kept as published)."""
    folder = tmp_path_factory.mktemp("gguf")
    path = kquant_moe_gguf(folder)
    return path, convert(path, folder / "container", ConvertSettings(), log=lambda m: None)


def _gguf_bytes(reader: gguf.GGUFReader, name: str) -> tuple[Q, np.ndarray]:
    """(type, bytes) the GGUF file stores for Hugging Face tensor `name` (an expert: its rows of the stack)."""
    tensors = {t.name: t for t in reader.tensors}
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = tensors["token_embd.weight" if "embed" in name else "output.weight"]
        return t.tensor_type, np.asarray(t.data).reshape(-1)
    parts = name.split(".")
    layer, rest = parts[2], ".".join(parts[3:-1])
    if rest.startswith("mlp.experts."):
        e, proj = int(parts[5]), parts[6]
        t = tensors[f"blk.{layer}.{_STACKS[proj]}.weight"]
        data = np.asarray(t.data).reshape(int(t.shape[-1]), -1)      # [E, bytes of one expert]
        return t.tensor_type, data[e]
    t = tensors[f"blk.{layer}.{_DENSE[rest]}.weight"]
    return t.tensor_type, np.asarray(t.data).reshape(-1)


def test_the_container_holds_the_gguf_blocks(kept):
    path, out = kept
    c = Container.open(out)
    reader = gguf.GGUFReader(str(path))
    kinds = {}
    for name in c.names():
        w = c.load(name)
        if isinstance(w, KQuantTensor):
            qtype, data = _gguf_bytes(reader, name)
            assert w.qtype == qtype, name
            assert np.array_equal(w.blocks.reshape(-1), data), name    # the file's blocks, byte for byte
            # the head (and the embedding, which may be tied to it) keeps float activations
            runs16 = w.shape[0] % 16 == 0 and name not in ("lm_head.weight", "model.embed_tokens.weight")
            assert w.layout == ("rows16" if runs16 else "blocks"), name     # in the layout they run in
            kinds[name] = qtype
        else:
            assert isinstance(w, np.ndarray) and w.dtype == np.float32, name   # norms and routers
            assert w.ndim == 1 or name.endswith("mlp.gate.weight"), name
    assert set(kinds.values()) == {Q.Q4_K, Q.Q6_K}                 # a mixed file: each tensor in its own type
    assert all(kinds[n] == Q.Q6_K for n in kinds if "down_proj" in n or "v_proj" in n or n == "lm_head.weight")
    assert len([n for n in kinds if ".experts." in n]) == 2 * 8 * 3
    stored = sum(c.entries[n].length for n in kinds)
    assert stored == sum(int(t.n_bytes) for t in reader.tensors                  # nothing widened or requantized
                         if t.tensor_type in (Q.Q4_K, Q.Q6_K) and "ffn_gate_inp" not in t.name)   # (routers: f32)
    data = sum(p.stat().st_size for p in out.glob("*.bin"))
    assert data <= 1.1 * path.stat().st_size                                    # about the file's size
    assert c.manifest["plan"]["budget"] is None


def test_the_container_gives_the_gguf_logits_bit_for_bit(kept):
    path, out = kept
    direct, container = load_model(path), load_model(out)
    try:
        want, want_tokens = greedy_logits(direct, PROMPT, STEPS)
        got, tokens = greedy_logits(container, PROMPT, STEPS)
    finally:
        direct.close()
        container.close()
    assert tokens == want_tokens
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_folder_still_needs_a_width(tmp_path, kept):
    path, _ = kept
    with pytest.raises(ColibriError, match="give --bits B"):
        convert(path.parent / "hf", tmp_path / "out", ConvertSettings(), log=lambda m: None)
    with pytest.raises(ColibriError, match="--calib plans widths"):
        convert(path, tmp_path / "out", ConvertSettings(calib=path), log=lambda m: None)


def test_cli_converts_a_gguf_without_a_width(kept, tmp_path):
    path, _ = kept
    r = subprocess.run([sys.executable, "-m", "app.cli", "convert", str(path), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "bits per weight" in r.stdout
    assert Container.open(tmp_path / "out").manifest["tensors"]["lm_head.weight"]["quant"]["type"] == "Q6_K"


@pytest.mark.parametrize("field, value, said", [("type", "Q9_K", "not a K-quant or IQ4 type"),
                                                ("bits", 4, "are not those of Q6_K"),
                                                ("group", 32, "are not those of Q6_K")])
def test_a_damaged_k_quant_entry_is_refused(kept, tmp_path, field, value, said):
    import json
    import shutil

    from engine.errors import ModelFormatError

    _, out = kept
    copy = shutil.copytree(out, tmp_path / "c")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tensors"]["lm_head.weight"]["quant"][field] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelFormatError, match=said):
        Container.open(copy)
