"""What every synth shape shares: the config.json keys common to the families, the token ids of the synthetic
tokenizer, and the `Shape` record (app/bench/synth/shapes.py and families.py define the shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INIT_STD = 0.02                    # transformers' initializer_range

# SentencePiece's conventional special ids, which llama.cpp also assumes for "llama" vocabularies
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def common_config(arch: str, model_type: str, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                  vocab: int, rope_theta: float, max_pos: int, eps: float) -> dict[str, Any]:
    """The keys most families' config.json files share, with the synthetic tokenizer's ids."""
    return {
        "architectures": [arch], "attention_dropout": 0.0, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "hidden_act": "silu", "hidden_size": hidden, "initializer_range": INIT_STD, "intermediate_size": ffn,
        "max_position_embeddings": max_pos, "model_type": model_type, "num_attention_heads": heads,
        "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "pad_token_id": None, "rms_norm_eps": eps,
        "rope_parameters": {"rope_theta": float(rope_theta), "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": vocab,
    }


@dataclass(frozen=True)
class Shape:
    """A named architecture shape: a config.json without dtype, and what it is for."""

    name: str
    summary: str
    config: dict[str, Any]
