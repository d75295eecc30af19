"""The attention-backend interface and the per-step metadata every backend reads.

A backend writes the step's new K/V into the paged cache, then attends: decode sequences (one query
each, laid first in the batch) and prefill chunks (any number of queries over a cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.kernels import reference


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: tokens in cache after this step, per sequence
    query_start_loc: torch.Tensor  # [B+1] int32: offsets of each sequence's queries in the flat batch
    num_decodes: int  # the first num_decodes sequences have exactly one query
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """Plain-PyTorch attention over the paged cache: the CPU path and the reference for the others."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        reference.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return reference.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, max(meta.seq_lens_cpu), scale
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = reference.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                max(meta.seq_lens_cpu[:nd]), scale,
            )
        out[nd:] = reference.paged_prefill_attention(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.query_lens_cpu[nd:],
            meta.seq_lens_cpu[nd:], scale,
        )
        return out


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA, the PyTorch reference elsewhere."""
    if device.type == "cuda":
        try:
            from kvloom.core.triton_backend import TritonAttentionBackend
        except ImportError:  # Triton missing: the reference still runs on CUDA tensors
            return AttentionBackend()
        return TritonAttentionBackend()
    return AttentionBackend()
