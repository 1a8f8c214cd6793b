"""The real SmolLM2-135M-Instruct (Q4_1 GGUF): logits against transformers, the chat answer, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine.generation.generate import GenerationRequest, stream_generate
from engine.kv import KVCache
from engine.loader import load_model
from support.reference import relative_error

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return load_model(smollm2_gguf)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """transformers' own reading of the same GGUF (its dequantization, its un-permutation)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_spec_from_gguf_metadata(smol):
    s = smol.spec
    assert (s.architecture, s.n_layers, s.hidden_size, s.vocab_size) == ("LlamaForCausalLM", 30, 576, 49152)
    attn = s.layers[0].attn
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.rope.theta) == (9, 3, 64, 100000.0)
    assert s.tie_embeddings and s.layers[0].ffn.intermediate == 1536
    assert 2 in smol.stop_ids  # <|im_end|>


@pytest.mark.slow
@pytest.mark.parity
def test_prompt_logits_match_transformers(smol, reference):
    import torch

    ids = smol.tokenizer.encode_chat(QUESTION, add_generation_prompt=True)
    ours = smol.model.forward(ids, KVCache(smol.spec, 128), all_logits=True)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0].numpy()
    assert relative_error(ours, ref) < 1e-4


def test_chat_answer_names_paris(smol):
    ids = smol.tokenizer.encode_chat(QUESTION, add_generation_prompt=True)
    request = GenerationRequest(prompt=tuple(ids), max_tokens=30)
    done = list(stream_generate(smol.model, smol.tokenizer, request, stop_ids=smol.stop_ids))[-1]
    assert done.finish_reason == "stop"
    assert "Paris" in done.text


def _colibri(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_run_json(smollm2_gguf, tmp_path):
    out = tmp_path / "logits.npy"
    proc = _colibri("run", str(smollm2_gguf), "--prompt", QUESTION[0]["content"], "--chat", "--json",
                    "--logits-out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert "Paris" in result["text"]
    assert set(result) >= {"tokens", "text", "prompt_tokens", "stats"}
    assert set(result["stats"]) == {"prompt_tok_s", "decode_tok_s", "ttft_s"}
    assert all(v > 0 for v in result["stats"].values())
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (result["prompt_tokens"], 49152)
    # the first generated token is the argmax of the saved last row (greedy)
    assert result["tokens"][0] == int(logits[-1].argmax())
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


@pytest.mark.slow
def test_cli_run_tokens_and_streaming_text(smollm2_gguf):
    proc = _colibri("run", str(smollm2_gguf), "--tokens", "504,3575,282", "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 5 and json.loads(proc.stdout)["prompt_tokens"] == 3
    proc = _colibri("run", str(smollm2_gguf), "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "20")
    assert proc.returncode == 0 and "Paris" in proc.stdout
    assert "tok/s" in proc.stderr


@pytest.mark.slow
def test_cli_errors_are_clear(smollm2_gguf, tmp_path):
    proc = _colibri("run", str(smollm2_gguf), "--tokens", "1,x,3")
    assert proc.returncode == 2 and "colibri: error: --tokens" in proc.stderr and "Traceback" not in proc.stderr
    proc = _colibri("run", str(tmp_path / "missing.gguf"), "--prompt", "hi")
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
    proc = _colibri("run", str(smollm2_gguf), "--prompt", "hi", "--top-p", "2")
    assert proc.returncode == 2 and "top_p" in proc.stderr
