"""`colibri plan`: what a model becomes under a memory budget, before converting it.

The budget is split (KV cache for the context, working buffers, the measured interpreter
footprint); the rest goes to the weights. When every matrix fits at some width, the planner
picks the widths and the whole model is resident. When it does not (an MoE larger than memory),
the dense part is planned first, routed experts are stored at `stream_bits`, as many as fit are
cached in RAM and the rest stream from disk. Predicted speed comes from measured bandwidths: RAM
for resident bytes, disk for the expert bytes that miss the cache (routing assumed uniform; a
learned pinned set does better).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.budget import BudgetSplit
from app.convert import ConvertSettings, Matrices, _bytes_at, classify, make_plan
from app.sizes import format_size
from engine.calibration import ActivationStats
from engine.errors import ColibriError
from engine.loader import Checkpoint
from engine.planner import Plan, TensorPlan, group_for
from engine.spec import MoESpec


@dataclass(frozen=True)
class Prediction:
    """A plan with its memory and speed consequences."""

    plan: Plan
    split: BudgetSplit
    resident_bytes: int          # weights kept in RAM (dense + cached experts)
    streamed_bytes: int          # expert bytes left on disk
    expert_cache_share: float    # share of routed experts that fit in RAM (1 when all resident)
    bytes_per_token: int         # weight bytes one decoded token reads
    disk_bytes_per_token: float  # of which, expected to come from disk
    ram_gbs: float
    disk_gbs: float

    @property
    def tok_s(self) -> float:
        """Predicted decode tokens per second."""
        ram = (self.bytes_per_token - self.disk_bytes_per_token) / (self.ram_gbs * 1e9)
        disk = self.disk_bytes_per_token / (self.disk_gbs * 1e9) if self.disk_bytes_per_token else 0.0
        return 1.0 / (ram + disk) if ram + disk > 0 else 0.0


def measure_disk_bandwidth(folder: Path, nbytes: int = 256 << 20) -> float:
    """Cold sequential read speed (GB/s) of a scratch file in `folder`, pages dropped before reading."""
    fd, name = tempfile.mkstemp(dir=folder, prefix=".colibri-disk-")
    try:
        chunk = os.urandom(4 << 20)
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        with open(name, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            while f.read(4 << 20):
                pass
            return nbytes / (time.perf_counter() - t) / 1e9
    finally:
        os.unlink(name)


def _expert_groups(ckpt: Checkpoint, mats: Matrices) -> tuple[set[str], int, int]:
    """(names of routed expert matrices, experts per MoE layer summed over layers, top_k sum)."""
    names = {n for ns in mats.experts.values() for n in ns}
    moe = [layer.ffn for layer in ckpt.spec.layers if isinstance(layer.ffn, MoESpec)]
    return names, sum(f.n_experts for f in moe), sum(f.top_k for f in moe)


def predict(ckpt: Checkpoint, split: BudgetSplit, stats: ActivationStats, settings: ConvertSettings,
            stream_bits: int, ram_gbs: float, disk_gbs: float, log) -> Prediction:
    """Plan the model for the split's weight budget and predict its speed."""
    mats = classify(ckpt)
    experts, n_experts, topk = _expert_groups(ckpt, mats)
    other = sum(int(np.prod(s)) * 4 for s in mats.float32.values())
    try:
        plan = make_plan(ckpt, mats, ConvertSettings(budget=split.weights, group=settings.group, keep=settings.keep),
                         stats, log)
        cache_share = 1.0
    except ColibriError:
        if not experts:
            raise
        # too large to hold: plan the dense part into half the budget, stream the experts at stream_bits
        dense = Matrices({n: s for n, s in mats.planned.items() if n not in experts}, mats.float32, {})
        dense_budget = split.weights // 2
        plan_dense = make_plan(ckpt, dense, ConvertSettings(budget=dense_budget, group=settings.group,
                                                          keep=settings.keep), stats, log)
        tensors = dict(plan_dense.tensors)
        for n in experts:
            shape = mats.planned[n]
            g = group_for(shape[1], settings.group)
            tensors[n] = TensorPlan(n, shape, stream_bits, g, _bytes_at(shape, stream_bits, g), 0.0, stats.usage(n))
        plan = Plan(tensors, split.weights, other)
        expert_total = sum(tensors[n].nbytes for n in experts)
        room = split.weights - plan_dense.total_bytes
        cache_share = max(0.0, min(1.0, room / expert_total))
    expert_bytes = sum(plan.tensors[n].nbytes for n in experts)
    dense_bytes = plan.total_bytes - expert_bytes
    per_expert = expert_bytes / n_experts if n_experts else 0.0
    embed = plan.tensors.get("model.embed_tokens.weight")
    embed_bytes = embed.nbytes if embed is not None and not ckpt.spec.tie_embeddings else 0
    per_token = int(dense_bytes - embed_bytes + topk * per_expert)     # a token reads one embedding row
    disk = topk * per_expert * (1.0 - cache_share)
    resident = int(dense_bytes + cache_share * expert_bytes)
    return Prediction(plan, split, resident, int(expert_bytes * (1 - cache_share)), cache_share, per_token, disk,
                      ram_gbs, disk_gbs)


def describe(p: Prediction) -> str:
    """The plan as the user reads it."""
    lines = [f"memory: {p.split.describe()}"]
    groups: dict[str, list[TensorPlan]] = {}
    for t in p.plan.tensors.values():
        groups.setdefault(_group_name(t.name), []).append(t)
    lines.append(f"{'matrices':34} {'bits':>14} {'bytes':>10}")
    for g, ts in sorted(groups.items()):
        weights = sum(t.shape[0] * t.shape[1] for t in ts)
        bits = 8 * sum(t.nbytes for t in ts) / weights
        mix = "/".join(str(b) for b in sorted({t.bits for t in ts}))
        lines.append(f"{g:34} {bits:6.2f} ({mix:>5}) {format_size(sum(t.nbytes for t in ts)):>10}")
    lines.append(f"average {p.plan.bits_per_weight:.2f} bits per weight; resident {format_size(p.resident_bytes)}"
                 + (f"; streamed from disk {format_size(p.streamed_bytes)} "
                    f"({(1 - p.expert_cache_share) * 100:.0f}% of routed experts)" if p.streamed_bytes else "; nothing streams"))
    lines.append(f"predicted decode {p.tok_s:.1f} tok/s: {format_size(p.bytes_per_token)} of weights per token "
                 f"at {p.ram_gbs:.1f} GB/s RAM" + (f", {format_size(p.disk_bytes_per_token)} from disk at "
                                                  f"{p.disk_gbs:.2f} GB/s" if p.disk_bytes_per_token else ""))
    return "\n".join(lines)


def _group_name(name: str) -> str:
    parts = name.split(".")
    if name.startswith("model.layers."):
        kind = "experts" if ".experts." in name else ("attention" if "self_attn" in name else "mlp")
        return f"layers.*.{kind}.{parts[-2]}"
    return ".".join(parts[-3:-1]) if len(parts) > 2 else parts[0]
