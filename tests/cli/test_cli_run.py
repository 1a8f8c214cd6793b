"""`colibri run` on Hugging Face folders: without tokenizer files, and with tokenizer + generation_config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.kv import KVCache
from engine.loader import load_model
from support.reference import build_checkpoint


def _colibri(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300)


def _greedy(folder, prompt, n):
    loaded = load_model(folder)
    cache = KVCache(loaded.spec, 64)
    logits, out = loaded.model.forward(prompt, cache)[-1], []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = loaded.model.forward([out[-1]], cache)[-1]
    return out


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A checkpoint with config.json and weights only."""
    return build_checkpoint(tmp_path_factory.mktemp("bare"), "llama")


def test_tokens_without_tokenizer(bare):
    proc = _colibri("run", str(bare), "--tokens", "1,2,3", "--max-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] == "" and out["prompt_tokens"] == 3
    assert out["tokens"] == _greedy(bare, [1, 2, 3], 4)


def test_prompt_without_tokenizer_says_to_use_tokens(bare):
    proc = _colibri("run", str(bare), "--prompt", "hello")
    assert proc.returncode == 2 and "no tokenizer files" in proc.stderr and "--tokens" in proc.stderr


def test_folder_with_tokenizer_template_and_generation_config(tmp_path, hf_smol):
    """A full folder: the chat template comes from the tokenizer files, EOS ids from generation_config.json."""
    folder = build_checkpoint(tmp_path / "full", "llama", vocab_size=49152)
    hf_smol.save_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected_prompt = hf_smol.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected_prompt = list(expected_prompt["input_ids"] if hasattr(expected_prompt, "keys") else expected_prompt)
    first = _greedy(folder, expected_prompt, 3)

    proc = _colibri("run", str(folder), "--prompt", messages[0]["content"], "--chat", "--json", "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_tokens"] == len(expected_prompt) and out["tokens"] == first
    assert out["text"] == hf_smol.decode(first, skip_special_tokens=True)

    # an EOS id listed in generation_config.json ends generation before the token is emitted
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [first[1], 12345]}))
    proc = _colibri("run", str(folder), "--prompt", messages[0]["content"], "--chat", "--json", "--max-tokens", "3")
    out = json.loads(proc.stdout)
    assert out["tokens"] == first[:1] and out["finish_reason"] == "stop"


def test_system_needs_chat(bare):
    proc = _colibri("run", str(bare), "--tokens", "1", "--system", "be brief")
    assert proc.returncode == 2 and "--system needs --chat" in proc.stderr
