"""A stand-in that compiles a derived model's kernels while the model itself is still being made.

The demo model takes two steps on a first run: the upcycling (app.moefy, whose calibration compiles and
runs the dense model's kernels) and the conversion; then its own kernels compile at the warm-up, minutes of
Numba compiling into an empty cache on one core. Numba compiles a kernel per argument types, not per size,
so a tiny model of the same architecture, converted with the same settings, needs exactly the kernels the
real one will. `StandIn` makes such a model (two layers, narrow experts, random weights, the source's own
tokenizer) in a child process and warms it up there while this process upcycles, so those compiles run on
the other core. When the real model is ready, its warm-up finds them in the cache and takes seconds.

The stand-in lives in a hidden folder of the models folder and is removed when it is done, stopped or killed
(a leftover of a killed run is removed by the next one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from app.hub.progress import Note, Report
from engine.errors import ColibriError

LAYERS = 2             # enough for a layer's output to feed another layer's input
INTERMEDIATE = 256     # experts' width: a multiple of every group and block size the converter uses
PREFIX = ".standin-"   # the stand-ins' folders in the models folder
EVERY = 15.0           # seconds between notes while the caller waits for the stand-in


def write_standin(source: Path, out: Path, experts: int, top_k: int, bits: int) -> Path:
    """Make in OUT the stand-in of `colibri moefy SOURCE --experts E --top-k K` converted at BITS; return its container.

    The checkpoint is what moefy writes (config, bfloat16 safetensors, tokenizer) for SOURCE cut to LAYERS layers
    of INTERMEDIATE-wide experts, with random weights."""
    from app.hub.convert import ConvertSettings, convert
    from app.moefy.upcycle import MoefyOptions, check_source
    from app.moefy.write import SafetensorsWriter, checkpoint_tensors, mixtral_config, write_json, write_tokenizer
    from engine.tokenizer import Tokenizer

    spec, _, meta = check_source(source)
    layers = tuple(dataclasses.replace(layer, ffn=dataclasses.replace(layer.ffn, intermediate=INTERMEDIATE))
                   for layer in spec.layers[:LAYERS])
    spec = dataclasses.replace(spec, layers=layers)
    dtype = MoefyOptions().dtype
    folder = out / "checkpoint"
    folder.mkdir(parents=True)
    write_json(folder / "config.json", mixtral_config(spec, experts, top_k, dtype))
    tokenizer = Tokenizer.from_gguf_metadata(meta, str(source)) if meta is not None else None
    write_tokenizer(source, folder, tokenizer, meta, spec.max_position)
    rng = np.random.default_rng(0)
    tensors = checkpoint_tensors(spec, experts)
    writer = SafetensorsWriter(folder / "model.safetensors", tensors, dtype, {"format": "pt"})
    with writer.file:
        for name, shape in tensors:
            # norms at one as a trained model's are near; small weights keep the logits finite and spread
            writer.write(name, np.ones(shape, np.float32) if len(shape) == 1 else
                         rng.standard_normal(shape, dtype=np.float32) * 0.02)
        writer.close()
    container = out / "container"
    convert(folder, container, ConvertSettings(bits=bits), progress=lambda event: None)
    shutil.rmtree(folder)
    return container


def warm_standin(source: Path, out: Path, experts: int, top_k: int, bits: int) -> float:
    """Make the stand-in in OUT and warm it up as the app loads the real model (its experts streamed by the
    store); returns the warm-up's seconds."""
    from app.service.messages import LoadOptions
    from app.service.warm import warm_up

    container = write_standin(source, out, experts, top_k, bits)
    return warm_up(container, options=LoadOptions(history=False, offload=True))


class StandIn:
    """The stand-in's child process: started by `start`, waited for by `finish`, killed by `stop`."""

    def __init__(self, process: subprocess.Popen, folder: Path, log: Path):
        self.process, self.folder, self.log = process, folder, log
        self.started = time.monotonic()

    @classmethod
    def start(cls, source: Path, root: Path, experts: int, top_k: int, bits: int) -> StandIn:
        """Start warming the stand-in of a derivation from SOURCE (see `write_standin`) in ROOT's hidden folder."""
        for stale in root.glob(f"{PREFIX}*"):   # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        folder = root / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        folder.mkdir(parents=True)
        log = folder / "log.txt"
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", "app.hub.standin", str(source), str(folder / "model"),
                                        str(experts), str(top_k), str(bits)], stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT)
        return cls(process, folder, log)

    def finish(self, report: Report, tick: Callable[[], None] = lambda: None) -> bool:
        """Wait for the stand-in, with a note every EVERY seconds and `tick` each second (which may raise to stop);
        True when it warmed up. A failed stand-in is only said: the real warm-up compiles what it lacks."""
        try:
            last = time.monotonic()
            while True:
                try:
                    code = self.process.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    tick()
                    if time.monotonic() - last >= EVERY:
                        last = time.monotonic()
                        report(Note(f"compiling kernels on a small stand-in of the model "
                                    f"({last - self.started:.0f} s so far)"))
            if code != 0:
                lines = self.log.read_text(errors="replace").strip().splitlines()
                report(Note(f"the kernels' stand-in failed ({lines[-1] if lines else f'exit {code}'}); "
                            "the warm-up will compile them"))
            return code == 0
        finally:
            self.stop()

    def stop(self) -> None:
        """Kill the child if it still runs, and remove the stand-in's folder."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.hub.standin", description=warm_standin.__doc__)
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("experts", type=int)
    parser.add_argument("top_k", type=int)
    parser.add_argument("bits", type=int)
    args = parser.parse_args(argv)
    try:
        seconds = warm_standin(args.source, args.out, args.experts, args.top_k, args.bits)
    except ColibriError as exc:
        print(f"stand-in: {exc}", file=sys.stderr)
        return 1
    print(f"stand-in warmed up in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
