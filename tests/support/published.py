"""Checkpoints quantized as their publishers do: block-scaled FP8 (DeepSeek-V3's recipe) and MXFP4 (gpt-oss).

`to_fp8` and `to_mxfp4` rewrite a float32 folder written by `reference.build_checkpoint` in place: its
matrices are quantized by the published definitions, written with the published names and dtypes, and a
`quantization_config` is added to config.json. `dequantized_copy` writes the same values back as float32,
for a reference that cannot read the quantized folder (partial FP8 blocks, which transformers' CPU
dequantization refuses).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX_EXP = 2                        # the largest e2m1 value is 1.5 * 2**2
FP8_SKIP = re.compile(r".*(embed_tokens|lm_head|norm|\.gate)\.weight")   # left in bf16 by the publishers


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(f)
        f.unlink()
    index = folder / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return tensors


def _save(folder: Path, tensors: dict, quantization: dict | None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if quantization is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def fp8_quantize(w: np.ndarray, block: tuple[int, int]):
    """w [R, C] -> (float8_e4m3fn torch tensor [R, C], float32 scale_inv [ceil(R/bn), ceil(C/bk)]): each block
    divided by amax / 448 and rounded to nearest e4m3 (DeepSeek-V3's weight quantization)."""
    import torch

    bn, bk = block
    rows, cols = w.shape
    grid = (-(-rows // bn), -(-cols // bk))
    padded = np.zeros((grid[0] * bn, grid[1] * bk), np.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(grid[0], bn, grid[1], bk)
    amax = np.abs(tiles).max(axis=(1, 3))                                             # [gr, gc]
    scale_inv = np.where(amax > 0, amax / np.float32(E4M3_MAX), 1.0).astype(np.float32)
    scaled = tiles / scale_inv[:, None, :, None]
    scaled = np.clip(scaled, -E4M3_MAX, E4M3_MAX).reshape(padded.shape)[:rows, :cols]
    return torch.from_numpy(np.ascontiguousarray(scaled)).to(torch.float8_e4m3fn), scale_inv


def to_fp8(folder: Path, block: tuple[int, int] = (128, 128), skip: re.Pattern = FP8_SKIP) -> list[str]:
    """Quantize every 2-D weight of `folder` but embeddings, head, norms and routers into FP8; the names
    quantized."""
    import torch

    tensors, done = _tensors(folder), []
    for name in list(tensors):
        t = tensors[name]
        if t.ndim == 2 and name.endswith(".weight") and not skip.fullmatch(name):
            q, scale_inv = fp8_quantize(t.float().numpy(), block)
            tensors[name], tensors[name + "_scale_inv"] = q, torch.from_numpy(scale_inv)
            done.append(name)
    _save(folder, tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": list(block)})
    return done


def mxfp4_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., R, C] -> (blocks uint8 [..., R, C/32, 16], scales uint8 [..., R, C/32]) by the OCP MX definition:
    each 32's scale is 2**(floor(log2(amax)) - 2), each weight the nearest e2m1 value (saturating at 6),
    two codes a byte with the first in the low nibble."""
    from engine.kernels.fp8 import E2M1

    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float32)          # [..., R, G, 32]
    amax = np.abs(g).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - E2M1_MAX_EXP, -127)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = g / np.ldexp(np.float32(1.0), exp)[..., None]
    positive = E2M1[:8]
    mag = np.abs(np.minimum(np.abs(scaled), 6.0))
    codes = np.abs(mag[..., None] - positive).argmin(axis=-1).astype(np.uint8)       # [..., R, G, 32]
    codes |= np.where(scaled < 0, 8, 0).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exp + 127).astype(np.uint8)


def to_mxfp4(folder: Path) -> list[str]:
    """Quantize gpt-oss's fused expert matrices (`experts.gate_up_proj`, `experts.down_proj`, stored [E, in, out])
    into `_blocks` / `_scales` over [E, out, in] as the published checkpoints hold them; the names quantized."""
    import torch

    tensors, done = _tensors(folder), []
    for name in list(tensors):
        if re.fullmatch(r".*\.experts\.(gate_up|down)_proj", name):
            w = tensors.pop(name).float().numpy().transpose(0, 2, 1)                  # [E, out, in]
            blocks, scales = mxfp4_pack(w)
            tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            done.append(name)
    _save(folder, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                               "model.layers.*.mlp.router",
                                                                               "model.embed_tokens", "lm_head"]})
    return done


def dequantized_copy(src: Path, dst: Path) -> Path:
    """A float32 folder holding the values of `src`'s FP8 / MXFP4 weights (dequantized by the definitions)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from engine.kernels.fp8 import E4M3
    from engine.quant.published import MXFP4Tensor

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    block = json.loads((src / "config.json").read_text()).get("quantization_config", {}).get("weight_block_size")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv") or name.endswith("_scales"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            codes = t.view(torch.uint8).numpy()
            scale = tensors[name + "_scale_inv"].numpy()
            rep = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[:codes.shape[0], :codes.shape[1]]
            out[name] = torch.from_numpy(E4M3[codes] * rep)
        elif name.endswith("_blocks"):
            b, s = t.numpy(), tensors[name[:-7] + "_scales"].numpy()
            e = b.shape[0]
            w = np.stack([MXFP4Tensor(b[i].reshape(b.shape[1], -1), s[i]).dequantize() for i in range(e)])
            out[name[:-7]] = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1)))   # back to [E, in, out]
        else:
            out[name] = t.float()
    _save(dst, out, None)
    return dst


def held(model, kinds: tuple[type, ...]) -> list:
    """Every object of `kinds` a loaded model holds (walking its layers, blocks and resident experts)."""
    import dataclasses

    found, seen, todo = [], set(), [model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (np.ndarray, str, int, float, bytes)):
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif dataclasses.is_dataclass(obj):
            todo.extend(getattr(obj, f.name, None) for f in dataclasses.fields(obj))
        elif type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return found
