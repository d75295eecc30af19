"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

A decode step at a few rows is some 300 small launches. Between two of them the device drains one
grid and ramps up the next. With PDL a kernel is launched while its predecessor still runs: its programs
become resident as the predecessor's retire, read what no kernel writes (a layer's weights), and only
then wait (``gdc_wait``) for the predecessor to finish and its writes to become visible.

The rules every kernel launched through ``pdl_args`` follows:

* nothing written by an earlier kernel is read, and nothing is written, before ``gdc_wait``. What may be
  read before it: weights and tables (written at load time, never during a step), and a step's inputs
  (positions, slots, sequence lengths, block tables). Those are copied in before the step's first kernel,
  and no PDL kernel writes them. A kernel without PDL (a copy, PyTorch's own) finishes before any later
  kernel starts, so a chain of PDL kernels can never run ahead of it;
* ``gdc_wait`` runs in every program unconditionally, even where the kernel reads nothing an earlier
  kernel wrote: a later kernel's wait then covers every kernel before it, not only its predecessor;
* ``gdc_launch_dependents`` may come anywhere: it only lets the next kernel's programs start and wait.
  kvloom's kernels call it first, so that a chain of kernels can be resident at once: while a GEMV's
  last programs run, the next kernels' programs take the SMs it frees and the next GEMV's read their
  first weight tiles.

Kernels launched without PDL (PyTorch's, cuBLAS) wait for their predecessor as usual, and a PDL kernel
after one of them starts when it ends, so mixing them is safe. ``pdl=False`` at each launch turns PDL off
(``KernelOptions.pdl``, an A/B switch); the Triton interpreter and GPUs before Hopper never use it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_CAPABLE: dict[int, bool] = {}


def pdl_enabled(t: torch.Tensor, enabled: bool = True) -> bool:
    """Whether kernels on ``t``'s device launch with PDL: ``enabled`` and the device has it."""
    if not (enabled and t.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9 and torch.version.hip is None
    return _CAPABLE[index]


def pdl_args(t: torch.Tensor, enabled: bool = True) -> dict:
    """The launch arguments of a kernel that takes ``PDL: tl.constexpr``: the flag, and Triton's launch
    option when it is set (``enabled`` and the device has PDL)."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled(t, enabled) else dict(PDL=False)


@triton.jit
def gdc_wait(PDL: tl.constexpr):
    """Wait for the previous kernel to finish (its writes visible); a no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch_dependents(PDL: tl.constexpr):
    """Let the next kernel's programs start (they wait in their own ``gdc_wait``); a no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
