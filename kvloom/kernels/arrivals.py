"""Arrival counters for split kernels that combine their own splits.

A kernel split across programs (the one-row int4 and FP8 GEMVs' split-K) needs the splits' partial results
combined. A second kernel costs a launch and, with PDL, the chain of early launches (pdl.py);
atomically adding float32 partials into a zeroed output costs a fill and a cast kernel and is not
deterministic. Instead each split stores its partial, and the program that arrives last at its output tile,
counted by an atomic add on a counter, combines the partials in a fixed order and stores the result.
(Decode attention keeps its reduce kernel: combining its key splits this way was slower, docs/benchmarks.md.)

The rules every kernel using these counters follows:

* the counter is touched only after ``gdc_wait``, and the last program sets it back to zero, so one buffer
  serves every kernel of a device: kernels run one after another on one stream, and under PDL a kernel's
  programs reach its counters only once the kernel before it has finished;
* the partials are stored, then a CTA barrier (``tl.debug_barrier``), then the ``acq_rel`` add: the barrier
  orders every thread's stores before the one thread's release, and the last program reads the partials
  from L2 (``cache_modifier=".cg"``), not from an L1 line an earlier kernel left.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
MIN_COUNTERS = 4096  # enough for every split kernel of a decode step at once; grown on demand outside capture


def arrival_counters(like: torch.Tensor, needed: int) -> torch.Tensor | None:
    """Zeroed int32 counters (at least ``needed``) on ``like``'s device, shared by every kernel there. None
    inside a CUDA-graph capture that would have to make or grow them (a buffer made then would live in the
    graph's pool, which replays reuse): the caller then takes its other way of combining splits."""
    buf = _COUNTERS.get(like.device)
    if buf is None or buf.numel() < needed:
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[like.device] = torch.zeros(max(needed, MIN_COUNTERS), dtype=torch.int32, device=like.device)
    return buf
