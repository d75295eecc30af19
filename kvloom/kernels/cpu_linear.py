"""Pre-packed linear layers for the CPU.

``F.linear`` on the CPU hands a plain row-major weight to the BLAS on every call, which re-blocks it
for its micro-kernel each time; for the small-M matmuls of decoding that re-blocking costs as much as
the product. oneDNN can take the weight already laid out in its blocked format, once, after loading
(the pass PyTorch's own inductor runs under ``freezing``, and vLLM's CPU backend runs too), faster at decode
and prefill sizes alike (``python benchmarks/cpu_linear.py``, docs/benchmarks.md).
Numerics stay those of the dtype (float32 accumulates in float32, in another order than MKL).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvloom.kernels import cpu_ops

logger = logging.getLogger("kvloom")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bfloat16 matmuls at twice float32's rate (elsewhere oneDNN emulates them)."""
    get = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if get is None:
        return False
    caps = get()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build and CPU can run oneDNN packed linears in ``dtype``."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not ops._is_mkldnn_bf16_supported():
        return False
    return True


EXACT_ROWS = 16  # up to this many rows (decoding a few requests) a call runs with its own row count


def padded_rows(rows: int) -> int:
    """The row count a packed linear runs with. oneDNN (and PyTorch's ideep layer above it) keeps a
    primitive with its own memory for every input shape it meets, so a server whose steps carry every
    token count from 1 to 2,048 grew by megabytes per count (an engine soak: +700 MB in 10 minutes);
    rounded up, to a multiple of 8 up to 64 rows and to 8 steps per doubling beyond (at most 12.5% more
    rows), the shapes stay few and their primitives stay cached."""
    if rows <= EXACT_ROWS:
        return rows
    step = 8 if rows <= 64 else 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (an opaque tensor: CPU only, not
    a parameter; the plain weight is dropped)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor cannot lower oneDNN's opaque weight: an opaque op
            return packed_linear_op(x, self.packed_weight, self.bias, self.out_features)
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)  # eager: no dispatcher detour

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``x @ W.T + b`` with ``W`` in oneDNN's blocked layout (``PackedLinear``)."""
    in_features = x.shape[-1]
    rows = x.numel() // in_features
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    flat = torch.nn.functional.pad(x.reshape(rows, in_features), (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(flat, packed_weight, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out_features)


# The same as one op the compiler keeps whole (eager calls skip the dispatcher)
packed_linear_op = cpu_ops.define(
    "packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor", packed_linear,
    lambda x, packed_weight, bias, out_features: x.new_empty((*x.shape[:-1], out_features)))
