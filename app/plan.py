"""`colibri plan`: what a model becomes under a memory budget, before converting it (or downloading it).

The budget is split (KV cache for the context, working buffers, the measured interpreter
footprint); the rest goes to the weights. Two ways to a layout:
- with the weights (`calibrated_layout`): calibration measures each matrix's error and, when every
  matrix fits at some width, the planner picks the widths and the whole model is resident. When it
  does not (an MoE larger than memory), the dense part is planned into at most half the weight
  budget (leaving room for the engine's least expert cache), routed experts are stored at
  `stream_bits`, as many as fit are cached in RAM and the rest stream;
- from config.json alone (`config_layout`): fixed widths, `bits` for dense matrices and
  `stream_bits` for routed experts, nothing read but the config.
Either way the verdict comes first: it fits, it fits with experts streaming, or it does not fit
and `BudgetTooSmall` says the least budget that would do.

Predicted decode speed comes from measured bandwidths: RAM for resident bytes, disk (read as
streamed experts are: O_DIRECT where allowed, several threads) for the expert bytes that miss the
cache (routing assumed uniform; a learned pinned set does better).
Predicted prompt speed comes from the measured speed of the engine's quantized matmul on a
prompt chunk (prompts are compute-bound: a chunk reads each weight once for all its tokens) plus
the expert bytes a chunk must read from disk.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from app.budget import BudgetSplit, split_budget
from app.convert import ConvertSettings, Matrices, _bytes_at, classify, make_plan
from app.sizes import format_size
from engine.calibration import ActivationStats
from engine.errors import ColibriError
from engine.generate import PREFILL_CHUNK
from engine.loader import Checkpoint
from engine.planner import BIT_OPTIONS, FLOAT_BITS, GROUP_OPTIONS, Plan, TensorPlan, forced_bits, group_for
from engine.spec import ModelSpec, MoESpec
from engine.stream.budget import kv_bytes, working_bytes
from engine.stream.io import PAGE, round_up


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
class Machine:
    """The measured speeds the predictions rest on."""

    ram_gbs: float          # RAM read bandwidth
    disk_gbs: float         # cold reads from the model's disk, as experts stream
    dense_macs_s: float     # multiply-adds per second of a 4-bit matmul on a PREFILL_CHUNK-token batch
    expert_macs_s: float    # the same on the batch one routed expert gets from a chunk


@dataclass(frozen=True)
class Layout:
    """A plan and where its routed experts live."""

    plan: Plan
    experts: frozenset[str]   # names of the routed expert matrices
    n_experts: int            # experts per MoE layer, summed over layers
    top_k: int                # experts a token picks, summed over layers
    cache_share: float        # share of routed expert bytes held in RAM (1 when all resident)


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
    machine: Machine
    dense_macs: int              # multiply-adds per token outside routed experts
    expert_macs: int             # multiply-adds per token in the routed experts it picks
    prompt_disk_bytes_per_token: float  # expert bytes a prompt chunk reads from disk, per token
    kv_int8_bytes: int           # the KV cache for the context with `--kv-bits 8`

    @property
    def tok_s(self) -> float:
        """Predicted decode tokens per second."""
        ram = (self.bytes_per_token - self.disk_bytes_per_token) / (self.machine.ram_gbs * 1e9)
        disk = self.disk_bytes_per_token / (self.machine.disk_gbs * 1e9) if self.disk_bytes_per_token else 0.0
        return 1.0 / (ram + disk) if ram + disk > 0 else 0.0

    @property
    def prompt_tok_s(self) -> float:
        """Predicted prompt tokens per second (long prompts, in PREFILL_CHUNK-token chunks)."""
        m = self.machine
        seconds = self.dense_macs / m.dense_macs_s + (self.expert_macs / m.expert_macs_s if self.expert_macs else 0.0)
        if self.prompt_disk_bytes_per_token:
            seconds += self.prompt_disk_bytes_per_token / (m.disk_gbs * 1e9)
        return 1.0 / seconds if seconds > 0 else 0.0

    @property
    def verdict(self) -> str:
        """The one-line answer: does it fit, and what streams."""
        if self.streamed_bytes:
            return f"fits with {format_size(self.streamed_bytes)} of experts streaming from disk"
        return (f"fits in memory: {format_size(self.resident_bytes)} of weights resident, "
                f"{format_size(self.split.weights - self.resident_bytes)} to spare")


# ---- measuring the machine ---------------------------------------------------------------------


def measure_disk_bandwidth(folder: Path, nbytes: int = 256 << 20) -> float:
    """Cold read speed (GB/s) of a scratch file in `folder`, read the way streamed experts are."""
    from app.doctor import measure_disk_read

    return measure_disk_read(folder, nbytes)


def measure_matmul_rate(tokens: int, size: int = 1024, bits: int = 4, seconds: float = 0.2) -> float:
    """Multiply-adds per second of the engine's `bits`-bit matmul of a [size, size] matrix on `tokens` rows."""
    from engine.quant import quantize

    rng = np.random.default_rng(0)
    w = quantize(rng.standard_normal((size, size), dtype=np.float32), bits, 32)
    x = rng.standard_normal((tokens, size), dtype=np.float32)     # [T, size]
    w.matmul(x)                                                   # compile (or load) the kernels first
    best, t_end = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        w.matmul(x)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            return size * size * tokens / best


def expert_batch(spec: ModelSpec) -> int:
    """Tokens one routed expert gets, on average, from a prompt chunk (uniform routing)."""
    moe = [layer.ffn for layer in spec.layers if isinstance(layer.ffn, MoESpec)]
    if not moe:
        return PREFILL_CHUNK
    return max(1, round(PREFILL_CHUNK * sum(f.top_k for f in moe) / sum(f.n_experts for f in moe)))


def measure_machine(folder: Path, spec: ModelSpec) -> Machine:
    """RAM and disk bandwidth now, and the matmul rates of this model's prompt batches."""
    from app.bench import measure_bandwidth

    dense = measure_matmul_rate(PREFILL_CHUNK)
    batch = expert_batch(spec)
    return Machine(measure_bandwidth(), measure_disk_bandwidth(folder), dense,
                   dense if batch == PREFILL_CHUNK else measure_matmul_rate(batch))


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

    from app.pull import _hub_error

    cached = hub.try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    try:
        if not getattr(hub.constants, "is_offline_mode", lambda: hub.constants.HF_HUB_OFFLINE)():
            # one quick request first: the download itself retries an unreachable hub for about 20 s
            hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, "config.json"))
        return Path(hub.hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # the hub client raises many kinds; app.pull names the cause
        reason = _hub_error(repo_id, exc).reason
        raise ColibriError(f"{reason}; to plan without the hub, download config.json from "
                           f"https://huggingface.co/{repo_id} on a connected machine and run "
                           f"`colibri plan --config-only PATH/config.json --max-memory SIZE`") from exc


def split_for(spec: ModelSpec, total: int, ctx: int, baseline: int) -> BudgetSplit:
    """The budget's split, also when it leaves nothing for the weights (the verdict then says what is needed)."""
    try:
        return split_budget(spec, total, ctx, baseline)
    except ColibriError:
        if not 1 <= ctx <= spec.max_position:
            raise
        return BudgetSplit(total, kv_bytes(spec, ctx), working_bytes(spec, ctx), baseline, ctx)


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
    return (f"KV cache for {split.ctx} tokens {format_size(split.kv)}, working buffers {format_size(split.working)}, "
            f"interpreter and libraries {format_size(split.baseline)}")


def config_layout(ckpt: Checkpoint, split: BudgetSplit, bits: int, stream_bits: int, group: int = 32) -> Layout:
    """Fixed widths from the spec alone: dense matrices at `bits`, routed experts at `stream_bits`."""
    mats = classify(ckpt)
    experts, n_experts, top_k = _expert_groups(ckpt.spec, mats)
    tensors = {}
    for name, shape in mats.planned.items():
        b = stream_bits if name in experts else bits
        g = group_for(shape[1], group)
        tensors[name] = TensorPlan(name, shape, b, g, _matrix_bytes(shape, b, g), 0.0, 1.0)
    plan = Plan(tensors, None, _float_bytes(mats))
    expert_total = sum(tensors[n].nbytes for n in experts)
    dense_total = plan.total_bytes - expert_total
    cache_min = _cache_minimum(ckpt.spec, mats, lambda n: tensors[n].nbytes)
    if split.weights >= plan.total_bytes:
        return Layout(plan, experts, n_experts, top_k, 1.0)
    if experts and split.weights >= dense_total + cache_min:
        return Layout(plan, experts, n_experts, top_k, (split.weights - dense_total) / expert_total)
    need = dense_total + cache_min if experts else dense_total
    what = (f"dense weights at {bits} bits {format_size(dense_total)}, {format_size(cache_min)} of expert cache"
            if experts else f"weights at {bits} bits {format_size(dense_total)}")
    narrower = [b for b in BIT_OPTIONS if b < bits]
    advice = "lower --ctx" + (f" or --bits (e.g. --bits {narrower[-1]})" if narrower else "")
    raise BudgetTooSmall(split.total - split.weights + need, f"{what}, {_non_weights(split)}", advice)


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
        return Layout(plan, experts, n_experts, top_k, 1.0)
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
    return Layout(plan, experts, n_experts, top_k, max(0.0, min(1.0, room / expert_total)))


def predict(spec: ModelSpec, split: BudgetSplit, layout: Layout, machine: Machine) -> Prediction:
    """Memory and speed of a layout on this machine."""
    plan = layout.plan
    share = layout.cache_share
    expert_bytes = sum(plan.tensors[n].nbytes for n in layout.experts)
    dense_bytes = plan.total_bytes - expert_bytes
    per_expert = expert_bytes / layout.n_experts if layout.n_experts else 0.0
    pick = layout.top_k / layout.n_experts if layout.n_experts else 0.0   # share of experts a token uses
    embed = plan.tensors.get("model.embed_tokens.weight")
    looked_up = embed is not None and not spec.tie_embeddings            # untied: a token reads one row
    embed_bytes = embed.nbytes if looked_up else 0
    per_token = int(dense_bytes - embed_bytes + layout.top_k * per_expert)
    disk = layout.top_k * per_expert * (1.0 - share)
    macs = {n: t.shape[0] * t.shape[1] for n, t in plan.tensors.items()}
    dense_macs = sum(m for n, m in macs.items() if n not in layout.experts) - (macs[embed.name] if looked_up else 0)
    expert_macs = int(pick * sum(macs[n] for n in layout.experts))
    touched = 1.0 - (1.0 - pick) ** PREFILL_CHUNK                        # share of experts a chunk reads
    prompt_disk = expert_bytes * (1.0 - share) * touched / PREFILL_CHUNK
    return Prediction(plan, split, int(dense_bytes + share * expert_bytes), int(expert_bytes * (1 - share)), share,
                      per_token, disk, machine, dense_macs, expert_macs, prompt_disk, kv_bytes(spec, split.ctx, 8))


# ---- the report -------------------------------------------------------------------------------


def describe(p: Prediction) -> str:
    """The plan as the user reads it: the verdict first."""
    m = p.machine
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
    prompt = [f"{p.dense_macs / 1e6:.1f} M multiply-adds per token at {m.dense_macs_s / 1e9:.1f} G/s"]
    if p.expert_macs:
        prompt.append(f"{p.expert_macs / 1e6:.1f} M in experts at {m.expert_macs_s / 1e9:.1f} G/s")
    if p.prompt_disk_bytes_per_token:
        prompt.append(f"{format_size(p.prompt_disk_bytes_per_token)} from disk")
    lines.append(f"predicted prompt {p.prompt_tok_s:.1f} tok/s: {', '.join(prompt)} ({PREFILL_CHUNK}-token chunks, "
                 "matmul speed measured now)")
    decode = [f"{format_size(p.bytes_per_token)} of weights per token at {m.ram_gbs:.1f} GB/s RAM"]
    if p.disk_bytes_per_token:
        decode.append(f"{format_size(p.disk_bytes_per_token)} from disk at {m.disk_gbs:.2f} GB/s")
    lines.append(f"predicted decode {p.tok_s:.1f} tok/s: {', '.join(decode)}")
    return "\n".join(lines)


def _group_name(name: str) -> str:
    parts = name.split(".")
    if name.startswith("model.layers."):
        kind = "experts" if ".experts." in name else ("attention" if "self_attn" in name else "mlp")
        return f"layers.*.{kind}.{parts[-2]}"
    return ".".join(parts[-3:-1]) if len(parts) > 2 else parts[0]
