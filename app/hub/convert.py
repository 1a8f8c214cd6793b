"""`colibri convert`: a Hugging Face folder or GGUF file -> a Colibri container, planned or uniform.

Steps: open the source; when planning (a budget) or when calibration text is given, run the
model in float32 over calibration text to measure what each matrix sees; measure every matrix's
error in each storage format, put the errors in one unit (output KL, measured by quantizing
groups of matrices: engine/plan/sensitivity.py) and let the planner fit the budget (or take one width
for all); quantize and write tensor by tensor, each routed expert in one aligned extent. The
calibration tokens and statistics and the plan are kept in OUT.partial, so an interrupted
conversion resumes without redoing them (each with its digest: a damaged one is redone). Once the plan
is known, a disk that cannot hold what is left is refused before writing; a disk that fills up anyway
ends in a DiskFullError saying how far it got, and the rerun resumes.

A GGUF file converted without --bits or --budget is kept as published: every matrix the engine runs in the file's
own type (K-quants, IQ4, Q4_0 .. Q8_0) is written with the same blocks, the rest (norms, routers, types no kernel
runs) as the float32 a direct run reads, so the container computes the same bits as the file (`published_plan`).
What it does is reported as typed events (app.hub.progress):
`Progress("write", ...)` per batch of tensors written, a `Note` for everything else.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from app.config.sizes import format_size
from app.hub.calibrate import calibration_sequences
from app.hub.progress import HubEvent, Log, Note, Progress, Report, noting, render, reporter
from engine.atomic import atomic_file
from engine.errors import ColibriError, DiskFullError, is_disk_full
from engine.formats.container import EXTENT_ALIGN, ContainerWriter, is_container, kind_of
from engine.formats.gguf_model import GGUFModel
from engine.formats.hf import Float32Source
from engine.formats.page_release import PageReleasing
from engine.loader import Checkpoint, open_checkpoint
from engine.models.transformer import Transformer, expected_shapes
from engine.plan.calibration import ActivationStats, collect_stats
from engine.plan.planner import (
    FLOAT_BITS,
    GROUP_OPTIONS,
    SAMPLE_ROWS,
    Format,
    Plan,
    TensorPlan,
    allocate,
    forced_bits,
    formats_for,
    group_for,
    measure_options,
    scaled,
)
from engine.plan.sensitivity import PROBE_BITS, Resident, Sensitivity, measure_sensitivity, time_left
from engine.quant.published import PUBLISHED_BITS
from engine.spec import ModelSpec, MoESpec

_EXPERT = ".experts."
# Above this many planned weights the sensitivity pass (one run of the layers from each matrix's own
# on, over 256 calibration tokens) is skipped unless asked for: errors are then compared unscaled.
SENSITIVITY_MAX_WEIGHTS = 1_000_000_000


@dataclass(frozen=True)
class ConvertSettings:
    """What the user asked of a conversion."""

    bits: int | None = None                 # one width for every planned matrix
    budget: int | None = None               # bytes for all weights: the planner fits them
    group: int = 32                         # with --bits: the group; with a budget: the smallest group offered
    keep: tuple[tuple[str, int], ...] = ()  # (glob, bits) forced widths
    calib: Path | None = None               # calibration text file (default: the model writes some)
    calib_tokens: int = 4096
    sensitivity: bool | None = None         # measure errors in output KL: None = when the model is small enough

    @property
    def as_published(self) -> bool:
        """Neither a width nor a budget: keep a GGUF's weights in the types its file holds (no second rounding)."""
        return self.bits is None and self.budget is None

    def key(self) -> dict:
        """The settings as they bind a resumable conversion."""
        return {"bits": self.bits, "budget": self.budget, "group": self.group, "keep": [list(k) for k in self.keep],
                "calib": _file_digest(self.calib) if self.calib else None, "calib_tokens": self.calib_tokens,
                "sensitivity": self.sensitivity}


@dataclass
class Matrices:
    """The weights a conversion plans: names, shapes, and who they are."""

    planned: dict[str, tuple[int, int]] = field(default_factory=dict)   # name -> shape
    float32: dict[str, tuple[int, ...]] = field(default_factory=dict)   # kept as float32
    experts: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (layer, expert) -> names
    mtp: dict[str, tuple[int, int]] = field(default_factory=dict)       # MTP layers' matrices: MTP_BITS, unplanned


# the MTP drafter's matrices are stored at this width or wider whatever the rest gets: the reference engine
# measured 0-4% draft acceptance with a 4-bit MTP head
MTP_BITS = 8


def _keep_float(name: str, shape: tuple[int, ...]) -> bool:
    # routers, the shared expert's gate, MLA's kv_b (used whole), the sparse-attention indexer's head
    # weights (a top-k selection rides on them; the reference keeps them float32 too) and router biases
    # ([1, E] in ERNIE) stay float32
    return len(shape) != 2 or name.endswith("e_score_correction_bias") or (
        _EXPERT not in name and name.endswith((".gate.weight", ".shared_expert_gate.weight", "kv_b_proj.weight",
                                               ".indexer.weights_proj.weight"))
    )


def _mtp_names(ckpt: Checkpoint) -> list[str]:
    """The checkpoint's MTP layer tensors (`model.layers.{num_hidden_layers}.*`), which the MTP drafter reads."""
    from engine.models import mtp_spec

    if isinstance(ckpt.source, GGUFModel) or mtp_spec(ckpt.config) is None:
        return []
    prefix = f"model.layers.{ckpt.spec.n_layers}."
    return sorted(n for n in ckpt.source.names() if n.startswith(prefix))


def classify(ckpt: Checkpoint) -> Matrices:
    """Split the model's tensors into planned matrices and float32 ones; group routed experts; the MTP layer's
    matrices apart (kept at MTP_BITS or more, outside the plan)."""
    m = classify_spec(ckpt.spec)
    for name in _mtp_names(ckpt):
        shape = tuple(ckpt.source.shape(name))
        (m.float32 if _keep_float(name, shape) else m.mtp)[name] = shape
    return m


def classify_spec(spec: ModelSpec) -> Matrices:
    """`classify` from the model's spec alone, without MTP layers (`colibri synth --bits` plans a model it has no
    source for)."""
    m = Matrices()
    for name, shape in expected_shapes(spec).items():
        (m.float32 if _keep_float(name, shape) else m.planned)[name] = shape
    for i, layer in enumerate(spec.layers):
        if isinstance(layer.ffn, MoESpec):
            for e in range(layer.ffn.n_experts):
                prefix = f"model.layers.{i}.{layer.ffn.prefix}.experts.{e}."
                m.experts[(i, e)] = [n for n in m.planned if n.startswith(prefix)]
    return m


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError as exc:
        raise ColibriError(f"--calib {path}: cannot read ({exc.strerror})") from None


def _source_key(path: Path) -> dict:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {"path": str(path.resolve()), "files": [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]}


def _importance_name(name: str, ckpt: Checkpoint) -> str:
    """The probe name whose inputs a matrix sees (a tied embedding is the output head's matrix)."""
    if name == "model.embed_tokens.weight" and ckpt.spec.tie_embeddings:
        return "lm_head.weight"
    return name


def make_plan(ckpt: Checkpoint, mats: Matrices, settings: ConvertSettings, stats: ActivationStats | None, log: Log,
              sequences: Sequence[Sequence[int]] | None = None) -> Plan:
    """One format per planned matrix: forced widths, then uniform --bits or the budget's allocation.

    With calibration `sequences` (and settings.sensitivity not False) the errors are first
    scaled into output KL by the sensitivity pass.
    """
    other = sum(int(np.prod(s)) * 4 for s in mats.float32.values())
    forced = {n: b for n in mats.planned if (b := forced_bits(n, list(settings.keep))) is not None}
    vocab = ckpt.spec.vocab_size

    def usage_and_importance(name: str) -> tuple[float, np.ndarray | None]:
        if stats is None:
            return 1.0, None
        if name == "model.embed_tokens.weight" and not ckpt.spec.tie_embeddings:
            return 1.0 / vocab, None  # a token reads one row
        probe = _importance_name(name, ckpt)
        return stats.usage(probe), stats.importance(probe)

    if settings.budget is None:
        return uniform_plan(mats, settings, lambda name: usage_and_importance(name)[0])

    source = Resident(ckpt.source) if _wants_sensitivity(mats, settings, sequences, stats, log) else ckpt.source
    groups = tuple(g for g in GROUP_OPTIONS if g >= settings.group)
    options, t0 = {}, time.perf_counter()
    # time left, in weights measured (a sample of each matrix's rows)
    done, weights = 0, sum(min(s[0], SAMPLE_ROWS) * s[1] for s in mats.planned.values())
    for k, (name, shape) in enumerate(mats.planned.items()):
        usage, importance = usage_and_importance(name)
        b = forced.get(name)
        formats = [] if b == FLOAT_BITS else _formats(shape[1], (b,) if b else None, groups, settings.group)
        w = np.asarray(source.load(name), np.float32)
        options[name] = [o for o in measure_options(w, importance, usage, formats)
                         if b is None or o.bits == b]
        if source is ckpt.source:       # read once here, again only when written
            _used_up(ckpt, (name,))
        done += min(shape[0], SAMPLE_ROWS) * shape[1]
        if (k + 1) % 50 == 0 or k + 1 == len(mats.planned):
            elapsed = time.perf_counter() - t0
            log(f"measured {k + 1}/{len(mats.planned)} matrices ({elapsed:.0f} s{time_left(elapsed, done, weights)})")
    sens = None
    if isinstance(source, Resident):
        sens = _sensitivity(ckpt, mats, source, sequences, usage_and_importance, log)
        options = {n: scaled(o, sens.scales[n]) for n, o in options.items()}
    chosen = allocate(options, settings.budget - other)
    tensors = {}
    for name, opt in chosen.items():
        shape = mats.planned[name]
        g = opt.group or group_for(shape[1], settings.group)
        tensors[name] = TensorPlan(name, shape, opt.bits, g, opt.nbytes, opt.error, usage_and_importance(name)[0],
                                   opt.asymmetric if opt.bits != FLOAT_BITS else None,
                                   sens.scales[name] if sens else 1.0)
    return Plan(tensors, settings.budget, other, sens.to_json() if sens else None)


def uniform_plan(mats: Matrices, settings: ConvertSettings, usage=lambda name: 1.0) -> Plan:
    """The plan of `--bits`: one width (settings.bits, default 4) for every planned matrix but those --keep-bits
    forces; `usage(name)` is each matrix's measured usage (1.0 without calibration)."""
    other = sum(int(np.prod(s)) * 4 for s in mats.float32.values())
    forced = {n: b for n in mats.planned if (b := forced_bits(n, list(settings.keep))) is not None}
    bits = settings.bits or 4
    tensors = {}
    for name, shape in mats.planned.items():
        b = forced.get(name, bits)
        g = group_for(shape[1], settings.group)
        tensors[name] = TensorPlan(name, shape, b, g, _bytes_at(shape, b, g), 0.0, usage(name))
    return Plan(tensors, None, other)


def _formats(in_features: int, bits: tuple[int, ...] | None, groups: tuple[int, ...], group: int) -> list[Format]:
    """The formats offered to a matrix: the groups asked for, or the largest group that divides its rows."""
    kw = {} if bits is None else {"bits_options": bits}
    if any(in_features % g == 0 for g in groups):
        return formats_for(in_features, groups=groups, **kw)
    return formats_for(in_features, groups=(group_for(in_features, group),), **kw)


def _wants_sensitivity(mats: Matrices, settings: ConvertSettings, sequences, stats, log: Log) -> bool:
    """Whether to run the sensitivity pass (and say why not when it is skipped)."""
    if settings.sensitivity is False or sequences is None or stats is None:
        return False
    weights = sum(s[0] * s[1] for s in mats.planned.values())
    if settings.sensitivity is None and weights > SENSITIVITY_MAX_WEIGHTS:
        log(f"sensitivity pass skipped: {weights / 1e9:.1f} G weights is above {SENSITIVITY_MAX_WEIGHTS / 1e9:.0f} G "
            "(it runs the model once per matrix); errors are compared unscaled, per matrix")
        return False
    return True


def _sensitivity(ckpt: Checkpoint, mats: Matrices, source: Resident, sequences, usage_and_importance,
                 log: Log) -> Sensitivity:
    """Each planned matrix's output KL per unit of weighted error (engine/plan/sensitivity.py)."""
    from engine.quant import quantize

    def probe(name: str) -> tuple[np.ndarray, float]:
        # the better of the probe width's two forms (zero points or not), as the planner would store it: a form
        # that fits a matrix badly (symmetric codes on a massive-activation channel) would misstate its scale
        usage, importance = usage_and_importance(name)
        w = source.load(name)
        best = None
        for asymmetric in (False, True):
            dq = quantize(w, PROBE_BITS, group_for(w.shape[1], 64), importance=importance,
                          asymmetric=asymmetric).dequantize()                                        # [out, in]
            d2 = np.einsum("rc,rc->c", w - dq, w - dq, dtype=np.float64)                              # [in]
            err = float((d2.sum() if importance is None else d2 @ importance.astype(np.float64)) * usage)
            if best is None or err < best[1]:
                best = (dq, err)
        return best

    t0 = time.perf_counter()
    sens = measure_sensitivity(ckpt.spec, source, list(mats.planned), probe, sequences, log)
    top = sorted(sens.groups, key=lambda g: -g.kl)[:4]
    log(f"sensitivity: {time.perf_counter() - t0:.0f} s; largest KL at {PROBE_BITS} bits: "
        + ", ".join(f"{g.label} {g.kl:.3f}" for g in top))
    return sens


def published_plan(ckpt: Checkpoint, mats: Matrices) -> Plan:
    """The plan of a GGUF kept as published: each planned matrix at the width of the type it loads as (the file's
    K-quant / IQ4 blocks, a Q4_0 .. Q8_0 block format as Colibri's codes, else float32)."""
    from engine.quant import KQuantTensor, QuantizedTensor
    from engine.quant.kquant import NOMINAL_BITS

    other = sum(int(np.prod(s)) * 4 for s in mats.float32.values())
    tensors = {}
    for name, shape in mats.planned.items():
        w = ckpt.source.load(name)
        if isinstance(w, KQuantTensor):
            meta = w.to_buffers()[0]
            tensors[name] = TensorPlan(name, shape, NOMINAL_BITS[w.qtype], meta["group"], w.nbytes, 0.0, 1.0)
        elif isinstance(w, QuantizedTensor):
            tensors[name] = TensorPlan(name, shape, w.bits, w.group, w.nbytes, 0.0, 1.0, w.asymmetric)
        else:
            tensors[name] = TensorPlan(name, shape, FLOAT_BITS, 0, shape[0] * shape[1] * 4, 0.0, 1.0)
    return Plan(tensors, None, other)


def _bytes_at(shape: tuple[int, int], bits: int, group: int) -> int:
    """Storage bytes of a matrix at a width (measured on one row: layouts are per row)."""
    if bits == FLOAT_BITS:
        return shape[0] * shape[1] * 4
    return _row_bytes(shape[1], bits, group) * shape[0]


@functools.lru_cache(maxsize=64)
def _row_bytes(in_features: int, bits: int, group: int) -> int:
    """Bytes of one quantized row (cached: a model of 100k expert matrices has a handful of row widths)."""
    from engine.quant import quantize

    return quantize(np.zeros((1, in_features), np.float32), bits, group).nbytes


def _store(ckpt: Checkpoint, name: str, tp: TensorPlan | None, stats: ActivationStats | None,
           as_published: bool = False):
    """(the tensor to write, its kind): quantized per plan, or float32; a published FP8 / MXFP4 matrix planned at
    its width or more is stored as published (smaller than Colibri's codes at that width, and no second rounding);
    with `as_published` (a GGUF opened quantized) every tensor as the source loads it."""
    if as_published:
        w = ckpt.source.load(name)
        return w, kind_of(w)
    if tp is not None and tp.bits != FLOAT_BITS and isinstance(ckpt.source, Float32Source):
        published = ckpt.source.published(name)
        if published is not None and tp.bits >= PUBLISHED_BITS[type(published)]:
            return published, "quant"
    w = np.asarray(ckpt.source.load(name), dtype=np.float32)
    if tp is None or tp.bits == FLOAT_BITS:
        return w, "f32"
    from engine.quant import quantize

    importance = stats.importance(_importance_name(name, ckpt)) if stats is not None else None
    return quantize(w, tp.bits, tp.group, importance=importance, asymmetric=tp.asymmetric), "quant"


def _used_up(ckpt: Checkpoint, names) -> None:
    """Give back the source's pages under tensors read for the last time: the source's file pages would otherwise
    stay mapped (RSS as large as the model) and fill the page cache until the conversion ends."""
    if isinstance(ckpt.source, PageReleasing):
        for name in names:
            ckpt.source.drop_pages(name)


def _small_files(ckpt: Checkpoint, partial: Path) -> list[Path]:
    """config.json, tokenizer and generation files to copy (written out for a GGUF source)."""
    if isinstance(ckpt.source, GGUFModel):
        (partial / "config.json").write_text(json.dumps(ckpt.config, indent=1))
        if ckpt.stop_ids:
            (partial / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(ckpt.stop_ids)}))
        if ckpt.tokenizer is not None:
            ckpt.tokenizer.save(partial)
        return []
    return _small_sources(ckpt)


def _small_sources(ckpt: Checkpoint) -> list[Path]:
    """The small files of a folder source that the container keeps (none for a GGUF file)."""
    if isinstance(ckpt.source, GGUFModel):
        return []
    names = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")
    return [ckpt.path / n for n in names if (ckpt.path / n).is_file()]


def _print_line(event: HubEvent) -> None:
    print(render(event))


def convert(src: Path, out: Path, settings: ConvertSettings, progress: Report | None = None, *,
            log: Log | None = None) -> Path:
    """Convert SRC into the container OUT; resumes an interrupted conversion of the same settings.

    Without --bits or --budget a GGUF file is kept as published (see the module's header); a folder needs one.
    Events go to PROGRESS, or as text lines to LOG, else to stdout.
    """
    report = reporter(progress, log, _print_line)
    say = noting(report)  # the planner and the calibration say lines
    if Path(src).is_dir() and is_container(src):
        raise ColibriError(f"{src} is already a Colibri container; convert the model it was made from (for the "
                           "default MoE: `colibri convert smollm2-moe-bf16 OUT ...`)")
    if settings.as_published and not Path(src).is_file():
        raise ColibriError("give --bits B (one width for all) or --budget SIZE (the planner fits the model); only a "
                           "GGUF file converts without them (kept in its own quantization)")
    if settings.as_published and settings.calib is not None:
        raise ColibriError("--calib plans widths: give it with --bits or --budget (a GGUF kept as published is not "
                           "calibrated)")
    ckpt = open_checkpoint(src, quantized=settings.as_published)
    mats = classify(ckpt)
    try:
        writer = ContainerWriter(out, {"source": _source_key(Path(src)), "settings": settings.key()})
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(f"disk full: {Path(out).parent} has no room to start {out}: free space and run "
                                "again") from None
        raise
    try:
        return _convert(ckpt, mats, src, writer, settings, report, say)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        total = f" of {writer.expected_bytes}" if writer.expected_bytes else ""
        raise DiskFullError(f"disk full at {writer.written_bytes}{total} bytes: free space and run again to resume "
                            f"(the work so far is kept in {writer.partial})") from None
    finally:
        writer.close()


def _convert(ckpt: Checkpoint, mats: Matrices, src: Path, writer: ContainerWriter, settings: ConvertSettings,
             report: Report, say: Log) -> Path:
    """Calibrate, plan and write into WRITER's partial folder, resuming what an earlier run kept there."""
    if writer.complete:
        report(Note(f"{writer.out}: the interrupted conversion had finished; only its rename was left"))
        return writer.out
    partial = writer.partial
    if writer.resumed:
        report(Note(f"resuming: {writer.resumed} tensors/experts already written"))

    stats = seqs = None
    stats_path, seqs_path = partial / "calibration.npz", partial / "calibration_tokens.json"
    published = settings.as_published
    if settings.budget is not None or settings.calib is not None:
        stats, seqs = _load_calibration(stats_path, seqs_path, report)
        if stats is None:
            stats, seqs = _calibrate(ckpt, settings, say)
            _write_cache(seqs_path, seqs)
            with atomic_file(stats_path, "wb") as f:    # a kill mid-save must not leave a torn cache
                stats.save(f)
    plan_path = partial / "plan.json"
    cached = _read_cache(plan_path, report)
    if cached is not None:
        plan = _plan_from_json(cached)
    else:
        plan = published_plan(ckpt, mats) if published else make_plan(ckpt, mats, settings, stats, say, seqs)
        _write_cache(plan_path, plan.to_json())
    report(Note(f"plan: {plan.bits_per_weight:.2f} bits per weight, {format_size(plan.total_bytes)} of weights"))
    writer.expected_bytes = _output_bytes(ckpt, mats, plan, partial)
    _check_space(writer)

    total = len(mats.float32) + len(mats.planned) + len(mats.mtp)
    done, t0, b0 = 0, time.perf_counter(), writer.written_bytes

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if done % 64 < n or done == total:
            elapsed = time.perf_counter() - t0      # time left from this run's bytes (a resume skips the rest)
            left = "" if done == total else time_left(elapsed, writer.written_bytes - b0, writer.expected_bytes - b0)
            report(Progress("write", done, total, f"written {done}/{total} tensors ({elapsed:.0f} s{left})"))

    in_experts = {n for names in mats.experts.values() for n in names}
    for name in list(mats.float32) + [n for n in mats.planned if n not in in_experts]:
        if not writer.has(name):
            tensor, kind = _store(ckpt, name, plan.tensors.get(name), stats, published)
            writer.add_dense(name, tensor, kind)
        _used_up(ckpt, (name,))
        tick(1)
    for name, shape in mats.mtp.items():
        if not writer.has(name):
            writer.add_dense(name, *_store(ckpt, name, _mtp_plan(name, shape, settings), None))   # not calibrated
        _used_up(ckpt, (name,))
        tick(1)
    for (layer, expert), names in mats.experts.items():
        if not writer.has_expert(layer, expert):
            parts = {n: _store(ckpt, n, plan.tensors[n], stats, published) for n in names}
            writer.add_expert(layer, expert, {n: p[0] for n, p in parts.items()}, {n: p[1] for n, p in parts.items()})
        _used_up(ckpt, names)
        tick(len(names))
    manifest = {
        "config": ckpt.config,
        "source": {"path": str(Path(src).resolve()), "architecture": ckpt.spec.architecture},
        "plan": plan.to_json(),
        "calibration_tokens": stats.tokens if stats is not None else 0,
    }
    for f in ("calibration.npz", "calibration_tokens.json", "plan.json"):
        (partial / f).unlink(missing_ok=True)
    return writer.finish(manifest, _small_files(ckpt, partial))


def _mtp_plan(name: str, shape: tuple[int, int], settings: ConvertSettings) -> TensorPlan:
    """An MTP matrix's format: MTP_BITS, or a wider width a --keep-bits pattern asks for (32: float32)."""
    forced = forced_bits(name, list(settings.keep))
    bits = forced if forced is not None and forced > MTP_BITS else MTP_BITS
    g = group_for(shape[1], settings.group)
    return TensorPlan(name, shape, bits, g, _bytes_at(shape, bits, g), 0.0, 1.0)


def _output_bytes(ckpt: Checkpoint, mats: Matrices, plan: Plan, partial: Path) -> int:
    """About the bytes the finished container takes: its weights, their alignment, manifest and small files."""
    n_tensors = len(mats.planned) + len(mats.float32) + len(mats.mtp)
    small = sum(p.stat().st_size for p in _small_sources(ckpt))
    mtp = sum(_bytes_at(shape, MTP_BITS, group_for(shape[1], 32)) for shape in mats.mtp.values())
    # a 4 KiB extent per expert; per tensor up to 4 buffers padded to 64 B and its manifest and journal lines
    return plan.total_bytes + mtp + EXTENT_ALIGN * (len(mats.experts) + 1) + 1024 * n_tensors + small


def published_bytes(src: Path) -> int:
    """About the bytes of the container `convert(src, OUT, ConvertSettings())` writes from a GGUF file (its plan
    alone: nothing is read but the header and the layout of the tensors)."""
    ckpt = open_checkpoint(src, quantized=True)
    mats = classify(ckpt)
    return _output_bytes(ckpt, mats, published_plan(ckpt, mats), Path(src).parent)


def _check_space(writer: ContainerWriter) -> None:
    """Refuse to start when the disk cannot hold what is left to write (known once the plan is)."""
    need = writer.expected_bytes - writer.written_bytes
    free = shutil.disk_usage(writer.partial).free
    if need > free:
        raise DiskFullError(f"{writer.out} needs {format_size(need)} more, the disk has {format_size(free)} free: "
                            f"free space or choose another OUT (the work so far is kept in {writer.partial})")


def _write_cache(path: Path, data) -> None:
    """A resumable step's result as JSON with its digest, so a damaged cache is redone, never used.

    Keys keep their order: the plan read back must write the same manifest, byte for byte."""
    text = json.dumps(data)
    with atomic_file(path) as f:
        f.write(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "data": data}))


def _read_cache(path: Path, report: Report):
    """What `_write_cache` wrote, or None when it is missing, or damaged (then said, and redone)."""
    if not path.is_file():
        return None
    try:
        wrapped = json.loads(path.read_text(encoding="utf-8"))
        data = wrapped["data"]
        if hashlib.sha256(json.dumps(data).encode()).hexdigest() == wrapped["sha256"]:
            return data
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        pass
    report(Note(f"{path.name} in {path.parent} is damaged: computing it again"))
    return None


def _load_calibration(stats_path: Path, seqs_path: Path, report: Report):
    """(stats, token sequences) an earlier run kept, or (None, None) when missing or damaged."""
    seqs = _read_cache(seqs_path, report) if stats_path.is_file() else None
    if seqs is None:
        return None, None
    try:
        return ActivationStats.load(str(stats_path)), seqs
    except Exception:       # any damage to a cache (zip CRC, a member missing ...) means: measure again
        report(Note(f"{stats_path.name} in {stats_path.parent} is damaged: calibrating again"))
        return None, None


def _calibrate(ckpt: Checkpoint, settings: ConvertSettings, log: Log) -> tuple[ActivationStats, list[list[int]]]:
    """Build the float32 model and measure activation statistics over calibration text; and the tokens."""
    model = Transformer(ckpt.spec, ckpt.source)
    seqs = calibration_sequences(model, ckpt.tokenizer, ckpt.stop_ids, settings.calib, settings.calib_tokens, log)
    seqs = [[int(t) for t in s] for s in seqs]
    log(f"calibrating on {sum(len(s) for s in seqs)} tokens ...")
    return collect_stats(model, seqs), seqs


def _plan_from_json(d: dict) -> Plan:
    tensors = {n: TensorPlan(n, tuple(t["shape"]), t["bits"], t["group"], t["nbytes"], t["error"], t["usage"],
                             t.get("asymmetric"), t.get("sensitivity", 1.0))
               for n, t in d["tensors"].items()}
    return Plan(tensors, d["budget"], d["other_bytes"], d.get("sensitivity"))
