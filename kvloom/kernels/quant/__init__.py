"""Quantized matmuls on CUDA, one module a kernel family; ``dispatch`` alone imports the families and picks
a layer's path by row count and shape."""
