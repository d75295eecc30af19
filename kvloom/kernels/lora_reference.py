"""Plain-PyTorch reference of the LoRA shrink/expand pair: the CPU path and the oracle of
``triton_lora``.

Weights of one layer's adapter slots: ``a`` ``[slots, S, R, K]`` (each of the layer's ``S`` output slices
has its own down-projection, zero-padded to the largest rank ``R``), ``b`` ``[slots, N, R]`` (the
up-projections of the slices stacked along the layer's ``N`` outputs) and ``scale`` ``[slots, S]`` float32.
A step's tokens come grouped by slot: ``sorted_tokens`` lists the token rows of segment ``g`` at
``seg_start[g]:seg_start[g + 1]``, whose slot is ``seg_slot[g]`` (-1: an unused segment); base-model
tokens are in no segment.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def lora_shrink(x: torch.Tensor, a: torch.Tensor, groups: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """``[T, S, R]`` float32: each grouped token's input times its slot's down-projections (zeros for
    tokens of no group). ``groups``: (slot, token rows) pairs."""
    slots, num_slices, rank, k = a.shape
    out = torch.zeros(x.shape[0], num_slices, rank, dtype=torch.float32, device=x.device)
    for slot, rows in groups:
        xs = x.index_select(0, rows)
        out[rows] = (xs @ a[slot].reshape(num_slices * rank, k).t()).float().reshape(-1, num_slices, rank)
    return out


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                slices: Sequence[tuple[int, int]], groups: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """``y`` with each grouped token's shrunk input (``buf``, ``[T, S, R]``) times its slot's up-projection
    and scale added, slice by slice (``slices``: (first output, size) of each); in place, returned."""
    for slot, rows in groups:
        parts = []
        for s, (start, size) in enumerate(slices):
            h = buf.index_select(0, rows)[:, s].to(b.dtype)
            parts.append((h @ b[slot, start:start + size].t()) * scale[slot, s].to(b.dtype))
        y.index_add_(0, rows, torch.cat(parts, dim=1).to(y.dtype))
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
             slices: Sequence[tuple[int, int]], groups: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """``y`` plus every grouped token's LoRA term ``scale * (x @ A.T) @ B.T`` of its slot, per slice, in place:
    one product per adapter of the step, never per token; a slot's untargeted slices (scale 0) are skipped,
    and a group of every token needs no gather. The CPU path (``scale`` is read on the host)."""
    num_slices, rank, k = a.shape[1:]
    for slot, rows in groups:
        factors = scale[slot].tolist()
        if not any(factors):
            continue
        whole = rows.numel() == x.shape[0]  # every token, in order (groups list rows ascending)
        h = (x if whole else x.index_select(0, rows)) @ a[slot].reshape(num_slices * rank, k).t()
        for s, (start, size) in enumerate(slices):
            if not factors[s]:
                continue
            hs, bs = h[:, s * rank:(s + 1) * rank], b[slot, start:start + size].t()
            if whole:  # one BLAS call: y += scale * (h @ B.T)
                y[:, start:start + size].addmm_(hs, bs, alpha=factors[s])
            else:
                y[:, start:start + size].index_add_(0, rows, (hs @ bs).mul_(factors[s]).to(y.dtype))
    return y


def groups_of(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, token rows) of each slot present in ``token_slots`` (``[T]``, -1 for base tokens), in slot
    order: the grouping the reference takes, from the per-token form."""
    slots = token_slots.tolist()
    present = sorted({s for s in slots if s >= 0})
    return [(s, torch.nonzero(token_slots == s).flatten()) for s in present]


def segments(token_slots: np.ndarray, num_segments: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The grouping the kernels take, on the host: ``sorted_tokens`` (int32, the adapter tokens' rows by
    slot, then the base tokens' at the end), ``seg_start`` (int32 ``[num_segments + 1]``) and ``seg_slot``
    (int32 ``[num_segments]``, -1 past the step's slots). ``token_slots``: int ``[T]``, -1 for base tokens."""
    order = np.argsort(np.where(token_slots < 0, np.iinfo(np.int32).max, token_slots), kind="stable")
    present, counts = np.unique(token_slots[token_slots >= 0], return_counts=True)
    if len(present) > num_segments:
        raise ValueError(f"a step with {len(present)} adapters exceeds max_loras={num_segments}")
    seg_slot = np.full(num_segments, -1, np.int32)
    seg_slot[: len(present)] = present
    seg_start = np.zeros(num_segments + 1, np.int32)
    np.cumsum(counts, out=seg_start[1: len(present) + 1])
    seg_start[len(present) + 1:] = seg_start[len(present)]
    return order.astype(np.int32), seg_start, seg_slot
