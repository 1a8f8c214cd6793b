"""Tiny checkpoints with a multi-token-prediction (MTP) layer, and the MTP formula computed with torch.

transformers does not build MTP layers, so `build_mtp_checkpoint` saves a random model with one decoder
layer more than asked (transformers writes it under its published names), declares that last layer the
MTP module's decoder layer (`num_hidden_layers` n, `num_nextn_predict_layers` 1) and adds the module's own
tensors with the published names and shapes: `model.layers.{n}.enorm`, `.hnorm`, `.eh_proj` [hidden,
2 * hidden], `.shared_head.norm`, and optionally `.shared_head.head` [V, hidden] and `.embed_tokens` [V, hidden].

`mtp_reference_logits` computes, for each position i of a prompt, from the DeepSeek-V3 paper's formula
(section 2.2) and nothing of Colibri's:
    h_mtp = Layer(eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i))))
    logits = head(shared_head.norm(h_mtp))
with h_i the main model's last-layer output before its final norm, Layer transformers' own decoder layer
(loaded with the MTP layer's weights) on its own causal attention over positions 0..i; the embedding at
position 0 is zeroed, as vLLM's and sglang's MTP layers do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from support.reference import build_checkpoint, load_reference


def build_mtp_checkpoint(folder: Path, model_type: str, seed: int = 0, *, own_embed: bool = False,
                         own_head: bool = True, **overrides) -> Path:
    """A random `model_type` checkpoint of `num_hidden_layers` layers plus one MTP module, in `folder`.

    The full (n + 1)-layer model is kept in `folder / "full"` (the reference reads its last decoder layer).
    """
    import torch
    from safetensors.torch import load_file, save_file

    n = overrides.pop("num_hidden_layers", 3)
    full = build_checkpoint(folder / "full", model_type, seed=seed, num_hidden_layers=n + 1, **overrides)
    tensors = load_file(str(full / "model.safetensors"))
    p = f"model.layers.{n}"
    hidden = tensors["model.norm.weight"].shape[0]
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    tensors[f"{p}.enorm.weight"] = 1.0 + 0.3 * torch.randn(hidden, generator=g)
    tensors[f"{p}.hnorm.weight"] = 1.0 + 0.3 * torch.randn(hidden, generator=g)
    tensors[f"{p}.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    tensors[f"{p}.shared_head.norm.weight"] = 1.0 + 0.3 * torch.randn(hidden, generator=g)
    if own_head:
        tensors[f"{p}.shared_head.head.weight"] = 0.1 * torch.randn(vocab, hidden, generator=g)
    if own_embed:
        tensors[f"{p}.embed_tokens.weight"] = 0.1 * torch.randn(vocab, hidden, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((full / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    for key, value in list(config.items()):     # per-layer lists (GLM-5's indexer_types, mlp_layer_types): n entries
        if key.endswith("types") and isinstance(value, list) and len(value) == n + 1:
            config[key] = value[:n]
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if (full / "generation_config.json").is_file():
        (folder / "generation_config.json").write_text((full / "generation_config.json").read_text())
    return folder


def mtp_reference_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """The MTP module's logits [T - 1, V] at positions 0..T-2 of `ids` (position i reads ids[i + 1] and
    the main model's hidden state at i), from the formula above with torch and transformers' decoder layer."""
    import torch

    main = load_reference(folder)          # n layers; transformers leaves the MTP tensors out
    full = load_reference(folder / "full")
    n = main.config.num_hidden_layers
    from safetensors.torch import load_file

    t = load_file(str(folder / "model.safetensors"))
    p = f"model.layers.{n}"
    eps = main.config.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    captured = {}
    main.model.layers[-1].register_forward_hook(lambda mod, args, out: captured.__setitem__(
        "h", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        main(torch.tensor([ids]))
        h = captured["h"][0, :-1]                                              # [T - 1, hidden]: h_0..h_{T-2}
        embed = t.get(f"{p}.embed_tokens.weight", t["model.embed_tokens.weight"])
        head = t.get(f"{p}.shared_head.head.weight", t.get("lm_head.weight", t["model.embed_tokens.weight"]))
        e = embed[torch.tensor(ids[1:])].clone()                               # [T - 1, hidden]: t_1..t_{T-1}
        e[0] = 0.0                                                             # position 0: the reference engines' mask
        x = torch.cat([rms(e, t[f"{p}.enorm.weight"]), rms(h, t[f"{p}.hnorm.weight"])], -1) @ t[f"{p}.eh_proj.weight"].T
        x = x[None]                                                            # [1, T - 1, hidden]
        T = x.shape[1]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]           # causal, additive
        layer = full.model.layers[n]
        y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=full.model.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        return (rms(y[0], t[f"{p}.shared_head.norm.weight"]) @ head.T).float().numpy()
