"""Mistral, Gemma 2, Gemma 3 and OLMo 2 against transformers on tiny random checkpoints read from disk.

As tests/models/test_parity.py: prompt logits within 1e-4 of the logits' largest magnitude, 32 greedy tokens
(ours with the KV cache, the reference recomputing the whole sequence) identical. Windows shorter than the
prompt make the local layers' masks matter; soft-capping, tied heads and RoPE variants are each on and off.
"""

from __future__ import annotations

import pytest

from support.reference import (
    BASE,
    assert_matches_reference,
    build_checkpoint,
)

pytestmark = pytest.mark.parity   # this module checks each architecture against transformers

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77, 2, 120, 56, 11]
N_GREEDY = 32
LINEAR = {"rope_type": "linear", "factor": 4.0}
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24)

CASES = {
    "mistral-window-head-dim": ("mistral", dict(sliding_window=6, head_dim=24)),
    "mistral-no-window-mqa-tied": ("mistral", dict(sliding_window=None, num_key_value_heads=1, tie_word_embeddings=True,
                                                   rope_theta=500.0)),
    # Gemma 2: alternating local/global layers; soft-capping of scores and logits on by default
    "gemma2-capped-window": ("gemma2", dict(GEMMA, sliding_window=5, num_hidden_layers=4,
                                            attn_logit_softcapping=1.5, final_logit_softcapping=3.0)),
    "gemma2-uncapped-untied-bias": ("gemma2", dict(GEMMA, sliding_window=7, attn_logit_softcapping=None,
                                                   final_logit_softcapping=None, tie_word_embeddings=False,
                                                   attention_bias=True)),
    "gemma2-types-long-window": ("gemma2", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                                                layer_types=["full_attention", "sliding_attention",
                                                             "sliding_attention"], rope_theta=300.0)),
    # Gemma 3: q/k norms, a local RoPE base, RoPE scaling on the global layers only
    "gemma3-pattern-linear-rope": ("gemma3_text", dict(GEMMA, sliding_window=6, num_hidden_layers=4,
                                                       sliding_window_pattern=2, rope_scaling=LINEAR,
                                                       rope_theta=20000.0, rope_local_base_freq=100.0)),
    "gemma3-capped-untied": ("gemma3_text", dict(GEMMA, sliding_window=4, attn_logit_softcapping=2.0,
                                                 final_logit_softcapping=5.0, tie_word_embeddings=False,
                                                 layer_types=["sliding_attention", "full_attention",
                                                              "sliding_attention"])),
    "gemma3-default-pattern-mqa": ("gemma3_text", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=9,
                                                       num_hidden_layers=7, num_key_value_heads=1,
                                                       attention_bias=True)),
    "gemma3-yarn-global": ("gemma3_text", dict(GEMMA, sliding_window=8, sliding_window_pattern=3,
                                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 128})),
    # exact-erf GELU (transformers' "gelu") where Gemma 3 and Mistral read their activation
    "gemma3-erf-gelu": ("gemma3_text", dict(GEMMA, sliding_window=5, hidden_activation="gelu")),
    "mistral-erf-gelu": ("mistral", dict(sliding_window=None, hidden_act="gelu")),
    "olmo2": ("olmo2", dict()),
    "olmo2-mqa-bias-tied-rope": ("olmo2", dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True,
                                               rope_scaling=LINEAR)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dense_family_matches_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    folder = build_checkpoint(tmp_path / case, model_type, **overrides)
    assert_matches_reference(folder, PROMPT, N_GREEDY)


# Gemma 3's vision-language checkpoints: the text model's sizes in text_config, a (tiny) vision tower left unread
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, image_size=28, patch_size=14)
TEXT = {k: v for k, v in BASE.items() if k != "initializer_range"}
VL_CASES = {
    "tied-pattern": dict(text_config=dict(TEXT, **GEMMA, sliding_window=6, sliding_window_pattern=2)),
    # an untied head, GELU with erf, and a final cap in the text config, which this reference does not apply
    "untied-erf-gelu-cap-ignored": dict(tie_word_embeddings=False, text_config=dict(
        TEXT, **GEMMA, sliding_window=4, hidden_activation="gelu", final_logit_softcapping=2.0,
        rope_scaling=LINEAR)),
}


@pytest.mark.parametrize("case", list(VL_CASES))
def test_gemma3_vision_language_checkpoint_runs_its_text_model(case, tmp_path, caplog):
    folder = build_checkpoint(tmp_path / case, "gemma3", base={}, vision_config=VISION, mm_tokens_per_image=4,
                              initializer_range=0.1, **VL_CASES[case])
    with caplog.at_level("INFO", logger="engine.models.gemma"):
        assert_matches_reference(folder, PROMPT, N_GREEDY, architecture="Gemma3ForConditionalGeneration")
    assert "vision tower and projector are left unread" in caplog.text
