"""Quantized expert weights for ``fused_experts``: one object per projection holding every expert's packed
tensors, ``dequantize()`` for the CPU path, and the packed tensors the Triton kernel dequantizes in registers.

Each projection is ``[E, N, K]`` as ``reference`` lays it out: ``w13`` with ``N = 2 * I`` (every expert's gate
rows, then its up rows), ``w2`` with ``N = H``. The layer's weight loader gathers the per-expert checkpoint
tensors and calls one constructor per projection (an item of a per-expert list is a tensor, or for ``w13`` a
``(gate, up)`` pair of the expert's two checkpoint tensors, concatenated along the outputs here):

* FP8 checkpoints: ``FP8Experts.from_experts(weights, scales, block=None)``; ``weights[e]`` e4m3 ``[N, K]``,
  ``scales[e]`` per tensor (one value, ``weight_scale``), per output channel (``[N]`` or ``[N, 1]``), or with
  ``block=(bo, bi)`` the ``[ceil(N / bo), ceil(K / bi)]`` grid of ``weight_scale_inv``.
  ``--quantization fp8`` of bf16 experts: ``FP8Experts.quantize(w)`` of the stacked ``[E, N, K]`` weight.
* gpt-oss MXFP4: ``MXFP4Experts.from_checkpoint(blocks, scales, interleaved_gate_up=...)`` with the checkpoint's
  stacked ``*_blocks`` ``[E, N, K / 32, 16]`` uint8 and ``*_scales`` ``[E, N, K / 32]`` uint8 (e8m0);
  ``interleaved_gate_up=True`` for ``gate_up_proj`` (gate and up rows alternate there; their biases go through
  ``deinterleave_gate_up``).
* AWQ (AutoAWQ GEMM): ``IntExperts.from_awq(qweights, qzeros, scales, group_size)`` with each expert's
  ``qweight [K, N / 8]``, ``qzeros [K / group, N / 8]``, ``scales [K / group, N]``.
* GPTQ: ``IntExperts.from_gptq(qweights, qzeros, scales, bits, group_size, g_idx=None, v1_zero_offset=True)``
  with each expert's ``qweight [K * bits / 32, N]``, ``qzeros [G, N * bits / 32]``, ``scales [G, N]`` and, under
  desc_act, ``g_idx [K]`` (a ``(gate, up)`` pair may differ; the kernel reads each input's group from it).
  ``v1_zero_offset``: the ``gptq`` format's stored-minus-one zero points (False for ``gptq_v2``).

On the CPU, dequantize once at load (``dequantize(dtype)``) and hand ``fused_experts`` dense tensors: a
quantized object reaching the CPU path is dequantized on every call. Layouts: ``kvloom.kernels.quant_reference``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

import torch

from kvloom.kernels.quant_reference import (FP8_DTYPE, fp8_quantize, fp8_scale_per_row, repack_awq, repack_gptq,
                                            unpack_int32)

# The kernel's weight formats (its FORMAT constexpr).
DENSE, FP8_CHANNEL, FP8_BLOCK, MXFP4, INT = 0, 1, 2, 3, 4

# e2m1 (MXFP4's element) by nibble: sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32

DEQUANTIZE_EXPERTS = 8

PerExpert = Sequence[Union[torch.Tensor, tuple]]


class KernelWeight(NamedTuple):
    """What the Triton kernel reads of one projection: ``fmt`` (above), the packed weight, scales, zero points,
    ``g_idx``; the scales' expert and row strides; the group size; the FP8 scale block; the scale row where the
    up half starts (block FP8); bits; and the halves ``g_idx`` holds."""

    fmt: int
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    scale_stride_e: int = 0
    scale_stride_r: int = 0
    group_size: int = 1
    block: tuple[int, int] = (1, 1)
    up_scale_row: int = 0
    bits: int = 4
    gidx_halves: int = 1


def _pair(item) -> tuple[torch.Tensor, ...]:
    return tuple(item) if isinstance(item, (tuple, list)) else (item,)


def _cat_outputs(items: PerExpert, dim: int) -> tuple[torch.Tensor, int]:
    """Each expert's parts concatenated along ``dim`` and stacked: ``([E, ...], parts per expert)``."""
    parts = [_pair(item) for item in items]
    halves = len(parts[0])
    if halves not in (1, 2) or any(len(p) != halves for p in parts):
        raise ValueError(f"each expert's item must be one tensor or a (gate, up) pair, the same for all experts; "
                         f"got {sorted({len(p) for p in parts})} parts")
    return torch.stack([torch.cat(p, dim) if halves == 2 else p[0] for p in parts]), halves


def deinterleave_gate_up(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """gpt-oss's ``gate_up_proj`` rows (gate, up alternating along ``dim``) as gate rows, then up rows."""
    return torch.cat([t[_every(t, dim, 0)], t[_every(t, dim, 1)]], dim).contiguous()


def _every(t: torch.Tensor, dim: int, start: int):
    index = [slice(None)] * t.dim()
    index[dim] = slice(start, None, 2)
    return tuple(index)


class ExpertWeights:
    """A quantized projection of every expert, ``[E, N, K]`` once dequantized."""

    num_experts: int
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_experts, self.out_features, self.in_features

    @property
    def device(self) -> torch.device:
        return self.kernel_weight().weight.device

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}

    @property
    def nbytes(self) -> int:
        """What the packed tensors hold (``engine plan``, the layer's ``held_bytes``)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> "ExpertWeights":
        """The same experts with every tensor on ``device``."""
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[E, N, K]`` weight in ``dtype`` (computed in float32, a few experts at a time so that no
        float32 copy of every expert is made)."""
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        for lo in range(0, self.num_experts, DEQUANTIZE_EXPERTS):
            hi = min(lo + DEQUANTIZE_EXPERTS, self.num_experts)
            out[lo:hi] = self._dequantize(lo, hi)
        return out

    def _dequantize(self, lo: int, hi: int) -> torch.Tensor:
        """Experts ``lo .. hi - 1`` dequantized, float32."""
        raise NotImplementedError

    def kernel_weight(self) -> KernelWeight:
        raise NotImplementedError


def dense_kernel_weight(w: torch.Tensor) -> KernelWeight:
    return KernelWeight(DENSE, w.contiguous())


# --- FP8 ------------------------------------------------------------------------------------------
@dataclass
class FP8Experts(ExpertWeights):
    """e4m3 ``weight [E, N, K]`` with float32 scales per output channel (``scale [E, N]``) or per ``block``
    (``scale [E, R, ceil(K / bi)]``; with ``halves`` 2 the gate's grid rows, then the up's, so neither half's
    blocks straddle the other)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None
    halves: int = 1

    def __post_init__(self) -> None:
        self.num_experts, self.out_features, self.in_features = self.weight.shape
        if self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 experts' weight dtype is {self.weight.dtype}; expected {FP8_DTYPE}")
        want = self._scale_shape()
        if tuple(self.scale.shape) != want:
            raise ValueError(f"FP8 experts' scale shape {tuple(self.scale.shape)} does not match weight "
                             f"{tuple(self.weight.shape)} with block {self.block} ({self.halves} halves): expected {want}")
        self.scale = self.scale.float().contiguous()

    def _scale_shape(self) -> tuple[int, ...]:
        e, n, k = self.weight.shape
        if self.block is None:
            return e, n
        bo, bi = self.block
        return e, self.halves * -(-(n // self.halves) // bo), -(-k // bi)

    @classmethod
    def from_experts(cls, weights: PerExpert, scales: PerExpert, block: tuple[int, int] | None = None) -> "FP8Experts":
        """Per-expert FP8 checkpoint tensors (``(gate, up)`` pairs for ``w13``) stacked; per-tensor scales become
        per-channel ones."""
        weight, halves = _cat_outputs(weights, 0)
        if block is not None:
            scale, _ = _cat_outputs(scales, 0)
            return cls(weight, scale, tuple(block), halves)
        rows = []
        for w_item, s_item in zip(weights, scales):
            parts = [s.float().reshape(-1).expand(w.shape[0]) if s.numel() == 1 else s.float().reshape(-1)
                     for w, s in zip(_pair(w_item), _pair(s_item))]
            rows.append(torch.cat(parts))
        return cls(weight, torch.stack(rows), None, halves)

    @classmethod
    @torch.no_grad()
    def quantize(cls, w: torch.Tensor) -> "FP8Experts":
        """``--quantization fp8`` of a float ``[E, N, K]`` weight: per output channel, ``amax / 448``; one expert
        at a time, so no float32 copy of the whole weight is made."""
        weight = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
        scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
        for e in range(w.shape[0]):
            s = fp8_scale_per_row(w[e])
            weight[e] = fp8_quantize(w[e], s)
            scale[e] = s.reshape(-1)
        return cls(weight, scale)

    def _dequantize(self, lo: int, hi: int) -> torch.Tensor:
        w = self.weight[lo:hi].float()
        if self.block is None:
            return w * self.scale[lo:hi].unsqueeze(-1)
        bo, bi = self.block
        n, k = self.out_features // self.halves, self.in_features
        rows = -(-n // bo)
        halves = []
        for h in range(self.halves):
            s = self.scale[lo:hi, h * rows:(h + 1) * rows].repeat_interleave(bo, 1).repeat_interleave(bi, 2)
            halves.append(w[:, h * n:(h + 1) * n] * s[:, :n, :k])
        return torch.cat(halves, 1)

    def kernel_weight(self) -> KernelWeight:
        if self.block is None:
            return KernelWeight(FP8_CHANNEL, self.weight, self.scale, scale_stride_e=self.scale.stride(0),
                                scale_stride_r=1)
        bo, _ = self.block
        half = self.out_features // 2
        if self.halves == 2:
            up_row = -(-half // bo)
        elif half % bo == 0:
            up_row = half // bo
        else:  # a w13 stacked whole: a scale block straddles gate and up (no kernel reads it as w2, either way)
            up_row = -1
        return KernelWeight(FP8_BLOCK, self.weight, self.scale, scale_stride_e=self.scale.stride(0),
                            scale_stride_r=self.scale.stride(1), block=self.block, up_scale_row=up_row)


# --- MXFP4 ----------------------------------------------------------------------------------------
@dataclass
class MXFP4Experts(ExpertWeights):
    """gpt-oss's MXFP4: ``blocks [E, N, K / 2]`` uint8, input ``k``'s e2m1 nibble in byte ``k // 2`` (low nibble
    for even ``k``), times ``2 ** (scales[e, n, k // 32] - 127)`` (``scales [E, N, K / 32]`` uint8, e8m0)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.blocks.dim() == 4:  # the checkpoint's [E, N, K / 32, 16]
            self.blocks = self.blocks.reshape(*self.blocks.shape[:2], -1)
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise ValueError(f"MXFP4 blocks and scales must be uint8; got {self.blocks.dtype}, {self.scales.dtype}")
        e, n, half_k = self.blocks.shape
        self.num_experts, self.out_features, self.in_features = e, n, 2 * half_k
        if tuple(self.scales.shape) != (e, n, self.in_features // MXFP4_BLOCK) or self.in_features % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 scales shape {tuple(self.scales.shape)} does not match blocks "
                             f"{tuple(self.blocks.shape)}: expected {(e, n, self.in_features // MXFP4_BLOCK)}")
        self.blocks, self.scales = self.blocks.contiguous(), self.scales.contiguous()

    @classmethod
    def from_checkpoint(cls, blocks: torch.Tensor, scales: torch.Tensor,
                        interleaved_gate_up: bool = False) -> "MXFP4Experts":
        """A gpt-oss ``*_blocks`` / ``*_scales`` pair (all experts stacked); ``interleaved_gate_up`` for
        ``gate_up_proj``, whose gate and up rows alternate."""
        if interleaved_gate_up:
            blocks, scales = deinterleave_gate_up(blocks, 1), deinterleave_gate_up(scales, 1)
        return cls(blocks, scales)

    def _dequantize(self, lo: int, hi: int) -> torch.Tensor:
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=self.blocks.device)
        b = self.blocks[lo:hi].long()
        values = torch.stack([lut[b & 15], lut[b >> 4]], -1).reshape(*b.shape[:2], -1)  # [e, N, K]
        exponent = (self.scales[lo:hi].int() - 127).repeat_interleave(MXFP4_BLOCK, -1)
        return torch.ldexp(values, exponent)

    def kernel_weight(self) -> KernelWeight:
        return KernelWeight(MXFP4, self.blocks, self.scales, scale_stride_e=self.scales.stride(0),
                            scale_stride_r=self.scales.stride(1))


# --- AWQ / GPTQ -----------------------------------------------------------------------------------
@dataclass
class IntExperts(ExpertWeights):
    """4- or 8-bit experts in the K-packed layout (``quant_reference.int_matmul``'s): ``qweight [E, K * bits / 32,
    N]`` int32, ``zeros [E, G, N]`` uint8 (the effective zero point), ``scales [E, G, N]``; input ``k`` of expert
    ``e`` in group ``k // group_size``, or ``g_idx[e, h, k]`` (``g_idx [E, halves, K]``; half ``h`` 1 for the
    up columns of a ``w13`` whose gate and up have their own order)."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    bits: int = 4
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"int experts of {self.bits} bits; supported: 4, 8")
        e, words, n = self.qweight.shape
        self.num_experts, self.out_features, self.in_features = e, n, words * 32 // self.bits
        if self.group_size == -1:
            self.group_size = self.in_features
        # with g_idx, any number of groups (a rank's slice of desc_act inputs keeps every group's row)
        groups = -(-self.in_features // self.group_size) if self.g_idx is None else self.scales.shape[1]
        for name, t in (("zeros", self.zeros), ("scales", self.scales)):
            if tuple(t.shape) != (e, groups, n):
                raise ValueError(f"int experts' {name} shape {tuple(t.shape)}: expected {(e, groups, n)} for "
                                 f"{self.in_features} inputs in groups of {self.group_size}")
        if self.g_idx is not None:
            if self.g_idx.dim() != 3 or self.g_idx.shape[0] != e or self.g_idx.shape[2] != self.in_features:
                raise ValueError(f"int experts' g_idx shape {tuple(self.g_idx.shape)}: expected "
                                 f"({e}, halves, {self.in_features})")
            self.g_idx = self.g_idx.to(torch.int32).contiguous()
        self.qweight, self.zeros, self.scales = (t.contiguous() for t in (self.qweight, self.zeros, self.scales))

    @classmethod
    def from_awq(cls, qweights: PerExpert, qzeros: PerExpert, scales: PerExpert, group_size: int) -> "IntExperts":
        """AutoAWQ GEMM tensors per expert (``(gate, up)`` pairs for ``w13``), repacked along the inputs."""
        qweight, _ = _cat_outputs(qweights, 1)
        qzero, _ = _cat_outputs(qzeros, 1)
        scale, _ = _cat_outputs(scales, 1)
        packed = [repack_awq(qweight[e], qzero[e]) for e in range(qweight.shape[0])]
        return cls(torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed]), scale, group_size, 4)

    @classmethod
    def from_gptq(cls, qweights: PerExpert, qzeros: PerExpert, scales: PerExpert, bits: int, group_size: int,
                  g_idx: PerExpert | None = None, v1_zero_offset: bool = True) -> "IntExperts":
        """GPTQ tensors per expert (``(gate, up)`` pairs for ``w13``); ``g_idx`` under desc_act (kept only where
        it is not plain ``k // group_size``)."""
        qweight, _ = _cat_outputs(qweights, 1)
        qzero, _ = _cat_outputs(qzeros, 1)
        scale, _ = _cat_outputs(scales, 1)
        packed = [repack_gptq(qweight[e], qzero[e], bits, v1_zero_offset) for e in range(qweight.shape[0])]
        order = None
        if g_idx is not None:
            order = torch.stack([torch.stack(_pair(item)) for item in g_idx]).to(torch.int32)  # [E, halves, K]
            k = order.shape[-1]
            size = k if group_size == -1 else group_size
            plain = torch.arange(k, device=order.device) // size
            if scale.shape[1] == -(-k // size) and torch.equal(order, plain.to(order.dtype).expand_as(order)):
                order = None
            elif order.shape[1] == 2 and torch.equal(order[:, 0], order[:, 1]):  # gate and up in one order
                order = order[:, :1]
        return cls(torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed]), scale, group_size,
                   bits, order)

    def _dequantize(self, lo: int, hi: int) -> torch.Tensor:
        q = unpack_int32(self.qweight[lo:hi], self.bits, 1)  # [e, K, N]
        e, k, n = q.shape
        if self.g_idx is None:
            g = (torch.arange(k, device=q.device) // self.group_size).view(1, k, 1).expand(e, k, n)
        else:  # each half of the columns by its own row of g_idx
            halves = self.g_idx.shape[1]
            g = self.g_idx[lo:hi].long().transpose(1, 2).repeat_interleave(n // halves, 2)  # [e, K, N]
        z = torch.gather(self.zeros[lo:hi].long(), 1, g)
        s = torch.gather(self.scales[lo:hi].float(), 1, g)
        return ((q - z).float() * s).transpose(1, 2)

    def kernel_weight(self) -> KernelWeight:
        return KernelWeight(INT, self.qweight, self.scales, self.zeros, self.g_idx,
                            scale_stride_e=self.scales.stride(0), scale_stride_r=self.scales.stride(1),
                            group_size=self.group_size, bits=self.bits,
                            gidx_halves=0 if self.g_idx is None else self.g_idx.shape[1])
