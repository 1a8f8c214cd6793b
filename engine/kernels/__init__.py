"""numba kernels and their SIMD helpers: matmuls, the packed layouts, rows, attention, experts."""
