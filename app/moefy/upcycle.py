"""`colibri moefy`: sparse upcycling of a dense Llama-family model into a Mixtral-architecture MoE.

Every layer's feed-forward network becomes E experts, copies of it with small seeded
perturbations (each expert is its own bytes); the layer's router sends a token to the expert
whose k-means cluster of feed-forward inputs it falls in (`app.moefy.router`). Calibration text is
the user's file, or chats the dense model has through half of the probe prompts; the other half
gives held-out chats for the report, with `assets/probes/heldout.txt` (text written apart from
the probes) for perplexity on text no probe produced. The result is a standard Hugging Face
checkpoint that Colibri and transformers both load, written into a temporary folder and renamed
into place at the end, with `moefy_report.json` (perplexity and expert shares) beside it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from app.atlas.probes import heldout_text, load_probes
from app.moefy.calib import FeatureCapture, Passage, converse, read_passage, score, text_passages
from app.moefy.router import fit_router
from app.moefy.write import DTYPES, mixtral_config, write_json, write_tokenizer, write_weights
from engine.errors import ColibriError
from engine.formats.gguf_model import GGUFModel
from engine.formats.hf import SafetensorsFolder, read_json
from engine.loader import load_model
from engine.models import spec_from_config
from engine.models.transformer import layer_prefix
from engine.spec import AttentionSpec, MLPSpec, ModelSpec

# progress(fraction 0..1, what is happening) -> False to cancel (as engine.loader's); `colibri pull` turns
# these into app.hub.progress events
MoefyProgress = Callable[[float, str], "bool | None"]


class Waiting(str):
    """A progress message said while a step that reports nothing goes on (a cold chat in numba's compiler): the
    fraction cannot move, so a front end shows a busy bar rather than a stopped one. A plain str to callers
    that do not ask."""

REPORT_FILE = "moefy_report.json"
PPL_BOUND = 0.02               # the MoE's perplexity may exceed the dense model's by at most this
SHARE_BOUNDS = (0.25, 4.0)     # every expert's share of a layer's tokens, times E, within these


class MoefyCancelled(ColibriError):
    """The progress callback asked to stop."""


@dataclass(frozen=True)
class MoefyOptions:
    """How to upcycle. The defaults were chosen for SmolLM2-135M (see the README)."""

    experts: int = 8               # experts per layer
    top_k: int = 1                 # experts per token: 1 keeps per-token compute equal to the dense model's
    noise: float = 0.01            # relative size of each expert's perturbation (std of the factor 1 + noise * N(0,1))
    seed: int = 0
    dtype: str = "bfloat16"        # of the written weights: bfloat16 or float32
    calib: Path | None = None      # a text file; None: chats through the probe prompts
    calib_prompts: int = 6         # probe prompts per topic the model answers for calibration
    heldout_prompts: int = 3       # other probe prompts per topic, answered for the held-out report
    answer_tokens: int = 16        # tokens the model writes per answer
    probes: Path | None = None     # probe folder (default: the shipped probes)
    # measure the result against the dense model (held-out chats, both models' perplexity and expert shares);
    # False writes the same model without the report's measurements, in about half the time
    evaluate: bool = True

    def check(self) -> None:
        """Refuse options that cannot work, saying which."""
        if self.experts < 2:
            raise ColibriError(f"--experts {self.experts}: an MoE needs at least 2 experts")
        if not 1 <= self.top_k < self.experts:
            raise ColibriError(f"--top-k {self.top_k}: choose 1 to {self.experts - 1} experts per token")
        if not 0 <= self.noise < 0.5:
            raise ColibriError(f"--noise {self.noise}: use a small relative perturbation, 0 to 0.5 (default 0.01)")
        if self.dtype not in DTYPES:
            raise ColibriError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        if self.calib_prompts < 1 or self.heldout_prompts < 1 or self.answer_tokens < 1:
            raise ColibriError("--calib-prompts, --heldout-prompts and --answer-tokens must be at least 1")
        if self.calib is not None and not Path(self.calib).is_file():
            raise ColibriError(f"--calib {self.calib}: no such file; pass a UTF-8 text file")


def check_source(src: Path) -> tuple[ModelSpec, Any, dict[str, Any] | None]:
    """The dense source's spec, tensor source and GGUF metadata (None for a folder); refuses other models."""
    if src.is_file() and src.suffix.lower() == ".gguf":
        source: Any = GGUFModel(src)
        config, meta = source.config, source.meta
    elif src.is_dir():
        config, meta = read_json(src / "config.json", "config.json"), None
        source = SafetensorsFolder(src)
    else:
        raise ColibriError(f"{src}: no model folder or .gguf file there; pass the dense model to upcycle")
    spec = spec_from_config(config, str(src))
    refuse = f"{src} is a {spec.architecture}; moefy upcycles dense Llama-family models (LlamaForCausalLM, e.g. SmolLM2)"
    if any(not isinstance(layer.ffn, MLPSpec) for layer in spec.layers):
        raise ColibriError(f"{refuse}, and this one is already a Mixture-of-Experts: run it as it is")
    if spec.architecture != "LlamaForCausalLM":
        raise ColibriError(f"{refuse}: pass a Llama-architecture checkpoint")
    attn = spec.layers[0].attn
    if not isinstance(attn, AttentionSpec) or attn.qkv_bias or attn.o_bias or attn.sliding_window:
        raise ColibriError(f"{src}: attention biases or sliding windows have no place in a Mixtral config; "
                           "moefy needs a plain Llama attention")
    return spec, source, meta


def moefy(src: str | Path, out: str | Path, options: MoefyOptions = MoefyOptions(),
          progress: MoefyProgress | None = None) -> dict[str, Any]:
    """Upcycle the dense model SRC into the MoE checkpoint folder OUT; return the report (also in OUT)."""
    t0 = time.perf_counter()
    src, out = Path(src).expanduser(), Path(out).expanduser()
    options.check()
    if out.exists():
        raise ColibriError(f"{out} already exists; choose another output folder or remove it")
    spec, source, meta = check_source(src)
    mixtral_config(spec, options.experts, options.top_k, options.dtype)  # fails early on a RoPE it cannot carry

    reached = [0.0]

    def report(fraction: float, message: str) -> None:
        reached[0] = min(max(reached[0], fraction), 1.0)  # never backwards, even by a rounding error
        if progress is not None and progress(reached[0], message) is False:
            raise MoefyCancelled("moefy cancelled; nothing was written")

    report(0.0, f"loading {src.name}")
    dense = load_model(src, lambda f, m: report(0.05 * f, f"loading {src.name}: {m}"))
    if dense.tokenizer is None:
        raise ColibriError(f"{src} has no tokenizer; moefy needs one to read calibration text")
    topics = load_probes(options.probes)
    names = {f"{layer_prefix(i)}.mlp.gate_proj.weight": i for i in range(spec.n_layers)}
    capture = FeatureCapture(names)
    calib_end = 0.40 if options.evaluate else 0.62
    calib_info = _calibrate(dense, topics, options, capture, lambda f, m: report(0.05 + (calib_end - 0.05) * f, m))

    # where writing starts and ends in the progress (after it: the held-out measurements, when evaluating)
    spans = (0.55, 0.75) if options.evaluate else (0.70, 1.0)
    heldout_chats: list[Passage] = []
    heldout_prose: list[Passage] = []
    if options.evaluate:
        for n, topic in enumerate(topics):
            prompts = topic.prompts[1::2][: options.heldout_prompts]
            heldout_chats.append(converse(dense.model, dense.tokenizer, prompts, options.answer_tokens, dense.stop_ids))
            report(0.40 + 0.12 * (n + 1) / len(topics), f"held-out chats: {topic.topic}")
        heldout_prose = text_passages(dense.tokenizer, heldout_text(options.probes))

    routers = {}
    for i in range(spec.n_layers):
        routers[i] = fit_router(capture.matrix(i), options.experts, options.top_k, seed=_layer_seed(options.seed, i))
        report(spans[0] - 0.03 + 0.03 * (i + 1) / spec.n_layers, f"routers: layer {i + 1}/{spec.n_layers}")
    del capture

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    tmp.mkdir()  # not mkdtemp, whose 0700 would make the model private to its maker
    try:
        _write(tmp, src, spec, source, meta, dense, routers, options,
               lambda i: report(spans[0] + (spans[1] - spans[0]) * (i + 1) / spec.n_layers,
                                f"writing experts: layer {i + 1}/{spec.n_layers}"))
        measured = None
        if options.evaluate:
            passages = len(heldout_chats) + len(heldout_prose)
            dense_tick = _counter(lambda n: report(0.75 + 0.07 * n / passages, "perplexity of the dense model"))
            dense_chats, dense_prose = score(dense.model, heldout_chats, dense_tick), score(dense.model, heldout_prose,
                                                                                            dense_tick)
            del dense
            moe = load_model(tmp, lambda f, m: report(0.82 + 0.03 * f, "loading the MoE"))
            moe_tick = _counter(lambda n: report(0.85 + 0.15 * n / passages, "perplexity and routing of the MoE"))
            measured = (dense_chats, score(moe.model, heldout_chats, moe_tick), dense_prose,
                        score(moe.model, heldout_prose, moe_tick))
        result = _report(src, out, options, calib_info, measured, time.perf_counter() - t0)
        write_json(tmp / "moefy_report.json", result)
        report(1.0, "done")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _counter(call: Callable[[int], None]) -> Callable[[], None]:
    """A no-argument tick that calls CALL with how many ticks came so far."""
    count = [0]

    def tick() -> None:
        count[0] += 1
        call(count[0])

    return tick


HEARTBEAT = 10.0    # seconds between two lines of one long step


@contextmanager
def heartbeat(say: Callable[[str], None], doing: str, every: float = HEARTBEAT) -> Iterator[None]:
    """Say DOING, then say it again with the seconds so far every EVERY seconds until the body ends (as `Waiting`
    lines, so that a front end knows the step's fraction is not moving).

    A cold first calibration chat spends a minute or more in numba's compiler, which reports nothing; without
    this the terminal and the first-run dialog sit silent for that minute. SAY runs on a helper thread; if it
    raises (the GUI's Cancel), the exception is raised here when the body ends.
    """
    say(doing)
    done, failed, t0 = threading.Event(), [], time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            try:
                say(Waiting(f"{doing} ({time.monotonic() - t0:.0f} s so far)"))
            except BaseException as exc:  # handed to the caller's thread below
                failed.append(exc)
                return

    thread = threading.Thread(target=beat, name="colibri-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if failed:
        raise failed[0]


def _layer_seed(seed: int, layer: int) -> int:
    return int(np.random.SeedSequence([seed, layer]).generate_state(1)[0])


def _calibrate(dense, topics, options: MoefyOptions, capture: FeatureCapture,
               report: Callable[[float, str], None]) -> dict[str, Any]:
    """Run the calibration text through the dense model with CAPTURE listening; describe what was read."""
    if options.calib is not None:
        text = Path(options.calib).read_text(encoding="utf-8", errors="replace")
        passages = text_passages(dense.tokenizer, text)
        for n, passage in enumerate(passages):
            read_passage(dense.model, passage, capture)
            report((n + 1) / len(passages), f"calibration: passage {n + 1}/{len(passages)}")
        return {"source": str(options.calib), "tokens": capture.count}
    for n, topic in enumerate(topics):
        prompts = topic.prompts[0::2][: options.calib_prompts]
        doing = f"calibration chats: {topic.topic}" + (" (the first compiles the model's kernels)" if n == 0 else "")
        with heartbeat(lambda text, n=n: report(n / len(topics), text), doing):
            converse(dense.model, dense.tokenizer, prompts, options.answer_tokens, dense.stop_ids, capture)
        report((n + 1) / len(topics), f"calibration chats: {topic.topic} ({capture.count} tokens)")
    return {"source": "probe chats", "prompts_per_topic": options.calib_prompts,
            "answer_tokens": options.answer_tokens, "tokens": capture.count}


def _write(tmp: Path, src: Path, spec: ModelSpec, source, meta, dense, routers: dict[int, np.ndarray],
           options: MoefyOptions, tick: Callable[[int], None]) -> None:
    """Everything but the report into the temporary folder TMP."""
    write_json(tmp / "config.json", mixtral_config(spec, options.experts, options.top_k, options.dtype))
    metadata = {"format": "pt", "colibri": f"moefy of {src.name}: {options.experts} experts, top-{options.top_k}, "
                f"noise {options.noise}, seed {options.seed}"}
    write_weights(tmp / "model.safetensors", spec, source, routers, options.noise, options.seed, options.dtype,
                  metadata, tick)
    write_tokenizer(src, tmp, dense.tokenizer, meta, spec.max_position)
    eos = sorted(dense.stop_ids)
    write_json(tmp / "generation_config.json", {"bos_token_id": spec.bos_token_id,
                                                "eos_token_id": eos[0] if len(eos) == 1 else eos})


def _report(src: Path, out: Path, options: MoefyOptions, calib: dict[str, Any], measured, seconds: float
            ) -> dict[str, Any]:
    """The report: what was made and how; with `measured` (dense and MoE scores of the held-out chats, then of the
    held-out text), perplexities and expert shares, else null where they would be."""
    e = options.experts

    def ppl(dense, moe) -> dict[str, Any]:
        return {"dense": round(dense.perplexity, 4), "moe": round(moe.perplexity, 4),
                "change": round(moe.perplexity / dense.perplexity - 1.0, 5), "tokens": moe.tokens}

    def shares(s) -> dict[str, Any]:
        per_layer = [[round(float(v), 4) for v in row] for row in s.shares().values()]
        scaled = np.array(per_layer) * e
        return {"per_layer": per_layer, "min_times_e": round(float(scaled.min()), 3),
                "max_times_e": round(float(scaled.max()), 3),
                "within_bounds": bool(scaled.min() >= SHARE_BOUNDS[0] and scaled.max() <= SHARE_BOUNDS[1])}

    options_out = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(options).items()}
    perplexity, expert_shares = None, None
    if measured is not None:
        dense_chats, moe_chats, dense_prose, moe_prose = measured
        perplexity = {"heldout_text": ppl(dense_prose, moe_prose), "heldout_chats": ppl(dense_chats, moe_chats)}
        expert_shares = {"heldout_chats": shares(moe_chats), "heldout_text": shares(moe_prose)}
    return {
        "source": str(src), "model": str(out), "options": options_out, "calibration": calib,
        "perplexity": perplexity,
        "perplexity_bound": PPL_BOUND,
        "expert_shares": expert_shares,
        "share_bounds_times_e": list(SHARE_BOUNDS),
        "seconds": round(seconds, 1),
    }


def format_report(result: dict[str, Any]) -> str:
    """The report as text: perplexities, then each layer's expert shares on the held-out chats."""
    e = result["options"]["experts"]
    lines = []
    if result["perplexity"] is None:
        lines.append("not measured against the dense model (made without evaluation); `colibri moefy` measures it")
        lines.append(f"calibration: {result['calibration']['tokens']} tokens from {result['calibration']['source']}; "
                     f"took {result['seconds']:.0f} s")
        return "\n".join(lines)
    for name, label in (("heldout_text", "held-out text (heldout.txt beside the probes)"),
                        ("heldout_chats", "held-out chats (probe prompts not used for calibration)")):
        p = result["perplexity"][name]
        lines.append(f"perplexity on {label}, {p['tokens']} tokens: dense {p['dense']:.3f}, "
                     f"MoE {p['moe']:.3f} ({p['change'] * 100:+.2f}%)")
    chats, prose = result["expert_shares"]["heldout_chats"], result["expert_shares"]["heldout_text"]
    lo, hi = result["share_bounds_times_e"]
    lines.append(f"expert shares per layer on the held-out chats, % of tokens (bounds {100 * lo / e:.1f}% to "
                 f"{100 * hi / e:.1f}%):")
    lines.append("layer " + " ".join(f"{f'e{j}':>5}" for j in range(e)))
    for i, row in enumerate(chats["per_layer"]):
        lines.append(f"{i:>5} " + " ".join(f"{100 * v:5.1f}" for v in row))
    for name, s in (("held-out chats", chats), ("held-out text", prose)):
        verdict = "within bounds" if s["within_bounds"] else "OUTSIDE the bounds"
        lines.append(f"{name}: smallest share {s['min_times_e']:.2f}/E, largest {s['max_times_e']:.2f}/E ({verdict})")
    lines.append(f"calibration: {result['calibration']['tokens']} tokens from {result['calibration']['source']}; "
                 f"took {result['seconds']:.0f} s")
    return "\n".join(lines)
