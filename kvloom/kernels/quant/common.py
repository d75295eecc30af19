"""What the quantized-matmul families share: row views, output and scratch buffers, split-K partials and the
kernel end that combines them, the autotuner's settings and the SiLU-and-mul epilogue."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arrivals import arrival_counters


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x [.., K]`` as ``[rows, K]`` with a unit last stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _out_buffer(m: int, n: int, split: int, like: torch.Tensor) -> torch.Tensor:
    """A kernel's ``[m, n]`` output: zeroed float32 for split-K's atomic adds, else ``like``'s dtype."""
    if split > 1:
        return torch.zeros((m, n), device=like.device, dtype=torch.float32)
    return torch.empty((m, n), device=like.device, dtype=like.dtype)


def _split_outputs(x2: torch.Tensor, m: int, n: int, tiles: int, split: int, combine: bool = True):
    """``(part, arrivals, out)`` for a kernel of ``m`` rows, ``n`` outputs, ``tiles`` output tiles (one arrival
    counter each) and ``split`` K-splits: with ``combine`` (``KernelOptions.split_combine``, and counters to be
    had) the float32 partials ``[split, m, n]``, the counters and an output in x's dtype; otherwise no partials
    and ``_out_buffer``'s output."""
    arrivals = arrival_counters(x2, tiles) if split > 1 and combine else None
    if arrivals is None:
        return None, None, _out_buffer(m, n, split, x2)
    part = torch.empty((split, m, n), device=x2.device, dtype=torch.float32)
    return part, arrivals, torch.empty((m, n), device=x2.device, dtype=x2.dtype)


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out [rows, n]`` in x's dtype and leading shape, plus ``bias``."""
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _cfg(bm, bn, bk, split, warps, stages, unpack_rows=False):
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)
    if unpack_rows:  # the int kernel's other way to unpack (the FP8 kernel has no such argument)
        tiles["UNPACK_ROWS"] = True
    return triton.Config(tiles, num_warps=warps, num_stages=stages)


def _row_bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 4096)


def _autotuned(kernel, configs, prune=None, restore=()):
    quick = dict(do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles))
    kw = dict(key=["M_BUCKET", "N", "K"], restore_value=list(restore) or None,
              prune_configs_by={"early_config_prune": prune} if prune else None)
    try:
        return triton.autotune(configs, **kw, **quick)(kernel)
    except TypeError:  # a Triton without the do_bench argument
        return triton.autotune(configs, **kw)(kernel)


def _grid(m, n):
    return lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])


@triton.jit
def _combine_split_k(res, out, part_ptr, arrivals_ptr, row, pid_n, pid_k, rn, n_ok, M, N, SPLIT_K: tl.constexpr):
    """A split-K program's end without a zeroed float32 output: its partial sums ``res`` go to
    ``part [SPLIT_K, M, N]`` (float32), and the split that arrives last at the output tile (row ``row``,
    column tile ``pid_n``: one counter each) adds the partials in split order, in float32, and stores them in
    ``out``'s dtype (kvloom/kernels/arrivals.py)."""
    counter = arrivals_ptr + row * tl.num_programs(1) + pid_n
    n64 = N.to(tl.int64)
    tl.store(part_ptr + (pid_k * M + row) * n64 + rn, res, mask=n_ok)
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
        tl.atomic_xchg(counter, 0)
        total = tl.zeros_like(res)
        for j in tl.static_range(SPLIT_K):
            total += tl.load(part_ptr + (j * M + row) * n64 + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(out, total.to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _silu_mul_epilogue(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` of two GEMV outputs, rounded as ``silu_and_mul`` on the stored outputs rounds."""
    g = gate.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(x: torch.Tensor, numel: int) -> torch.Tensor | None:
    """The dequantized-weight buffer shared by every layer (they run one after another on one stream), at
    least ``numel`` of x's dtype; None inside a CUDA-graph capture that would have to make it: a buffer
    made then would live in the graph's private pool, which replays reuse (the eager warm-up makes it
    first)."""
    key = (x.device, x.dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        buf = _SCRATCH[key] = torch.empty(numel, device=x.device, dtype=x.dtype)
    return buf
