"""Mistral, Gemma 2/3 and OLMo 2 configs as the Hub ships them (older keys, keys left out) read the same as the
configs transformers 5 writes for them; values the engine does not run are refused with the key named."""

from __future__ import annotations

import pytest

from engine.errors import ModelFormatError
from engine.models import spec_from_config

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, vocab_size=160)
HUB = {
    # Gemma 2 as on the Hub: no layer_types, soft-capping keys left out (the reference's 50 and 30 then apply)
    "gemma2": dict(SIZES, architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_key_value_heads=2,
                   head_dim=16, query_pre_attn_scalar=16, sliding_window=32, rope_theta=10000.0,
                   hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"),
    # Gemma 3 as on the Hub: a window pattern, a local base, linear scaling of the global layers' RoPE
    "gemma3": dict(SIZES, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_key_value_heads=1,
                   head_dim=16, sliding_window=32, sliding_window_pattern=3, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   final_logit_softcapping=None, attn_logit_softcapping=None),
    # Gemma 3 leaving out every default: head_dim 256, RoPE bases 1e6 / 1e4, pattern 6, window 4096
    "gemma3-defaults": dict(SIZES, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                            num_key_value_heads=2),
    # Mistral 7B v0.1 leaves num_key_value_heads to its default (8) and keeps the default window (4096)
    "mistral-defaults": dict(SIZES, num_attention_heads=8, architectures=["MistralForCausalLM"],
                             model_type="mistral"),
    "mistral-v0.2": dict(SIZES, architectures=["MistralForCausalLM"], model_type="mistral", num_key_value_heads=2,
                         sliding_window=None, rope_theta=1000000.0),
    "olmo2": dict(SIZES, architectures=["Olmo2ForCausalLM"], model_type="olmo2", rope_theta=500000.0),
}


def _normalised(data: dict) -> dict:
    """The config.json transformers writes for `data`."""
    from transformers import AutoConfig

    fields = {k: v for k, v in data.items() if k != "model_type"}
    return AutoConfig.for_model(data["model_type"], **fields).to_dict()


@pytest.mark.parametrize("case", list(HUB))
def test_hub_config_reads_as_transformers_normalises_it(case):
    hub = HUB[case]
    ours, theirs = spec_from_config(hub), spec_from_config(_normalised(hub))
    assert ours == theirs


def test_hub_defaults_are_the_references():
    g2 = spec_from_config(HUB["gemma2"])
    assert g2.final_softcap == 30.0 and g2.layers[0].attn.softcap == 50.0 and g2.tie_embeddings
    assert [layer.attn.sliding_window for layer in g2.layers[:2]] == [32, None]
    g3 = spec_from_config(HUB["gemma3"])
    local, glob = g3.layers[0].attn, g3.layers[2].attn
    assert (local.sliding_window, local.rope.theta, local.rope.kind) == (32, 10000.0, "default")
    assert (glob.sliding_window, glob.rope.theta, glob.rope.kind, glob.rope.factor) == (None, 1e6, "linear", 8.0)
    assert g3.final_softcap is None and local.softcap is None and local.qk_norm == "head"
    d = spec_from_config(HUB["gemma3-defaults"])
    assert d.layers[0].attn.head_dim == 256 and d.layers[0].attn.sliding_window == 4096
    assert [layer.attn.sliding_window is None for layer in d.layers] == [i % 6 == 5 for i in range(8)]
    m = spec_from_config(HUB["mistral-defaults"])
    assert m.layers[0].attn.n_kv_heads == 8 and {layer.attn.sliding_window for layer in m.layers} == {4096}
    assert {layer.attn.sliding_window for layer in spec_from_config(HUB["mistral-v0.2"]).layers} == {None}
    o = spec_from_config(HUB["olmo2"])
    assert o.layers[0].norms == "post" and o.layers[0].attn.qk_norm == "full" and o.rms_eps == 1e-5


@pytest.mark.parametrize(("case", "key", "value"), [
    ("gemma3", "use_bidirectional_attention", True),
    ("gemma2", "sliding_window", None),              # local layers with no window
    ("gemma2", "sliding_window", 0),
    ("gemma2", "attn_logit_softcapping", -1.0),
    ("gemma2", "final_logit_softcapping", "30"),
    ("gemma3", "layer_types", ["sliding_attention"] * 3),
    ("gemma3", "layer_types", ["local"] * 8),
    ("gemma3", "sliding_window_pattern", 0),
    ("gemma3", "query_pre_attn_scalar", 0),
    ("gemma3", "hidden_activation", "relu"),
    ("mistral-v0.2", "sliding_window", 0),
    ("mistral-v0.2", "sliding_window", 2.5),
])
def test_values_not_run_are_refused_by_key(case, key, value):
    with pytest.raises(ModelFormatError, match=key if key != "hidden_activation" else "relu"):
        spec_from_config({**HUB[case], key: value})
