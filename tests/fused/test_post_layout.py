"""The fused step's `post` buffer (engine/fused/post.py): its named regions tile the buffer, the kernel finds
the same offsets in its globals, and a streamed call writes each region where the layout says.
"""

from __future__ import annotations

import os

import pytest

from app.hub.convert import ConvertSettings, convert
from engine.fused import kernel as fk
from engine.fused.post import MAX_GUESS, W_ALL, W_SOME, W_STOP, PostLayout
from engine.kv import KVCache
from engine.loader import OffloadOptions, load_model
from engine.offload.store import StoreSettings
from support.reference import build_checkpoint

PROMPT = [5, 17, 99, 3, 42, 42, 7, 150, 64, 1, 88, 23, 9]
STEPS = 12


@pytest.mark.parametrize("layers", [1, 3, 40])
def test_the_regions_tile_the_buffer_in_order(layers):
    layout = PostLayout(layers)
    regions = layout.regions()
    spans = list(regions.values())
    assert spans[0].start == 0 and spans[-1].stop == layout.size
    for a, b in zip(spans, spans[1:]):
        assert a.stop == b.start                                  # no gap, no overlap
    assert sum(len(r) for r in spans) == layout.size
    for name in ("word", "guessed", "needed", "refused", "deciding", "ids", "mask", "second"):
        assert regions[name].start == getattr(layout, name)
    for name in ("word", "guessed", "needed", "refused", "mask", "second"):
        assert len(regions[name]) == layers                        # one word per layer
    rows = [range(layout.id_row(r), layout.id_row(r) + MAX_GUESS) for r in range(2 * layers)]
    assert rows[0].start == regions["ids"].start and rows[-1].stop == regions["ids"].stop
    for i in range(layers):
        assert layout.guess_ids(i) == rows[i].start and layout.need_ids(i) == rows[layers + i].start


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="the fused step's driver thread needs an eventfd (Linux)")
def test_a_streamed_call_writes_each_region_where_the_layout_says(tmp_path_factory, monkeypatch):
    """Token by token, with a driver and reading ahead: the experts a layer waited for are its routing, the
    guesses are a later streamed layer's, every word is one the layout names, and nothing lies outside the
    rows' posted ids."""
    src = build_checkpoint(tmp_path_factory.mktemp("p"), "mixtral", num_local_experts=8, num_experts_per_tok=2)
    out = convert(src, tmp_path_factory.mktemp("c") / "model", ConvertSettings(bits=4), log=lambda m: None)
    probe = load_model(out, offload=OffloadOptions(StoreSettings(capacity=1 << 30)))
    try:
        slot = probe.store.slot_bytes
    finally:
        probe.close()
    loaded = load_model(out, offload=OffloadOptions(StoreSettings(capacity=5 * slot, policy="lru"), 1))
    needs = guesses = 0
    try:
        model = loaded.model
        monkeypatch.setattr(model.context.ahead, "pick", lambda preferred, other: preferred)   # always reading ahead
        cache = KVCache(model.spec, 64)
        token = int(model.forward(PROMPT, cache)[-1].argmax())
        for _ in range(STEPS):
            routing = []
            token = int(model.forward([token], cache, routing=routing)[-1].argmax())
            plan = model.context.fused
            assert plan.driver is not None
            layout, post, n = plan.layout, plan.post.copy(), plan.lay.shape[0]
            assert layout.size == post.size and layout.layers == n
            for key, at in ((fk.G_P_WORD, layout.word), (fk.G_P_GUESSED, layout.guessed),
                            (fk.G_P_NEEDED, layout.needed), (fk.G_P_REFUSED, layout.refused),
                            (fk.G_P_DECIDING, layout.deciding), (fk.G_P_GUESS_IDS, layout.guess_ids(0)),
                            (fk.G_P_NEED_IDS, layout.need_ids(0)), (fk.G_P_MASK, layout.mask),
                            (fk.G_P_SECOND, layout.second)):
                assert plan.g[key] == at, key                     # the kernel reads the layout's offsets
            routes = {r.layer: r.experts[0].tolist() for r in routing}
            for i in range(n):
                top_k, n_exp = int(plan.lay[i, fk.L_K]), int(plan.lay[i, fk.L_E])
                need_row = post[layout.need_ids(i) : layout.need_ids(i) + MAX_GUESS]
                count = int(post[layout.needed + i])
                if count:                                         # what layer i waited for: its routing
                    needs += 1
                    assert count == top_k and need_row[:count].tolist() == routes[i]
                assert not need_row[count:].any()
                guess_row = post[layout.guess_ids(i) : layout.guess_ids(i) + MAX_GUESS]
                count = int(post[layout.guessed + i])
                if count:                                         # a later streamed layer's guess
                    guesses += 1
                    assert i >= 1 and plan.lay[i, fk.L_STREAMED] == 1
                    assert count == plan.lay[i, fk.L_GUESS]
                    assert len(set(guess_row[:count].tolist())) == count and guess_row[:count].max() < n_exp
                assert not guess_row[count:].any()
                word, second = int(post[layout.word + i]), int(post[layout.second + i])
                assert word in (0, W_ALL, W_STOP, W_SOME) and post[layout.refused + i] in (0, 1)
                # thread 0 says a second word after W_SOME (and, its mask full, after W_ALL), never after W_STOP
                assert second in (0, W_ALL, W_STOP) and (second == 0 or word in (W_ALL, W_SOME))
                assert word != W_SOME or second != 0
                if word == W_SOME:                                # some slots in memory, not all
                    assert 0 < post[layout.mask + i] < (1 << top_k) - 1
            assert 0 <= post[layout.deciding] < n
    finally:
        loaded.close()
    assert needs > 0 and guesses > 0                              # both kinds of post were written and checked
