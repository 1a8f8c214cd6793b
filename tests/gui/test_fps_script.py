"""`python -m ui.fps`, the frame-rate benchmark of the Brain and the Atlas at 19,456 experts: it runs and reports."""

from __future__ import annotations

import json

import numpy as np

from ui import fps


def test_the_frames_route_top_k_in_every_layer_and_heat_follows_them() -> None:
    frames = fps._frames(3)
    for frame in frames:
        assert frame.shape == (fps.LAYERS, fps.EXPERTS) == frame.tiers.shape
        assert [layer for layer, _ in frame.snapshot.current] == list(range(fps.LAYERS))
        assert all(len(set(ids)) == fps.TOP_K for _, ids in frame.snapshot.current)
    last = frames[-1].snapshot
    hot = np.zeros((fps.LAYERS, fps.EXPERTS), bool)
    for layer, ids in last.current:
        hot[layer, list(ids)] = True
    assert (last.heat[hot] >= 1.0).all()           # the latest token's experts carry its full count
    counts = frames[0].counts
    assert frames[0].selected == fps.SELECTED and counts.hits.shape == (fps.LAYERS, fps.EXPERTS)
    assert len(counts.changes) == 1 << 16 and counts.story(*fps.SELECTED).requests > 0


def test_the_script_measures_the_brain_and_says_why_the_atlas_needs_gl(qapp, capsys) -> None:
    assert fps.main(["--seconds", "0.3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["experts"] == 19456
    assert result["brain"]["frames"] > 0 and result["brain"]["fps"] > 0
    assert result["brain_replaying"]["frames"] > 0
    atlas = result["atlas"]
    assert ("skipped" in atlas) or (atlas["draws"] > 0 and atlas["draw_ms"] > 0)
