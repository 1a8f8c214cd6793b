"""The reference side of parity tests: tiny random transformers checkpoints and their outputs.

Checkpoints are built with `AutoModelForCausalLM.from_config`, given non-trivial norms, biases (DeltaNet's
`dt_bias` too), router biases and attention sinks (so that a block that ignores them fails), saved with
`save_pretrained` and then read back from disk by both sides: Colibri reads the files, never torch's memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

BASE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=160, initializer_range=0.1, max_position_embeddings=512,
)


def build_checkpoint(folder: Path, model_type: str, seed: int = 0, dtype: str = "float32",
                     shard_size: str | None = None, base: dict | None = None, **overrides) -> Path:
    """Save a random model of `model_type` (BASE, or `base` for a config whose sizes sit elsewhere such as a
    vision-language one's `text_config`, updated with overrides) into `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**(BASE if base is None else base), **overrides})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith((".bias", "_proj_bias", "e_score_correction_bias")):   # gpt-oss's fused expert
                # biases start at zero; ERNIE keeps its router bias as a parameter
                p.normal_(0.0, 0.2)
            elif name.endswith((".sinks", ".dt_bias")):          # gpt-oss's sinks: large enough to move the softmax;
                                                                 # DeltaNet's dt_bias starts as ones: vary it per head
                p.normal_(0.0, 1.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.2)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def load_reference(folder: Path):
    """The saved checkpoint as transformers reads it, in float32 with plain (eager) attention."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of a full forward pass."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full recomputation over the whole sequence (no cache)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(reference_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude.

    With PARITY_LOG set to a file, each value is appended there as a JSON line with the test that
    measured it, so that a run of the parity tests yields the table of errors by family."""
    error = float(np.abs(ours - ref).max() / np.abs(ref).max())
    if log := os.environ.get("PARITY_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "error": error}) + "\n")
    return error


def assert_matches_reference(folder: Path, prompt: list[int], n_greedy: int = 32, *, architecture: str | None = None):
    """The parity check every family's test makes: Colibri reads `folder` as transformers does (its
    architecture, or `architecture`), its prompt logits are within 1e-4 of the reference's largest, and
    its `n_greedy` greedy tokens, decoded through the KV cache, are the reference's recomputed ones.

    Returns (loaded model, reference model, reference prompt logits) for checks of the family's own.
    """
    from engine.kv import KVCache
    from engine.loader import load_model

    ref = load_reference(folder)
    loaded = load_model(folder)
    assert loaded.spec.architecture == (architecture or ref.config.architectures[0])
    cache = KVCache(loaded.spec, 256)
    ours = loaded.model.forward(prompt, cache, all_logits=True)
    expected = reference_logits(ref, prompt)
    assert ours.shape == expected.shape
    assert relative_error(ours, expected) < 1e-4
    tokens, logits = [], ours[-1]
    for _ in range(n_greedy):
        tokens.append(int(logits.argmax()))
        logits = loaded.model.forward([tokens[-1]], cache)[-1]
    assert tokens == reference_greedy(ref, prompt, n_greedy)
    return loaded, ref, expected
