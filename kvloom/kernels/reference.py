"""Plain-PyTorch reference kernels: the CPU path of kvloom and the oracle for the Triton kernels.

KV cache layout (one K and one V tensor per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``; a request's block table lists its block ids in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the cache stores it. An fp8 cache holds ``x * (1 / scale)`` rounded to nearest (ties to even)
    and saturated at +-448 (an overflow would otherwise become NaN); other caches hold ``x`` cast."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached K or V back in the compute ``dtype`` (``x * scale`` for an fp8 cache)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    out = x.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store ``k``/``v`` (``[T, Hkv, D]``) at ``slot_mapping`` (``[T]``, all valid) in the paged caches,
    quantized when the caches are fp8 (per-tensor ``k_scale``/``v_scale``)."""
    idx = slot_mapping.long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q = quantize_kv(x, cache.dtype, scale)
        if is_fp8(cache.dtype):  # index_copy_ has no float8 kernels: copy the bytes
            cache, q = cache.view(torch.uint8), q.view(torch.uint8)
        cache.view(-1, cache.shape[-2], cache.shape[-1]).index_copy_(0, idx, q)


def _gather(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int, workspace: torch.Tensor | None = None
) -> torch.Tensor:
    """The first ``num_tokens`` cached tokens of each row of ``block_tables``: ``[B, num_tokens, Hkv, D]``.

    Whole blocks are gathered with ``index_select`` (contiguous copies), which on the CPU is several
    times faster than indexing token by token. A reused ``workspace`` (any 1-D tensor of the cache's
    dtype, grown as needed) spares a fresh multi-megabyte allocation per layer.
    """
    bs = cache.shape[1]
    num_blocks = -(-num_tokens // bs)
    blocks = block_tables[:, :num_blocks]
    idx = blocks.reshape(-1).long()
    if workspace is not None and workspace.numel() >= idx.numel() * cache[0].numel():
        out = workspace[: idx.numel() * cache[0].numel()].view(idx.numel(), *cache.shape[1:])
        torch.index_select(cache, 0, idx, out=out)
    else:
        out = cache.index_select(0, idx)
    return out.view(blocks.shape[0], num_blocks * bs, *cache.shape[2:])[:, :num_tokens]


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention written out, as transformers' eager attention computes it: ``q`` ``[..., H, Q, D]`` against
    ``keys``/``values`` ``[..., H, S, D]`` where ``mask`` (bool, broadcast to ``[..., H, Q, S]``) is True;
    scores ``q @ k.T * scale``, then ``softcap * tanh(scores / softcap)``; ``sinks`` (one logit per head,
    broadcast to ``[..., H, Q, 1]``) join each row's softmax denominator; softmax in float32, probabilities
    cast back to ``q``'s dtype."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), values)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[Q, S]`` bool: key position ``k_pos[j]`` is visible to the query at ``q_pos[i]`` (causal, and within
    the last ``window`` positions up to the query's own where a window is given)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence. ``q`` is ``[B, Hq, D]``; ``seq_lens[b]`` counts cached tokens
    (the query's own included); returns ``[B, Hq, D]``. ``workspace``: optional reusable buffers for
    the gathered K and V (see ``_gather``). An fp8 cache is dequantized with ``k_scale``/``v_scale``.
    ``window``: the query sees only the last ``window`` positions; ``softcap``/``sinks``: see ``attend``."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k_ws, v_ws = workspace if workspace is not None else (None, None)
    keys = dequantize_kv(_gather(k_cache, block_tables, max_seq_len, k_ws).transpose(1, 2), q.dtype, k_scale)
    values = dequantize_kv(_gather(v_cache, block_tables, max_seq_len, v_ws).transpose(1, 2), q.dtype, v_scale)
    pos = torch.arange(max_seq_len, device=q.device)[None, :]
    lens = seq_lens[:, None].to(q.device)
    mask = pos < lens
    if window is not None:
        mask &= pos >= lens - window
    # The query heads sharing a KV head act as that head's queries: no K/V expansion for GQA.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is not None or sinks is not None:
        sinks = None if sinks is None else sinks.view(num_kv_heads, -1, 1)
        out = attend(grouped, keys, values, mask[:, None, None, :], scale, softcap, sinks)
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for chunks of queries over paged caches (prefill, chunked prefill, prefix hits).

    ``q`` is ``[T, Hq, D]`` with the sequences' queries laid end to end; sequence ``b`` has
    ``query_lens[b]`` queries, which are its last tokens, ``seq_lens[b]`` tokens in all (cached prefix
    included, already written to the cache). Query ``i`` of sequence ``b`` sits at position
    ``seq_lens[b] - query_lens[b] + i`` and attends to every position up to its own (the last ``window``
    of them where a window is given); ``softcap``/``sinks``: see ``attend``.
    """
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        keys = dequantize_kv(_gather(k_cache, block_tables[b : b + 1], s_len)[0].transpose(0, 1), q.dtype, k_scale)
        values = dequantize_kv(_gather(v_cache, block_tables[b : b + 1], s_len)[0].transpose(0, 1), q.dtype, v_scale)
        qb = q[start : start + q_len].transpose(0, 1)  # [Hq, Q, D]
        mask = visible(torch.arange(s_len - q_len, s_len, device=q.device), torch.arange(s_len, device=q.device),
                       window)
        if softcap is not None or sinks is not None:
            group = q.shape[1] // keys.shape[0]
            o = attend(qb, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0), mask, scale,
                       softcap, None if sinks is None else sinks.view(-1, 1, 1))
        elif q_len == s_len and window is None:
            o = F.scaled_dot_product_attention(qb, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    scale_in_float32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as Hugging Face computes it (float32 statistics, cast back, then scale); with
    ``scale_in_float32`` (Gemma's form) scaled in float32 first and cast back once.

    With ``residual``, first adds it (``x + residual``) and returns ``(normed, x + residual)``.
    """
    if residual is not None:
        x = x + residual
        new_residual = x
    h = x.float()
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if scale_in_float32:
        out = h.mul_(weight.float()).to(x.dtype)
    else:
        out = h.to(x.dtype).mul_(weight)  # a fresh tensor in any dtype: scaling it in place is safe
    return (out, new_residual) if residual is not None else out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate halves), computed in float32: the oracle for the kernels.
    ``q``: ``[T, Hq, D]``, ``k``: ``[T, Hkv, D]``; ``cos_sin_cache``: ``[max_positions, D]`` float32
    holding ``cos`` of the ``D/2`` frequencies, then ``sin``."""
    rq, rk = apply_rotary(rotary_tables(positions, cos_sin_cache, torch.float32), q.float(), k.float())
    return rq.to(q.dtype), rk.to(k.dtype)


def rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    """One step's rotary factors, built once for every layer: ``(cos, sin)``, each ``[T, 1, D]`` in
    ``dtype``, with ``sin``'s first half negated so that ``apply_rotary`` needs no ``cat``/``neg``."""
    cs = cos_sin_cache[positions.long()]
    half = cs.shape[-1] // 2
    cos = cs[:, :half].repeat(1, 2)
    sin = torch.cat([-cs[:, half:], cs[:, half:]], dim=-1)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(tables, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` by ``rotary_tables``' factors, in the tensors' dtype (as transformers computes
    it): ``x * cos + roll(x, D/2) * sin``, which is ``x * cos + cat(-x2, x1) * sin`` bit for bit."""
    cos, sin = tables
    half = q.shape[-1] // 2

    # the halves swapped by a cat (roll's values): compiled, a cat is two vector loads and a roll a gather
    def rotate(x: torch.Tensor) -> torch.Tensor:
        return (x * cos).add_(torch.cat((x[..., half:], x[..., :half]), -1).mul_(sin))

    num_heads = q.shape[1]
    if _adjacent_heads(q, k):  # cut from one fused projection: rotate both as one tensor, half the ops
        out = rotate(q.as_strided((q.shape[0], num_heads + k.shape[1], q.shape[2]), q.stride()))
        return out[:, :num_heads], out[:, num_heads:]
    return rotate(q), rotate(k)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether each row of ``k`` directly follows the same row of ``q`` in memory (``[T, H, D]`` views of one
    ``[T, (Hq + Hkv + ...) * D]`` projection output), so that ``q``'s heads and ``k``'s are one ``[T, Hq + Hkv, D]``
    view."""
    if torch.compiler.is_compiling():  # storage pointers cannot be traced; the compiler fuses both anyway
        return False
    head_dim = q.shape[-1]
    return (q.dtype == k.dtype and q.device == k.device and q.shape[0] == k.shape[0] and q.shape[0] > 0
            and q.stride() == k.stride() and q.stride(2) == 1 and q.stride(1) == head_dim
            and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
            and k.storage_offset() == q.storage_offset() + q.shape[1] * head_dim)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[:, :I]) * x[:, I:]`` for ``x`` of ``[T, 2I]`` (GeGLU, as Gemma's MLP computes it)."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh").mul_(x[..., half:])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` of ``[T, 2I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]).mul_(x[..., half:])
