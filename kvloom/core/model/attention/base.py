"""The attention-backend interface and the per-step metadata every backend reads.

A backend writes the step's new K/V into the paged cache, then attends: decode sequences (one query
each, laid first in the batch) and prefill chunks (any number of queries over a cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    backend_data: object = None  # what the attention backend derives from this step once, for all layers

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    """What the model asks of an attention backend: the layout of its paged cache, and one call that writes
    a step's new K/V there and attends (decodes first, then prefill chunks over their cached prefixes)."""

    name: str

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``k_scale``/``v_scale``: the per-tensor scales of an fp8 cache (stored ``x / scale``). A layer's
        variant: ``window`` (a query sees its last ``window`` positions), ``softcap`` (scores become
        ``softcap * tanh(scores / softcap)``), ``sinks`` (``[Hq]`` logits in each softmax denominator)."""
        ...


class TorchAttentionBackend:
    """Plain-PyTorch attention over the paged cache: the reference for the others."""

    name = "torch"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's K (and V) cache in this backend's layout."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def __init__(self) -> None:
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def _decode_workspace(self, k_cache: torch.Tensor, batch: int, max_seq_len: int):
        """Reusable K/V gather buffers, grown to the largest decode batch seen (shared by all layers)."""
        bs = k_cache.shape[1]
        need = batch * -(-max_seq_len // bs) * k_cache[0].numel()
        ws = self._workspace
        if ws is None or ws[0].numel() < need or ws[0].dtype != k_cache.dtype or ws[0].device != k_cache.device:
            ws = tuple(torch.empty(need, dtype=k_cache.dtype, device=k_cache.device) for _ in range(2))
            self._workspace = ws
        return ws

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``k_scale``/``v_scale``: the per-tensor scales of an fp8 cache (stored ``x / scale``). A layer's
        variant: ``window`` (a query sees its last ``window`` positions), ``softcap`` (scores become
        ``softcap * tanh(scores / softcap)``), ``sinks`` (``[Hq]`` logits in each softmax denominator)."""
        variant = dict(window=window, softcap=softcap, sinks=sinks)
        k_cache, v_cache = kv_cache
        reference.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens_cpu[:nd])
            decoded = reference.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], max_len, scale,
                workspace=self._decode_workspace(k_cache, nd, max_len), k_scale=k_scale, v_scale=v_scale, **variant,
            )
            if nd == meta.num_seqs:
                return decoded
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decoded
        out[nd:] = reference.paged_prefill_attention(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.query_lens_cpu[nd:],
            meta.seq_lens_cpu[nd:], scale, k_scale, v_scale, **variant,
        )
        return out
