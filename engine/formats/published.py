"""Safetensors weights quantized by their publishers: block-scaled FP8 and gpt-oss's MXFP4 experts.

- FP8 (`quantization_config.quant_method = "fp8"`: DeepSeek-V3/R1, Kimi K2, GLM-4.5-FP8, Qwen3-FP8,
  MiniMax-M2): a weight stored `F8_E4M3` with a float32 `weight_scale_inv` beside it, one scale per
  `weight_block_size` block ([128, 128]) or one for the whole matrix. The pair reads as one `FP8Tensor`
  under the weight's name; the scale's name is hidden. Which matrices are FP8 is read from the stored
  dtypes, so the publisher's `modules_to_not_convert` (routers, heads left in bf16) needs no rules here.
- MXFP4 (`quant_method = "mxfp4"`: gpt-oss): a fused expert tensor stored as `<name>_blocks` [E, out, in/32,
  16] uint8 and `<name>_scales` [E, out, in/32] uint8. The pair shows as `<name>` with the shape of the
  unquantized checkpoint's tensor ([E, in, out]: transformers stores those transposed), so the family's
  fused-tensor rules cut it like a float one; a piece is an `MXFP4Tensor` of the stored bytes.
Nothing is widened: FP8 stays at 1 byte a weight and MXFP4 at 4.25 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.safetensors_file import bf16_to_f32
from engine.kernels.fp8 import E8M0, MX_GROUP
from engine.quant.published import FP8Tensor, MXFP4Tensor

METHODS = ("fp8", "mxfp4")
FP8_DTYPE = "F8_E4M3"


@dataclass(frozen=True)
class Quantization:
    """A folder's `quantization_config`, as far as reading its tensors needs it."""

    method: str | None                     # "fp8", "mxfp4" or None (no config, or a method read elsewhere)
    block: tuple[int, int] | None = None   # FP8 rows and columns per scale; None: one scale a matrix


def read_quantization(config: Mapping[str, Any] | None, where: str) -> Quantization:
    """The quantization a config.json declares; a ModelFormatError for an FP8 variant Colibri cannot run."""
    quant = (config or {}).get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") not in METHODS:
        return Quantization(None)
    if quant["quant_method"] == "mxfp4":
        return Quantization("mxfp4")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelFormatError(f"{where}: quantization_config.fmt is {fmt!r}; Colibri reads FP8 checkpoints in e4m3 "
                               "(the published format): use an e4m3 or bfloat16 version of the model")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelFormatError(f"{where}: quantization_config.activation_scheme is {quant['activation_scheme']!r}; "
                               "Colibri runs FP8 weights with float32 activations and reads 'dynamic' checkpoints "
                               "only: use a dynamic-scheme or bfloat16 version of the model")
    block = quant.get("weight_block_size")
    if block is None:
        return Quantization("fp8")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelFormatError(f"{where}: quantization_config.weight_block_size is {block!r}, expected two positive "
                               "integers such as [128, 128]; use the config.json that came with the weights")
    return Quantization("fp8", (int(block[0]), int(block[1])))


def fp8_scale_name(weight: str) -> str:
    """The name of an FP8 weight's scale: `x.weight` -> `x.weight_scale_inv` (transformers' convention)."""
    return weight + "_scale_inv"


class PublishedTensors:
    """Which stored tensors of a folder pair into one FP8 or MXFP4 weight, and how to read them."""

    def __init__(self, folder, quant: Quantization):
        self.folder = folder                                 # a SafetensorsFolder (stored names, dtype, shape, raw)
        self.quant = quant
        self.fp8: dict[str, str] = {}                        # weight -> its scale
        self.mxfp4: dict[str, tuple[str, str]] = {}          # shown name -> (blocks, scales)
        stored = set(folder.stored_names())
        for name in sorted(stored):
            if folder.dtype(name) == FP8_DTYPE:
                scale = fp8_scale_name(name)
                if scale not in stored:
                    raise ModelFormatError(f"{folder.location(name)}: FP8 ({FP8_DTYPE}) tensor {name} has no {scale} beside it; "
                                           "the checkpoint is incomplete: fetch the model again")
                self.fp8[name] = scale
            elif quant.method == "mxfp4" and name.endswith("_blocks") and name[:-7] + "_scales" in stored:
                self.mxfp4[name[:-7]] = (name, name[:-7] + "_scales")
        self.hidden = set(self.fp8.values()) | {n for pair in self.mxfp4.values() for n in pair}
        for shown, (blocks, scales) in self.mxfp4.items():
            self._check_mxfp4(shown, blocks, scales)

    def _check_mxfp4(self, shown: str, blocks: str, scales: str) -> None:
        f = self.folder
        b, s = tuple(f.stored_shape(blocks)), tuple(f.stored_shape(scales))
        if f.dtype(blocks) != "U8" or f.dtype(scales) != "U8" or len(b) < 3 or b != s + (MX_GROUP // 2,):
            raise ModelFormatError(f"{f.location(blocks)}: MXFP4 tensors {blocks} {list(b)} {f.dtype(blocks)} and "
                                   f"{scales} {list(s)} {f.dtype(scales)} do not pair (expected uint8 [..., out, "
                                   "in/32, 16] and [..., out, in/32]); the checkpoint is damaged: fetch it again")

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape an MXFP4 pair shows (the unquantized tensor's [..., in, out]), None for other names."""
        if name not in self.mxfp4:
            return None
        *lead, out, groups = self.folder.stored_shape(self.mxfp4[name][1])
        return (*lead, groups * MX_GROUP, out)

    def fp8_tensor(self, name: str) -> FP8Tensor:
        """An FP8 weight and its scales as one FP8Tensor over the memory map."""
        f = self.folder
        codes, scale_name = f.raw(name), self.fp8[name]
        if codes.ndim != 2:
            raise ModelFormatError(f"{f.location(name)}: FP8 tensor {name} has shape {list(codes.shape)}; Colibri "
                                   "reads FP8 matrices [out, in] (one per expert)")
        scales = self._scales(scale_name)
        if scales.size == 1:                     # one scale for the whole matrix
            block = codes.shape
            scales = scales.reshape(1, 1)
        elif self.quant.block is None:
            raise ModelFormatError(f"{f.location(scale_name)}: {scale_name} holds {list(scales.shape)} block scales but "
                                   "config.json's quantization_config has no weight_block_size; use the config.json "
                                   "that came with the weights")
        else:
            block = self.quant.block
        try:
            return FP8Tensor(codes, scales, block)
        except ValueError as exc:
            raise ModelFormatError(f"{f.location(scale_name)}: {exc}; the scales do not match weight_block_size "
                                   f"{list(block)}: use the config.json that came with the weights") from None

    def _scales(self, name: str) -> np.ndarray:
        """An FP8 scale tensor as float32: a view when stored F32; bf16 and e8m0 bytes (small) are widened."""
        f = self.folder
        dtype, raw = f.dtype(name), f.raw(name)
        if dtype == "F32":
            return raw
        if dtype == "BF16":
            return bf16_to_f32(raw)
        if dtype == "U8":                        # ue8m0: 2**(e - 127)
            return E8M0[raw]
        raise ModelFormatError(f"{f.location(name)}: FP8 scale {name} is {dtype}; Colibri reads float32, bfloat16 or "
                               "e8m0 (uint8) scales")

    def packed(self, name: str) -> "MXFP4Stack | None":
        """The MXFP4 pair shown as `name`, None for other names."""
        if name not in self.mxfp4:
            return None
        blocks, scales = self.mxfp4[name]
        return MXFP4Stack(name, self.folder.location(blocks), self.folder.raw(blocks), self.folder.raw(scales))


@dataclass(frozen=True)
class MXFP4Stack:
    """A fused MXFP4 tensor (blocks [E, out, in/32, 16], scales [E, out, in/32]) that pieces are cut from."""

    name: str
    location: str
    blocks: np.ndarray
    scales: np.ndarray

    def piece(self, expert: int | None, piece) -> MXFP4Tensor:
        """One `engine.formats.fused.Piece` of expert `expert` (of the whole tensor when None): a range of the
        shown [in, out] slab's out axis, transposed, i.e. rows of the stored [out, in] matrix."""
        blocks = self.blocks[expert] if expert is not None else self.blocks              # [out, in/32, 16]
        scales = self.scales[expert] if expert is not None else self.scales              # [out, in/32]
        whole = piece.start == 0 and piece.stop is None and piece.step == 1
        if blocks.ndim != 3 or not piece.transpose or (piece.axis != 1 and not whole):
            raise ModelFormatError(f"{self.location}: MXFP4 tensor {self.name} can be cut into rows of its [out, in] "
                                   f"matrices only, not into {piece.name} (axis {piece.axis}); this family's "
                                   "MXFP4 checkpoints are not supported")
        rows = slice(None) if whole else slice(piece.start, piece.stop, piece.step)
        b = np.ascontiguousarray(blocks[rows]).reshape(-1, blocks.shape[1] * blocks.shape[2])   # [n, in/2]
        return MXFP4Tensor(b, np.ascontiguousarray(scales[rows]))
