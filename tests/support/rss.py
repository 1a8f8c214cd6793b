"""Peak memory of a command run in a child process, and bfloat16 checkpoints of a chosen size to run it on.

The peak is the child's own high-water mark of resident memory (getrusage's ru_maxrss, which counts mapped file
pages as well as anonymous memory), measured by a fresh wrapper process whose only child is the command, so no
earlier child of the test process can stand in for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

# the wrapper: run argv, then print the child's peak RSS in KiB and its exit code
_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)")


def peak_rss_kib(argv: Sequence[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> int:
    """Run argv to its end in a child process in `cwd`; its peak RSS in KiB (an AssertionError with its output if
    it fails). `cwd` matters: `python -c` imports from it first."""
    done = subprocess.run([sys.executable, "-c", _WRAPPER, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    peak, rc = (int(v) for v in lines[-1].split())
    assert rc == 0, f"{' '.join(argv)} failed ({rc}):\n{done.stdout}\n{done.stderr}"
    return peak


def colibri_argv(*args: str) -> list[str]:
    """The command line that runs `colibri ARGS` with this interpreter."""
    return [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))", *args]


def child_env() -> dict[str, str]:
    """This process's environment, with PYTHONPATH holding the paths this test imports from."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
    return env


def mixtral_config(layers: int, experts: int, hidden: int = 256, ffn: int = 512, vocab: int = 256) -> dict:
    """A small Mixtral config.json whose size grows with layers x experts (the vocabulary stays small)."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "num_local_experts": experts, "num_experts_per_tok": 2, "vocab_size": vocab,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_bf16_checkpoint(folder: Path, config: dict, seed: int = 0) -> int:
    """config.json and a bfloat16 model.safetensors of every tensor the config implies (written a tensor at a
    time: the writer's memory does not grow with the model); the file's size in bytes."""
    from engine.models import spec_from_config
    from engine.models.transformer import expected_shapes

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = expected_shapes(spec_from_config(config, str(folder)))
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(seed)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, shape in shapes.items():
            w = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
            if name.endswith("norm.weight"):
                w = np.ones(shape, np.float32)
            f.write((w.view(np.uint32) >> 16).astype(np.uint16).tobytes())   # bfloat16 by truncation
    return path.stat().st_size


_HOG = ("import sys; n = int(sys.argv[1]); b = bytearray(n); b[::4096] = b'x' * len(b[::4096]); "
        "print('ready', flush=True); sys.stdin.read()")


@contextmanager
def memory_hog(nbytes: int) -> Iterator[int]:
    """A child process holding `nbytes` of touched memory until the block ends; yields its pid once it holds them
    (it says so on a pipe: no sleeping)."""
    p = subprocess.Popen([sys.executable, "-c", _HOG, str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready", "the memory hog did not start"
        yield p.pid
    finally:
        p.stdin.close()                    # its read returns: it exits and gives the memory back
        p.wait(timeout=60)


def rss_of(pid: int) -> int:
    """Resident bytes of process `pid` (0 once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
