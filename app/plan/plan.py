"""`colibri plan`: what a model becomes under a memory budget, before converting it (or downloading it).

The budget is split as `colibri run --max-memory` splits it (KV cache for the context, working
buffers); the rest goes to the weights, and the measured interpreter footprint is reported on top.
Two ways to a layout:
- with the weights (`calibrated_layout`): calibration measures each matrix's error and, when every
  matrix fits at some width, the planner picks the widths and the whole model is resident. When it
  does not (an MoE larger than memory), the dense part is planned into at most half the weight
  budget (leaving room for the engine's least expert cache), routed experts are stored at
  `stream_bits`, as many as fit are cached in RAM and the rest stream;
- from config.json alone (`config_layout`): fixed widths, `bits` for dense matrices and
  `stream_bits` for routed experts, nothing read but the config.
Either way the verdict comes first: it fits, it fits with experts streaming, or it does not fit
and `BudgetTooSmall` says the least budget that would do.

Predicted speeds come from app.plan.speed_model: a time per token with a term for each cost (fixed
per-token and per-layer work, attention growing with the context, the quantized kernels on the
weights a token reads, expert reads from disk overlapping the layers), each constant measured on
this machine when the plan is made; the output names what was measured and what was assumed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from app.config.sizes import format_size
from app.hub.convert import ConvertSettings, Matrices, _bytes_at, classify, make_plan
from app.plan.budget import BudgetSplit, check_ctx, memory_now
from app.plan.speed_model import Rates, Speeds, Work, describe_speeds, plan_work, predict_speeds
from app.plan.speed_probe import measure_rates  # noqa: F401  the measurer `colibri plan` uses (tests replace it here)
from engine.errors import ColibriError
from engine.loader import Checkpoint
from engine.offload.budget import kv_bytes, working_bytes
from engine.offload.io import PAGE, round_up
from engine.plan.calibration import ActivationStats
from engine.plan.planner import BIT_OPTIONS, FLOAT_BITS, GROUP_OPTIONS, Plan, TensorPlan, forced_bits, group_for
from engine.spec import ModelSpec, MoESpec


class BudgetTooSmall(ColibriError):
    """The budget cannot hold the model at all; `minimum` is the least budget that can."""

    def __init__(self, minimum: int, detail: str, advice: str = "lower --ctx") -> None:
        self.minimum = minimum
        super().__init__(f"does not fit: needs at least {format_size(minimum)} ({detail}); raise --max-memory to "
                         f"{flag_size(minimum)} or {advice}")


def flag_size(n: int) -> str:
    """n bytes rounded up to a size `--max-memory` reads (so that the advice, taken, is enough)."""
    if n >= 10**9:
        return f"{math.ceil(n / 10**7) / 100:.2f}GB"
    return f"{math.ceil(n / 10**4) / 100:.2f}MB"


@dataclass(frozen=True)
class Layout:
    """A plan and where its routed experts live."""

    plan: Plan
    experts: frozenset[str]   # names of the routed expert matrices
    n_experts: int            # experts per MoE layer, summed over layers
    top_k: int                # experts a token picks, summed over layers
    cache_share: float        # share of routed expert bytes held in RAM (1 when all resident)
    routing_measured: bool = False  # experts' usage measured on calibration text (else routing is taken as uniform)


@dataclass(frozen=True)
class Prediction:
    """A plan with its memory and speed consequences."""

    plan: Plan
    split: BudgetSplit
    resident_bytes: int          # weights kept in RAM (dense + cached experts)
    streamed_bytes: int          # expert bytes left on disk
    expert_cache_share: float    # share of routed experts that fit in RAM (1 when all resident)
    kv_int8_bytes: int           # the KV cache for the context with `--kv-bits 8`
    speeds: Speeds               # predicted prompt and decode speed, with what they rest on

    @property
    def tok_s(self) -> float:
        """Predicted decode tokens per second after a one-chunk prompt."""
        return self.speeds.decode_tok_s

    @property
    def prompt_tok_s(self) -> float:
        """Predicted prompt tokens per second for a one-chunk prompt."""
        return self.speeds.prompt_tok_s

    @property
    def verdict(self) -> str:
        """The one-line answer: does it fit, and what streams."""
        if self.streamed_bytes:
            return f"fits with {format_size(self.streamed_bytes)} of experts streaming from disk"
        return (f"fits in memory: {format_size(self.resident_bytes)} of weights resident, "
                f"{format_size(self.split.weights - self.resident_bytes)} to spare")


# ---- layouts ------------------------------------------------------------------------------------


def config_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint known from its config.json alone (a file, or a folder holding one): spec, no tensors."""
    from engine.formats.hf import read_json
    from engine.models import spec_from_config

    path = Path(path).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ColibriError(f"--config-only {path}: no config.json there; download the model's config.json (its "
                           "Hugging Face page, Files tab) and pass the file or the folder holding it")
    config = read_json(config_file, "config.json")
    return Checkpoint(config_file.parent, config, spec_from_config(config, str(config_file)), None, None, {})


def fetch_config(repo_id: str) -> Path:
    """config.json of a Hugging Face repo, downloaded alone (into the hub client's cache, reused from there)."""
    import huggingface_hub as hub

    from app.hub.pull import _hub_error

    cached = hub.try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    try:
        if not getattr(hub.constants, "is_offline_mode", lambda: hub.constants.HF_HUB_OFFLINE)():
            # one quick request first: the download itself retries an unreachable hub for about 20 s
            hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, "config.json"))
        return Path(hub.hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # the hub client raises many kinds; app.hub.pull names the cause
        reason = _hub_error(repo_id, exc).reason
        raise ColibriError(f"{reason}; to plan without the hub, download config.json from "
                           f"https://huggingface.co/{repo_id} on a connected machine and run "
                           f"`colibri plan --config-only PATH/config.json --max-memory SIZE`") from exc


def split_for(spec: ModelSpec, total: int, ctx: int, baseline: int) -> BudgetSplit:
    """The budget's split as `run` makes it (the interpreter's `baseline` on top, not inside), also when it leaves
    nothing for the weights (the verdict then says what is needed)."""
    check_ctx(spec, ctx)
    return BudgetSplit(total, kv_bytes(spec, ctx), working_bytes(spec, ctx), baseline, ctx, apart=True)


@functools.lru_cache(maxsize=None)
def _row_bytes(in_features: int, bits: int, group: int) -> int:
    return _bytes_at((1, in_features), bits, group)


def _matrix_bytes(shape: tuple[int, int], bits: int, group: int) -> int:
    """Storage bytes of a matrix at a width (one row measured per row length and format)."""
    return shape[0] * _row_bytes(shape[1], bits, group)


def _expert_groups(spec: ModelSpec, mats: Matrices) -> tuple[frozenset[str], int, int]:
    """(names of routed expert matrices, experts per MoE layer summed over layers, top_k sum)."""
    names = frozenset(n for ns in mats.experts.values() for n in ns)
    moe = [layer.ffn for layer in spec.layers if isinstance(layer.ffn, MoESpec)]
    return names, sum(f.n_experts for f in moe), sum(f.top_k for f in moe)


def _float_bytes(mats: Matrices) -> int:
    return sum(int(np.prod(s)) * 4 for s in mats.float32.values())


def _streamed_bytes(mats: Matrices, name: str, stream_bits: int, group: int) -> int:
    """Bytes of a routed expert matrix stored at stream_bits."""
    shape = mats.planned[name]
    return _matrix_bytes(shape, stream_bits, group_for(shape[1], group))


def _cache_minimum(spec: ModelSpec, mats: Matrices, bytes_of: Callable[[str], int]) -> int:
    """The expert cache the engine needs at least: top_k slots of the largest expert (page-rounded)."""
    if not mats.experts:
        return 0
    slot = max(round_up(sum(bytes_of(n) for n in names), PAGE) for names in mats.experts.values())
    return max(f.top_k for f in (layer.ffn for layer in spec.layers) if isinstance(f, MoESpec)) * slot


def _non_weights(split: BudgetSplit) -> str:
    where = " on top" if split.apart else ""
    return f"{split.kv_and_working}, interpreter and libraries {format_size(split.baseline)}{where}"


def config_layout(ckpt: Checkpoint, split: BudgetSplit, bits: int, stream_bits: int, group: int = 32) -> Layout:
    """Fixed widths from the spec alone: dense matrices at `bits`, routed experts at `stream_bits`."""
    mats = classify(ckpt)
    experts = _expert_groups(ckpt.spec, mats)[0]
    tensors = {}
    for name, shape in mats.planned.items():
        b = stream_bits if name in experts else bits
        g = group_for(shape[1], group)
        tensors[name] = TensorPlan(name, shape, b, g, _matrix_bytes(shape, b, g), 0.0, 1.0)
    narrower = [b for b in BIT_OPTIONS if b < bits]
    advice = "lower --ctx" + (f" or --bits (e.g. --bits {narrower[-1]})" if narrower else "")
    return _place(ckpt.spec, split, mats, Plan(tensors, None, _float_bytes(mats)), f"at {bits} bits ", advice)


def _place(spec: ModelSpec, split: BudgetSplit, mats: Matrices, plan: Plan, widths: str, advice: str) -> Layout:
    """A plan of given widths against the split's weight budget: all resident, the routed experts partly cached
    (the rest streams), or BudgetTooSmall naming the least budget and `advice`."""
    experts, n_experts, top_k = _expert_groups(spec, mats)
    tensors = plan.tensors
    expert_total = sum(tensors[n].nbytes for n in experts)
    dense_total = plan.total_bytes - expert_total
    cache_min = _cache_minimum(spec, mats, lambda n: tensors[n].nbytes)
    if split.weights >= plan.total_bytes:
        return Layout(plan, experts, n_experts, top_k, 1.0)
    if experts and split.weights >= dense_total + cache_min:
        return Layout(plan, experts, n_experts, top_k, (split.weights - dense_total) / expert_total)
    need = dense_total + cache_min if experts else dense_total
    what = (f"dense weights {widths}{format_size(dense_total)}, {format_size(cache_min)} of expert cache"
            if experts else f"weights {widths}{format_size(dense_total)}")
    raise BudgetTooSmall(split.total - split.weights + need, f"{what}, {_non_weights(split)}", advice)


def container_layout(ckpt: Checkpoint, split: BudgetSplit) -> Layout:
    """A Colibri container's own widths (it is quantized already): what stays resident and what streams.

    The engine holds the dense part and caches as many routed experts as the rest of the weight budget
    takes (at least the least expert cache), as `--max-memory` at run time does.
    """
    container = ckpt.source
    mats = classify(ckpt)
    tensors = {}
    for name, shape in mats.planned.items():
        e = container.entries[name]
        if e.kind == "quant":
            tensors[name] = TensorPlan(name, shape, int(e.quant["bits"]), int(e.quant["group"]), e.length, 0.0, 1.0,
                                       bool(e.quant.get("asymmetric", False)))
        else:
            tensors[name] = TensorPlan(name, shape, FLOAT_BITS, 0, e.length, 0.0, 1.0)
    other = sum(container.entries[n].length for n in mats.float32)
    return _place(ckpt.spec, split, mats, Plan(tensors, None, other), "as converted ",
                  "lower --ctx, or convert the original model narrower")


def calibrated_floor(ckpt: Checkpoint, split: BudgetSplit, settings: ConvertSettings, stream_bits: int) -> None:
    """Raise BudgetTooSmall before calibrating when not even the narrowest widths fit the budget.

    The narrowest plan has every matrix at 2 bits (or its forced width); an MoE that streams needs
    its dense part in at most half the weight budget (how `calibrated_layout` divides it) and room
    for the engine's least expert cache beside it.
    """
    mats = classify(ckpt)
    experts, _, _ = _expert_groups(ckpt.spec, mats)
    keep = list(settings.keep)

    def floor(name: str) -> int:
        shape = mats.planned[name]
        b = forced_bits(name, keep) or BIT_OPTIONS[0]
        return _matrix_bytes(shape, b, 0 if b == FLOAT_BITS else group_for(shape[1], GROUP_OPTIONS[-1]))

    other = _float_bytes(mats)
    everything = other + sum(floor(n) for n in mats.planned)
    need = everything
    if experts:
        dense = other + sum(floor(n) for n in mats.planned if n not in experts)
        cache_min = _cache_minimum(ckpt.spec, mats, lambda n: _streamed_bytes(mats, n, stream_bits, settings.group))
        need = min(everything, max(2 * dense, dense + cache_min))
    if split.weights < need:
        raise BudgetTooSmall(split.total - split.weights + need,
                             f"weights at the narrowest widths {format_size(need)}, {_non_weights(split)}")


def calibrated_layout(ckpt: Checkpoint, split: BudgetSplit, stats: ActivationStats, settings: ConvertSettings,
                      stream_bits: int, log) -> Layout:
    """Plan the model for the split's weight budget from measured errors (see the module header).

    `calibrated_floor` says first, before calibration is spent, when no plan can fit.
    """
    mats = classify(ckpt)
    experts, n_experts, top_k = _expert_groups(ckpt.spec, mats)
    other = _float_bytes(mats)
    try:
        plan = make_plan(ckpt, mats, ConvertSettings(budget=split.weights, group=settings.group, keep=settings.keep),
                         stats, log)
        return Layout(plan, experts, n_experts, top_k, 1.0, True)
    except ColibriError:
        if not experts:
            raise
    # too large to hold: plan the dense part into half the budget (less the least expert cache when that is
    # larger), stream the experts at stream_bits
    def expert_bytes(n: str) -> int:
        return _streamed_bytes(mats, n, stream_bits, settings.group)

    dense_budget = min(split.weights // 2, split.weights - _cache_minimum(ckpt.spec, mats, expert_bytes))
    dense = Matrices({n: s for n, s in mats.planned.items() if n not in experts}, mats.float32, {})
    plan_dense = make_plan(ckpt, dense, ConvertSettings(budget=dense_budget, group=settings.group, keep=settings.keep),
                           stats, log)
    tensors = dict(plan_dense.tensors)
    for n in experts:
        shape = mats.planned[n]
        tensors[n] = TensorPlan(n, shape, stream_bits, group_for(shape[1], settings.group), expert_bytes(n), 0.0,
                                stats.usage(n))
    plan = Plan(tensors, split.weights, other)
    expert_total = sum(tensors[n].nbytes for n in experts)
    room = split.weights - plan_dense.total_bytes
    return Layout(plan, experts, n_experts, top_k, max(0.0, min(1.0, room / expert_total)), True)


def predict(spec: ModelSpec, split: BudgetSplit, layout: Layout, rates_for: Callable[[Work], Rates]) -> Prediction:
    """Memory and speed of a layout; `rates_for(work)` measures this machine for what the layout computes."""
    plan = layout.plan
    share = layout.cache_share
    expert_bytes = sum(plan.tensors[n].nbytes for n in layout.experts)
    dense_bytes = plan.total_bytes - expert_bytes
    work = plan_work(spec, plan, layout.experts, share, layout.routing_measured)
    speeds = predict_speeds(work, rates_for(work), split.ctx)
    return Prediction(plan, split, int(dense_bytes + share * expert_bytes), int(expert_bytes * (1 - share)), share,
                      kv_bytes(spec, split.ctx, 8), speeds)


# ---- the report -------------------------------------------------------------------------------


def describe(p: Prediction) -> str:
    """The plan as the user reads it: the verdict first."""
    lines = [p.verdict, f"memory: {p.split.describe()}",
             f"KV cache for {p.split.ctx} tokens: {format_size(p.split.kv)} in float32; `--kv-bits 8` at run time "
             f"takes about a quarter of that, {format_size(p.kv_int8_bytes)}"]
    groups: dict[str, list[TensorPlan]] = {}
    for t in p.plan.tensors.values():
        groups.setdefault(_group_name(t.name), []).append(t)
    lines.append(f"{'matrices':34} {'bits':>14} {'bytes':>10}")
    for g, ts in sorted(groups.items()):
        weights = sum(t.shape[0] * t.shape[1] for t in ts)
        bits = 8 * sum(t.nbytes for t in ts) / weights
        mix = "/".join(str(b) for b in sorted({t.bits for t in ts}))
        lines.append(f"{g:34} {bits:6.2f} ({mix:>5}) {format_size(sum(t.nbytes for t in ts)):>10}")
    streams = (f"; streamed from disk {format_size(p.streamed_bytes)} ({(1 - p.expert_cache_share) * 100:.0f}% of "
               "routed experts)" if p.streamed_bytes else "; nothing streams")
    lines.append(f"average {p.plan.bits_per_weight:.2f} bits per weight; resident {format_size(p.resident_bytes)}"
                 + streams)
    lines.extend(describe_speeds(p.speeds))
    now = memory_now()          # other programs' memory counts against the budget too
    if now is not None and (note := now.note(p.split.total + (p.split.baseline if p.split.apart else 0))):
        lines.append(f"memory now: {note}")
    return "\n".join(lines)


def _group_name(name: str) -> str:
    parts = name.split(".")
    if name.startswith("model.layers."):
        kind = "experts" if ".experts." in name else ("attention" if "self_attn" in name else "mlp")
        return f"layers.*.{kind}.{parts[-2]}"
    return ".".join(parts[-3:-1]) if len(parts) > 2 else parts[0]
