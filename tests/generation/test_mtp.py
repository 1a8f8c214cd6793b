"""MTP layers as a drafter (DeepSeek-V3, GLM-4.5, GLM-5): the head against the paper's formula (torch + transformers' decoder layer), output
with `--speculative mtp` identical to plain decoding (greedy and seeded sampling, resident and streamed), and
acceptance counted, on the reject path (random weights) and on the accept path (a checkpoint built so the
MTP module predicts what the main model will)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.errors import ColibriError
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.mtp import MTPDrafter, NoMTPError
from engine.generation.sampling import SamplingParams
from engine.generation.speculative import SpeculationController, SpeculativeSettings
from engine.kv import KVCache
from engine.loader import load_model, load_mtp, open_checkpoint
from support.families import MLA
from support.mtp import build_mtp_checkpoint, mtp_reference_logits
from support.reference import build_checkpoint, relative_error

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9, 140, 31, 77]

CASES = {
    # DeepSeek-V3: latent attention with a query low-rank, group-limited routing; the MTP module has its own
    # embedding and head
    "deepseek_v3": ("deepseek_v3", dict(MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                        topk_group=1, first_k_dense_replace=1, n_shared_experts=1),
                    dict(own_embed=True, own_head=True)),
    # GLM-4.5: grouped-query attention with partial RoPE and q/k norms; the module reads the main embedding
    # and the main head
    "glm4_moe": ("glm4_moe", dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                  use_qk_norm=True, attention_bias=True, first_k_dense_replace=1),
                 dict(own_embed=False, own_head=False)),
    # GLM-5: latent attention with the sparse-attention indexer selecting 4 keys (fewer than the prompt holds)
    "glm_moe_dsa": ("glm_moe_dsa", dict(MLA, q_lora_rank=32, index_head_dim=16, index_n_heads=8, index_topk=4,
                                        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                        first_k_dense_replace=1),
                    dict(own_embed=False, own_head=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides, mtp = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return build_mtp_checkpoint(folder / "ckpt", model_type, seed=3, **mtp, **overrides)


def _generate(loaded, prompt, n, sampling, speculative=None):
    controller = SpeculationController(speculative) if speculative is not None else None
    request = GenerationRequest(prompt=tuple(prompt), max_tokens=n, sampling=sampling, stop_ids=frozenset(),
                                speculative=speculative)
    done = None
    for event in stream_generate(loaded.model, None, request, cache=KVCache(loaded.spec, 256), speculation=controller):
        done = event
    assert type(done).__name__ == "DoneEvent", done
    return list(done.tokens), controller


@pytest.mark.parity
def test_mtp_head_matches_the_formula(checkpoint):
    """The head's logits at every prompt position equal the paper's formula computed with torch."""
    loaded = load_model(checkpoint)
    head = load_mtp(checkpoint, loaded.spec)
    hidden: list[np.ndarray] = []
    loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), all_logits=True, hidden=hidden)
    ours, _ = head.forward(np.array(PROMPT[1:]), hidden[0][:-1], head.new_cache(64))   # [T - 1, V]
    expected = mtp_reference_logits(checkpoint, PROMPT)
    assert ours.shape == expected.shape
    assert relative_error(ours, expected) < 1e-4


def test_mtp_drafter_feeds_positions_one_at_a_time_as_in_one_pass(checkpoint):
    """Drafting row by row (the decode loop's way) gives the logits of one pass over the same rows."""
    loaded = load_model(checkpoint)
    head = load_mtp(checkpoint, loaded.spec)
    hidden: list[np.ndarray] = []
    loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), all_logits=True, hidden=hidden)
    whole, _ = head.forward(np.array(PROMPT[1:]), hidden[0][:-1], head.new_cache(64))
    drafter = MTPDrafter(head, 64)
    drafter.observe(0, hidden[0][:6])
    first = drafter.propose(np.array(PROMPT[:7]), 1)          # positions 0..5 run, the last predicts PROMPT[7]'s next
    assert first == [int(np.argmax(whole[5]))]
    drafter.observe(6, hidden[0][6:10])
    assert drafter.propose(np.array(PROMPT[:11]), 1) == [int(np.argmax(whole[9]))]


def test_mtp_drafter_restarts_after_missed_positions(checkpoint):
    """Positions the loop did not hand over (plain fused steps while drafting was off) restart the module at
    the next position it sees: its guesses are then those of a fresh cache begun there."""
    loaded = load_model(checkpoint)
    head = load_mtp(checkpoint, loaded.spec)
    hidden: list[np.ndarray] = []
    loaded.model.forward(PROMPT, KVCache(loaded.spec, 64), all_logits=True, hidden=hidden)
    h = hidden[0]                                                          # [T, hidden]
    drafter = MTPDrafter(head, 64)
    drafter.observe(0, h[:5])
    assert len(drafter.propose(np.array(PROMPT[:6]), 1)) == 1
    drafter.observe(8, h[8:9])                                             # positions 5..7 missed
    fresh, _ = head.forward(np.array(PROMPT[9:10]), h[8:9], head.new_cache(64), origin=8)
    assert drafter.propose(np.array(PROMPT[:10]), 1) == [int(np.argmax(fresh[-1]))]
    assert drafter.propose(np.array(PROMPT[:10]), 1) == []                # nothing new: no guess
    drafter.observe(9, h[9:12])
    fresh, _ = head.forward(np.array(PROMPT[9:13]), h[8:12], head.new_cache(64), origin=8)
    assert drafter.propose(np.array(PROMPT[:13]), 1) == [int(np.argmax(fresh[-1]))]


def test_drafting_switched_off_and_on_again_keeps_plain_output(checkpoint):
    """With random weights nothing is accepted: the controller switches drafting off (plain fused steps) and
    tries again; the MTP drafter drafts again after each retry and the tokens stay plain decoding's."""
    loaded = load_model(checkpoint)
    head = load_mtp(checkpoint, loaded.spec)
    sampling = SamplingParams(temperature=0.0)
    plain, _ = _generate(loaded, PROMPT, 40, sampling)
    spec = SpeculativeSettings(max_draft=1, mtp=head, warmup=1, retry_after=2, probe_every=2)
    ours, controller = _generate(loaded, PROMPT, 40, sampling, spec)
    assert ours == plain
    assert controller.accepted == 0 and controller.switches >= 2
    assert controller.draft_steps >= controller.switches                  # each retry drafted again


@pytest.mark.parametrize("streamed", [False, True])
def test_speculative_mtp_output_is_plain_decodings(checkpoint, tmp_path, streamed):
    """Greedy and seeded sampling with the MTP drafter produce plain decoding's tokens; drafts are counted."""
    from app.hub.convert import ConvertSettings, convert
    from engine.loader import OffloadOptions
    from engine.offload.store import StoreSettings

    if streamed:
        out = convert(checkpoint, tmp_path / "c", ConvertSettings(bits=4), log=lambda *_: None)
        loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
        source = out
        kept = open_checkpoint(out, verify=False, verify_experts=False, quantized=True).source
        n = loaded.spec.n_layers     # the MTP layer at 8 bits though the rest was asked at 4
        assert kept.load(f"model.layers.{n}.eh_proj.weight").bits == 8
        assert kept.load(f"model.layers.{n}.self_attn.o_proj.weight").bits == 8
        assert kept.load(f"model.layers.{n - 1}.self_attn.o_proj.weight").bits == 4
    else:
        loaded, source = load_model(checkpoint), checkpoint
    head = load_mtp(source, loaded.spec)
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=20, seed=7)):
        plain, _ = _generate(loaded, PROMPT, 24, sampling)
        for k in (1, 3):
            spec = SpeculativeSettings(max_draft=k, mtp=head, adaptive=False)
            ours, controller = _generate(loaded, PROMPT, 24, sampling, spec)
            assert ours == plain
            assert controller.drafted > 0 and controller.draft_steps > 0
            assert controller.accepted <= controller.drafted
    loaded.close()


def _agreeing_checkpoint(folder):
    """A DeepSeek-V3 checkpoint whose MTP module predicts what the main model will: every block's output
    projection scaled to almost nothing leaves the residual stream at a token's embedding, the head is the
    embedding with its rows permuted (so the next token is a fixed permutation s of the current one, and
    the one after that s(s(t))), and the module's eh_proj passes the embedding half through to the same head."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = build_mtp_checkpoint(folder, "deepseek_v3", seed=5, own_head=False, own_embed=False,
                                  **dict(MLA, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                         n_group=1, topk_group=1, first_k_dense_replace=1))
    t = load_file(str(folder / "model.safetensors"))
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = t[name] * 1e-4
        elif name.endswith(("model.norm.weight", "enorm.weight", "shared_head.norm.weight")):
            t[name] = t[name] * 0 + 1
    embed = t["model.embed_tokens.weight"]
    perm = np.random.default_rng(0).permutation(embed.shape[0])
    t["lm_head.weight"] = embed[torch.from_numpy(np.argsort(perm))].clone()        # row s(v) is embedding v: v -> s(v)
    hidden = embed.shape[1]
    eh = t["model.layers.3.eh_proj.weight"] * 0
    eh[:, :hidden] = torch.eye(hidden)
    t["model.layers.3.eh_proj.weight"] = eh
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_agreeing_mtp_head_is_accepted(tmp_path):
    """With an MTP module that agrees with the model, drafts are accepted (k tokens a step) and the output is
    still plain decoding's."""
    folder = _agreeing_checkpoint(tmp_path / "agree")
    loaded = load_model(folder)
    head = load_mtp(folder, loaded.spec)
    plain, _ = _generate(loaded, PROMPT, 20, SamplingParams(temperature=0.0))
    for k in (1, 4):
        ours, controller = _generate(loaded, PROMPT, 20, SamplingParams(temperature=0.0),
                                     SpeculativeSettings(max_draft=k, mtp=head, adaptive=False))
        assert ours == plain
        assert controller.acceptance > 0.9, controller.as_dict()
        assert controller.steps < 20 / (1 + 0.8 * k) + 2         # several tokens a pass


def test_model_without_mtp_layers_is_refused(tmp_path):
    """--speculative mtp on a model with no MTP layers: a clear error naming the fix."""
    folder = build_checkpoint(tmp_path / "llama", "llama")
    loaded = load_model(folder)
    with pytest.raises(NoMTPError, match="no MTP layers"):
        load_mtp(folder, loaded.spec)
    # a config that counts an MTP layer whose tensors the checkpoint lacks
    glm = build_checkpoint(tmp_path / "glm", "glm4_moe", moe_intermediate_size=32, n_routed_experts=8,
                           num_experts_per_tok=2)
    assert json.loads((glm / "config.json").read_text()).get("num_nextn_predict_layers", 1) == 1
    with pytest.raises(ColibriError, match="holds no model.layers.3"):
        load_mtp(glm, load_model(glm).spec)


def test_colibri_run_speculative_mtp(tmp_path, capsys):
    """`colibri run --speculative mtp` prints plain decoding's tokens and the drafting counters; a model without
    MTP layers gets a clear error, not a traceback."""
    from app.cli import main

    folder = _agreeing_checkpoint(tmp_path / "agree")
    args = ["run", str(folder), "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", "12", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--speculative", "mtp", "--draft", "2"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["tokens"] == plain["tokens"] and fast["speculative"]["accepted"] > 0
    assert main(args + ["--speculative", "mtp"]) == 0               # one token a step unless --draft says more
    one = json.loads(capsys.readouterr().out)
    assert one["tokens"] == plain["tokens"] and one["speculative"]["drafted"] == one["speculative"]["draft_steps"] > 0
    llama = build_checkpoint(tmp_path / "llama", "llama")
    assert main(["run", str(llama), "--tokens", "1,2,3", "--max-tokens", "2", "--speculative", "mtp"]) != 0
    err = capsys.readouterr().err
    assert "has no MTP layers" in err and "Traceback" not in err


def test_mtp_spec_is_a_routed_layer_with_its_own_indexer():
    """The MTP module's decoder layer is the routed layers' shape; a GLM-5 whose last layer shares an indexer gives
    its MTP layer one of its own; no count (or 0) means no MTP layer."""
    from engine.models import mtp_spec

    glm5 = {"architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2, "indexer_types": ["full", "full", "shared"], "num_nextn_predict_layers": 1}
    spec = mtp_spec(glm5)
    assert spec is not None and spec.n_layers == 1
    layer = spec.layers[0]
    assert type(layer.ffn).__name__ == "MoESpec" and layer.attn.indexer is not None
    assert not layer.attn.indexer.shared and layer.attn.indexer.source is None
    assert mtp_spec({**glm5, "num_nextn_predict_layers": 0}) is None
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "vocab_size": 100}
    assert mtp_spec(v3) is None                                          # the reference's default: none
    assert mtp_spec({**v3, "num_nextn_predict_layers": 1}).layers[0].ffn.n_experts == 256
    assert mtp_spec({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 96}) is None


def test_a_model_named_after_bare_speculative_gets_the_order_explained(capsys):
    """`colibri run --speculative MODEL ...` reads MODEL as the flag's value: the error says how to order them."""
    from app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "--speculative", "smollm2-135m", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "name the model before the flag" in err and "Traceback" not in err
