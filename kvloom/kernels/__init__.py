"""Hot-path kernels. ``ops`` picks the Triton kernel on CUDA and the PyTorch reference elsewhere."""
