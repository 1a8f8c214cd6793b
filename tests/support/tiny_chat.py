"""Tiny random chat models for the service and GUI tests: a Mixtral-style MoE with a character
tokenizer and a chat template, as a Hugging Face folder and as a streaming container."""

from __future__ import annotations

import json
from pathlib import Path

from support.reference import build_checkpoint

VOCAB = 160
N_EXPERTS, TOP_K, LAYERS = 8, 2, 3
EOS_ID = 0              # "<eos>"
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
# one character per id: every id the model can sample decodes to text
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}-+*/=<>_#\n"
CHARS += "".join(chr(c) for c in range(0xC0, 0xC0 + VOCAB - 1 - len(CHARS)))


def add_chat_tokenizer(folder: Path) -> Path:
    """Give a checkpoint a character tokenizer (one piece per vocabulary id) and a chat template."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<eos>": EOS_ID, **{c: i + 1 for i, c in enumerate(CHARS)}}
    assert len(vocab) == VOCAB
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    tokenizer.add_special_tokens(["<eos>"])
    tokenizer.decoder = decoders.Fuse()  # pieces join without spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "unk_token": "<eos>", "chat_template": CHAT_TEMPLATE}))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = EOS_ID
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_moe(folder: Path, **overrides) -> Path:
    """A random Mixtral (8 experts, top-2, 3 layers, hidden 64) that can chat, and never ends an answer greedily.

    The output row of <eos> is zeroed: its logit is 0 while the likeliest of the 159 others is positive,
    so greedy answers run to max_tokens (tests of streaming and Stop need long answers).
    """
    from safetensors.numpy import load_file, save_file

    kw = dict(num_local_experts=N_EXPERTS, num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS, vocab_size=VOCAB,
              max_position_embeddings=2048, eos_token_id=EOS_ID, tie_word_embeddings=False)
    build_checkpoint(folder, "mixtral", **{**kw, **overrides})
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"][EOS_ID] = 0.0
    save_file(tensors, weights, metadata={"format": "pt"})
    return add_chat_tokenizer(folder)


def tiny_container(src: Path, out: Path) -> Path:
    """SRC converted to a 4-bit container, whose experts stream."""
    from app.hub.convert import ConvertSettings, convert

    return convert(src, out, ConvertSettings(bits=4), log=lambda m: None)


def tiny_models(root: Path) -> tuple[Path, Path]:
    """(Hugging Face folder, container) of the tiny chat MoE under root, built on the first call only.

    Test modules share one pair per pytest run (pass the session's base temp folder).
    """
    src, container = root / "tiny-chat-moe", root / "tiny-chat-moe-q4"
    if not (src / "tokenizer.json").is_file():
        src.mkdir(parents=True, exist_ok=True)
        tiny_moe(src)
    if not (container / "manifest.json").is_file():
        tiny_container(src, container)
    return src, container
