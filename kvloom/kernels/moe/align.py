"""The fused MoE kernel's row order: a step's (token, expert) pairs sorted by expert, each expert's run padded to
the kernel's block of rows, and the expert of each block. Plain torch ops, no host sync (CUDA-graph safe)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertBlocks(NamedTuple):
    """``sorted_rows [capacity]`` int32: flat pair indices ``t * top_k + k`` in expert order, each expert's run
    padded to a multiple of ``block_m`` with ``num_rows`` (a row no program reads or writes); ``block_expert
    [capacity // block_m]`` int32: the expert of each block of ``block_m`` rows, -1 past the last run."""

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    num_rows: int
    block_m: int


def block_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    """Rows the padded order can need: each expert that gets a row pads its run by at most ``block_m - 1``.
    A function of the shapes only, so a CUDA graph captured for a token count serves any routing."""
    padded = num_rows + min(num_rows, num_experts) * (block_m - 1)
    return -(-padded // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``topk_ids [T, K]`` (ids in ``[0, num_experts)``) as expert-sorted, block-padded rows."""
    flat = topk_ids.reshape(-1).long()
    num_rows = flat.numel()
    device = flat.device
    # scatter_add rather than bincount: bincount reads the largest id back to the host
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_end = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    dest = padded_start[expert] + torch.arange(num_rows, device=device) - count_start[expert]
    capacity = block_capacity(num_rows, num_experts, block_m)
    sorted_rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=device)
    sorted_rows.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block_m, device=device)
    # a block's expert: the first whose padded run ends after the block starts (empty experts end where they start)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_rows, block_expert, num_rows, block_m)
