"""Kernel dispatch: Triton kernels for CUDA tensors, the PyTorch references elsewhere.

Model code calls these functions only; it never picks an implementation itself.
"""

from __future__ import annotations

import torch

from kvloom.kernels import reference as ref


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``x`` (CUDA tensors with Triton importable)."""
    return x.is_cuda and _triton_available()


_TRITON: bool | None = None


def _triton_available() -> bool:
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


# The Triton modules are imported inside the CUDA branches only, so CPU users never import triton.


def rms_norm(x, weight, eps, residual=None):
    if use_triton(x):
        from kvloom.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, residual)
    return ref.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache):
    """Returns the rotated ``(q, k)``; on CUDA they are rotated in place, so always use the returned tensors."""
    if use_triton(q):
        from kvloom.kernels import triton_fused

        return triton_fused.rotary_embedding(positions, q, k, cos_sin_cache)
    return ref.rotary_embedding(positions, q, k, cos_sin_cache)


def rotary_tables(positions, cos_sin_cache, dtype):
    """One step's rotary inputs, shared by every layer (``apply_rotary`` consumes them)."""
    if use_triton(positions):
        return positions, cos_sin_cache
    return ref.rotary_tables(positions, cos_sin_cache, dtype)


def apply_rotary(tables, q, k):
    """``rotary_embedding`` on ``rotary_tables``' output; on CUDA ``q``/``k`` are rotated in place."""
    if use_triton(q):
        from kvloom.kernels import triton_fused

        return triton_fused.rotary_embedding(tables[0], q, k, tables[1])
    return ref.apply_rotary(tables, q, k)


def silu_and_mul(x):
    if use_triton(x):
        from kvloom.kernels import triton_fused

        return triton_fused.silu_and_mul(x)
    return ref.silu_and_mul(x)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Store ``k``/``v`` ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]``; negative slots are padding and skipped."""
    if use_triton(k):
        from kvloom.kernels import triton_attention

        return triton_attention.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    return ref.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale):
    """One query per sequence over the paged cache. ``seq_lens`` (device int32 ``[B]``) is authoritative;
    ``max_seq_len`` is a host hint >= its maximum (fixed values are fine, e.g. for CUDA-graph capture)."""
    if use_triton(q):
        from kvloom.kernels import triton_attention

        return triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale)
    # The reference gathers exactly max_seq_len positions, so give it the true maximum.
    true_max = int(seq_lens.max()) if seq_lens.numel() else 0
    if true_max == 0:
        return torch.zeros_like(q)
    return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, true_max, scale)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale,
    query_lens_cpu=None, seq_lens_cpu=None,
):
    """Causal attention for chunks of queries over the paged cache (see ``reference.paged_prefill_attention``).

    ``query_start_loc`` (int32 ``[B+1]``) and ``seq_lens`` (int32 ``[B]``) drive the Triton kernel; the
    reference path needs python lists, passed as ``query_lens_cpu`` / ``seq_lens_cpu`` or derived here.
    """
    if use_triton(q):
        from kvloom.kernels import triton_attention

        return triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale
        )
    if query_lens_cpu is None:
        query_lens_cpu = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    if seq_lens_cpu is None:
        seq_lens_cpu = seq_lens.tolist()
    return ref.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_lens_cpu, seq_lens_cpu, scale)
