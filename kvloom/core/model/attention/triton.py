"""Attention on CUDA through the Triton kernels (the backend ``get_attention_backend`` picks on GPUs)."""

from __future__ import annotations

import torch

from kvloom.core.model.attention.base import AttentionMetadata, TorchAttentionBackend
from kvloom.kernels import triton_attention


class TritonAttentionBackend:
    name = "triton"
    kv_cache_shape = staticmethod(TorchAttentionBackend.kv_cache_shape)  # the kernels' layout is the reference one
    # forward takes the step's rotary tables (``rope``) and rotates q and k itself, in the kernel that
    # writes the cache: one launch a layer instead of two
    fuses_rotary = True
    takes_written_kv = True  # forward(kv_written=True): q/k rotated and the cache written before it

    def __init__(self, pdl: bool = True) -> None:
        self.pdl = pdl  # launch with programmatic dependent launch where the GPU has it (kvloom/kernels/pdl.py)

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
        rope=None,
        kv_written: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """With ``rope`` (``ops.rotary_tables``' CUDA form, ``(positions, cos_sin_cache)``), q and k are
        rotated here first (q in place). ``kv_written``: q and k come rotated and this step's k/v are in
        the cache already (the qkv projection's kernel did both). ``window``/``softcap``/``sinks``: the
        layer's variant (``AttentionBackend.forward``)."""
        variant = dict(window=window, softcap=softcap, sinks=None if sinks is None else sinks.float().contiguous())
        k_cache, v_cache = kv_cache
        if not kv_written:
            if rope is not None:
                q = triton_attention.rotary_and_write_kv_cache(rope[0], q, k, v, rope[1], k_cache, v_cache,
                                                               meta.slot_mapping, k_scale, v_scale, pdl=self.pdl)
            else:
                triton_attention.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale,
                                                pdl=self.pdl)
        if meta.num_decodes == meta.num_seqs:
            # ``max_seq_len`` is only a hint for the split count; CUDA graphs capture with a fixed one.
            return triton_attention.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale,
                k_scale=k_scale, v_scale=v_scale, pdl=self.pdl, **variant,
            )
        # Mixed batches: the prefill kernel handles single-query sequences too, in one launch.
        return triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, scale,
            k_scale=k_scale, v_scale=v_scale, **variant,
        )
