"""Group-wise quantized weights (2 to 8 bits, fp16 scales) and their numba kernels.

- `QuantizedTensor`, `quantize`, `weighted_error`, `matmul_many` (engine/quant/tensor.py):
  storage, the importance-weighted clip search, the error the bit planner minimises, and
  several matrices that share an input (q, k, v) in one parallel call.
- `moe_experts` (engine/quant/experts.py): all selected experts of a MoE layer step in one call.
- `matmul_f32` (engine/quant/fp32.py): batch-invariant x @ w.T for float32 weights.
- Layout (bit planes per 32-weight block) in engine/quant/layout.py; the kernels and the order
  of their floating-point operations in engine/quant/kernels.py and engine/quant/simd.py.

Activations stay float32 in every kernel: weights are dequantized (exactly, for symmetric
formats) and multiplied by fused multiply-adds in a fixed 16-lane order, which makes every
output bitwise independent of batch size, thread count and CPU (a baseline x86-64 build gives
the AVX-512 build's bits). Quantizing activations to int8 per 32 (as llama.cpp does) measured
no faster in decode here (both ~12 G weights/s per core before tuning), would cost a float
conversion and scale per 32 products in prefill, where float FMA tiles beat BLAS, and adds error.
"""

from engine.quant.experts import expert_outputs, moe_experts, weighted_sum
from engine.quant.fp32 import matmul_f32
from engine.quant.layout import BITS, GROUPS
from engine.quant.tensor import QuantizedTensor, matmul_many, quantize, weighted_error

__all__ = ["BITS", "GROUPS", "QuantizedTensor", "matmul_f32", "expert_outputs", "matmul_many", "moe_experts", "weighted_sum", "quantize", "weighted_error"]
