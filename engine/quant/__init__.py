"""Group-wise quantized weights (2 to 8 bits, fp16 scales): storage, quantization, the scale search.

- `QuantizedTensor`, `quantize`, `weighted_error`, `matmul_many` (engine/quant/tensor.py):
  storage as read-only views, the importance-weighted clip search (engine/quant/search.py), the
  error the bit planner minimises, and several matrices that share an input (q, k, v) in one call.
- `KQuantTensor` (engine/quant/kquant.py): a GGUF K-quant (Q2_K .. Q6_K) or IQ4 (IQ4_NL, IQ4_XS) matrix in the file's own
  super-blocks, run by engine/kernels/kquant.py.
- The packed layouts and the kernels that read them live in engine/kernels/: the plane layout's
  float kernels keep activations in float32; the 16-row layout's integer kernels (4- and 8-bit
  symmetric codes) round each token's activations to int8 per 32-block, as llama.cpp does. Both
  compute every output in a fixed order, so results are bitwise independent of batch and threads.
"""

from engine.kernels.layout import BITS, GROUPS
from engine.quant.kquant import KQuantTensor
from engine.quant.tensor import QuantizedTensor, matmul_many, quantize, weighted_error

__all__ = ["BITS", "GROUPS", "KQuantTensor", "QuantizedTensor", "matmul_many", "quantize", "weighted_error"]
