"""4-bit weights kept packed on the CPU: GGUF's Q4_0, Q4_1 and Q4_K blocks (and AWQ/GPTQ-style group-wise
codes) as torch's CPU int4 weight-packed matmul (``aten._weight_int4pack_mm_for_cpu``) takes them.

That kernel computes ``x @ W.T`` with ``W = (q - 8) * scale + zero`` per group of 32 inputs (or 64, 128...),
reading half a byte a weight: at a few rows a step it streams a quarter of bf16's bytes and wins; at more
rows oneDNN's bf16 matmul wins (``python benchmarks/cpu_int4.py``), so a layer may keep both.
"""

from __future__ import annotations

import numpy as np
import torch

# GGUF type name -> (elements a block, bytes a block)
GGUF_INT4_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
GROUP = 32  # every one of these formats has a scale (and a min) per 32 weights
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes the kernel takes (it raises on others)
INT4_N_MULTIPLE = 16  # its packing needs whole blocks of 16 outputs


def int4_supported() -> bool:
    """Whether this PyTorch build has the CPU int4 weight-packed matmul."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def int4_held_bytes(types: dict, dtype: torch.dtype) -> int:
    """Bytes the packed copies take of the 4-bit tensors in ``types`` (GGUF name -> (type, rows, cols)): half a
    byte a weight, and a scale and a zero in ``dtype`` per 32; q/k/v and gate/up count only when all their
    tensors are 4-bit, since each set runs as one fused layer. Where the AMX kernel serves (bf16 on a CPU with AMX,
    ``cpu_int4_amx``), its copy of the codes: another half byte a weight (``int4_copy_bytes``)."""
    fused = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}
    layers: dict[tuple, list] = {}
    for name, entry in types.items():
        stem = name.rsplit(".", 1)[0]
        block, _, kind = stem.rpartition(".")
        layers.setdefault((block, fused.get(kind, kind)), []).append(entry)
    return sum(int4_copy_bytes(sum(r for _, r, _ in entries), entries[0][2], GROUP, dtype)
               for entries in layers.values() if all(t in GGUF_INT4_TYPES for t, _, _ in entries))


def int4_copy_bytes(out_features: int, in_features: int, group: int, dtype: torch.dtype) -> int:
    """A layer's 4-bit copy: half a byte a weight and a scale and a zero in ``dtype`` per group and output; twice
    where the AMX kernel keeps its own layout of them beside torch's (``cpu_int4_amx``: bf16 on a CPU with AMX),
    once where the kernel runs on AVX512-BF16's dot products (its layout only)."""
    from kvloom.kernels import cpu_int4_amx

    copies = 2 if cpu_int4_amx.serves(out_features, in_features, group, dtype) and cpu_int4_amx.on_amx() else 1
    size = torch.empty((), dtype=dtype).element_size()
    return (out_features * in_features // 2 + out_features * (in_features // group) * 2 * size) * copies


def _nibbles(qs: np.ndarray, size: int) -> np.ndarray:
    """GGUF's 4-bit codes of blocks of ``size`` bytes ``qs`` [n, size]: low nibbles first, then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_int4_codes(raw: np.ndarray, type_name: str, rows: int, cols: int):
    """The codes ``q`` (uint8 [rows, cols], 0..15), ``scale`` and ``zero`` (float32 [rows, cols / 32]) of a
    GGUF tensor ``raw`` (its bytes) of type ``type_name``, such that ``W = (q - 8) * scale + zero`` exactly
    as GGUF dequantizes it (``gguf.quants``)."""
    block, nbytes = GGUF_INT4_TYPES[type_name]
    if cols % block:
        raise ValueError(f"{type_name} tensor with rows of {cols} values: not a whole number of {block}-value blocks")
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, nbytes)
    half = lambda a: a.copy().view(np.float16).astype(np.float32)  # noqa: E731
    if type_name == "Q4_0":
        d = half(b[:, 0:2])
        q = _nibbles(b[:, 2:], 16)
        scale, zero = d, np.zeros_like(d)
    elif type_name == "Q4_1":
        d, m = half(b[:, 0:2]), half(b[:, 2:4])
        q = _nibbles(b[:, 4:], 16)
        scale, zero = d, m + 8 * d
    else:  # Q4_K: 8 sub-blocks of 32, each with a 6-bit scale and min of the super-block's d and dmin
        d, dmin = half(b[:, 0:2]), half(b[:, 2:4])
        s = b[:, 4:16].reshape(-1, 3, 4)
        lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
        sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
        mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
        qs = b[:, 16:].reshape(-1, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # sub-block 2i: low nibbles of chunk i
        scale = d * sc
        zero = -dmin * mn + 8 * scale
    q = q.reshape(rows, cols)
    groups = cols // GROUP
    return q, scale.reshape(rows, groups), zero.reshape(rows, groups)


def gguf_q8_codes(raw: np.ndarray, rows: int, cols: int):
    """The codes ``q`` (int8 [rows, cols]) and scales ``d`` (float16 [rows, cols / 32]) of a Q8_0 tensor ``raw``
    (its bytes: blocks of an fp16 ``d`` and 32 int8 codes), ``W = d * q`` as GGUF dequantizes it."""
    if cols % 32:
        raise ValueError(f"Q8_0 tensor with rows of {cols} values: not a whole number of 32-value blocks")
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 34)
    d = b[:, 0:2].copy().view(np.float16).reshape(rows, cols // 32)
    q = b[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return q, d


def zero_point_codes(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group: int):
    """The codes ``q`` (uint8 [N, K]), ``scale`` and ``zero`` (float32 [N, K / group]) of an AWQ/GPTQ-style
    layer: codes ``q [K, N]`` (0..15), zero points ``z`` and ``scales`` ``[G, N]`` (input ``i`` in group
    ``i // group``; a single row ``G == 1`` is spread over every group), such that ``(q - 8) * scale + zero``
    equals ``(q - z) * scales`` exactly in float32 (``scales`` fp16: each product needs at most 16 bits)."""
    k = q.shape[0]
    s, zp = scales.float(), z.float()
    if s.shape[0] == 1:
        s, zp = s.expand(k // group, -1), zp.expand(k // group, -1)
    return q.t().to(torch.uint8).contiguous(), s.t().contiguous(), ((8 - zp) * s).t().contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """(packed weight, scales-and-zeros) for ``int4_mm`` from codes [N, K] (0..15) and per-group
    ``scale``/``zero`` [N, K / group] in float32; ``dtype``: the activations' (bf16 in practice)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()  # [K / group, N, 2]
    return packed, sz


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """``x @ W.T`` of 2-D ``x`` with ``W`` packed by ``pack_int4``."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The float32 ``W`` [N, K] the codes stand for (the reference the packed matmul is tested against)."""
    n, k = q.shape
    w = (q.float() - 8).reshape(n, k // group, group) * scale[..., None] + zero[..., None]
    return w.reshape(n, k)
