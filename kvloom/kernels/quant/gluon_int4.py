"""A many-row W4A16 GEMM for Hopper written in Gluon (Triton's explicit-layout dialect, ``triton.experimental.gluon``),
with the dequantized weight as wgmma's register operand: ``out.T = W x.T``. The weight never goes through shared
memory. Triton's ``tl.dot`` version (``int4_row.int4_row_gemm``) stores each dequantized tile to shared
memory and waits for each wgmma, so dequantization and the MMA alternate, and shared-memory bandwidth is spent
twice on the weight (docs/benchmarks.md).

**The MMA row layout** (``int4_mma_pack``): ``[N, K / 8]`` int32 words like the row layout, but inside each
64-input block of a row, word ``2 q + c`` holds inputs ``32 c + 16 n2 + 8 n1 + 2 q + n0`` at nibble
``n1 + 2 n2 + 4 n0``. Those 8 inputs are what lane ``q = lane % 4`` holds of a bf16 wgmma A fragment over
two k16 steps (inputs ``2 q + {0, 1}`` and ``+ 8``, rows ``lane / 4`` and ``+ 8``). A word tile loaded in
the accumulator-shaped layout of an ``m16n8`` MMA (columns ``2 q + c``) therefore becomes the A fragment by
register renaming only: ``gl.convert_layout`` moves nothing. Nibbles ``m`` and ``m + 4`` are the two halves
(inputs ``n0 = 0, 1``) of one 32-bit A register, so dequantization runs on pairs (as Marlin does): one LOP3
ORs both nibbles into the low mantissa bits of the magic value M (128 in bf16, 1024 in fp16), giving
``M + q`` twice; a packed subtraction of ``M + z`` leaves ``q - z`` exactly, and a packed product with the
scale gives ``(q - z) s`` rounded once to x's dtype. In fp16 that is the dequantize pass's value; in bf16 the
fp16 scale is first rounded to bf16 (so values can differ from it by about one bf16 step). Per 8 values: four
LOP3s, three shifts, four HADD2s and four HMUL2s, against 8 shift/LOP3 pairs, 8 FFMAs and 4 F2FPs in float32.

Gluon is experimental and its names move between Triton releases; the two that differ between the
device's Triton 3.6 and 3.9 are bound here. ``AVAILABLE`` is False where Gluon or its Hopper ops are missing
(or under the Triton interpreter), and the engine then keeps its Triton paths."""

from __future__ import annotations

import torch

from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.pdl import pdl_args
from kvloom.kernels.quant.common import _finish, _rows_2d, _split_outputs

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

    # Triton 3.6 has async_copy_global_to_shared and thread_barrier; later releases async_load and barrier
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    AVAILABLE = True
except (ImportError, AttributeError, AssertionError):  # no Gluon, one without these ops, or the Triton
    AVAILABLE = False  # interpreter (Gluon does not import under TRITON_INTERPRET)


# Where each input of a 64-input block sits: word ``2 q + c``, nibble ``n1 + 2 n2 + 4 n0`` holds input
# ``32 c + 16 n2 + 8 n1 + 2 q + n0``. Nibbles ``m`` and ``m + 4`` of a word are the two bf16 halves (inputs
# ``n0 = 0, 1``) of one 32-bit wgmma A register: ``(word >> 4 m) & 0x000F000F`` puts both in place at once.
def int4_mma_pack(q: torch.Tensor) -> torch.Tensor:
    """The MMA row layout ``[N, K / 8]`` (int32) of unpacked 4-bit values ``q [K, N]`` (0..15; K a multiple of
    64)."""
    k, n = q.shape
    if k % 64:
        raise ValueError(f"int4_mma_pack needs the inputs ({k}) to be a multiple of 64")
    # [n, block, c, n2, n1, q, n0] -> [n, block, word 2 q + c, nibble 4 n0 + 2 n2 + n1]
    v = q.t().reshape(n, k // 64, 2, 2, 2, 4, 2).permute(0, 1, 5, 2, 6, 3, 4).reshape(n, k // 8, 8)
    words = (v.to(torch.int64) << (4 * torch.arange(8, device=q.device))).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()


def int4_mma_unpack(words: torch.Tensor) -> torch.Tensor:
    """``int4_mma_pack``'s inverse: the 4-bit values ``[K, N]``."""
    n, kw = words.shape
    nib = (words.to(torch.int64)[..., None] >> (4 * torch.arange(8, device=words.device))) & 15  # [n, kw, 8]
    # [n, block, q, c, n0, n2, n1] -> [n, block, c, n2, n1, q, n0]
    v = nib.reshape(n, kw // 8, 4, 2, 2, 2, 2).permute(0, 1, 3, 5, 6, 2, 4)
    return v.reshape(n, kw * 8).t().contiguous()


def _pairs_asm(magic: str, kind: str) -> str:
    """PTX for one word: its 8 values ``(q - z) s`` as 16-bit outputs ``$0``-``$7`` (output ``j``: nibble ``j``),
    from the word ``$8`` and ``M + z`` and ``s`` each twice in one 32-bit register (``$9``, ``$10``). Pair ``m``
    (nibbles ``m`` and ``m + 4``) is shifted down ``4 m`` and OR-ed into ``magic`` (M in both halves) by one LOP3
    (``(a & b) | c``: 0xEA), then a packed subtraction and a packed product in ``kind`` (bf16x2 or f16x2)."""
    lines = ["{", ".reg .b32 t<4>, u;", f"lop3.b32 t0, $8, 0x000F000F, {magic}, 0xEA;"]
    for m in (1, 2, 3):
        lines += [f"shr.u32 u, $8, {4 * m};", f"lop3.b32 t{m}, u, 0x000F000F, {magic}, 0xEA;"]
    lines += [f"sub.rn.{kind} t{m}, t{m}, $9;" for m in range(4)]
    lines += [f"mul.rn.{kind} t{m}, t{m}, $10;" for m in range(4)]
    lines += [f"mov.b32 {{${m}, ${m + 4}}}, t{m};" for m in range(4)]
    return "\n".join(lines + ["}"])


if AVAILABLE:
    _PAIRS_BF16 = gl.constexpr(_pairs_asm("0x43004300", "bf16x2"))  # M = 128
    _PAIRS_F16 = gl.constexpr(_pairs_asm("0x64006400", "f16x2"))  # M = 1024
    _PAIRS_IO = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r")

    @gluon.jit
    def _zeros_scales(z_ptr, s_ptr, rn, n_ok, i, num_k, k0, N, GROUP: gl.constexpr, BLOCK_K: gl.constexpr):
        """The zero points and scales of K tile ``i`` of this split (one group: BLOCK_K divides GROUP)."""
        gi = (((k0 + i) * BLOCK_K) // GROUP) * N + rn
        ok = n_ok & (i < num_k)
        return gl.load(z_ptr + gi, mask=ok, other=0), gl.load(s_ptr + gi, mask=ok, other=0.0)

    @gluon.jit
    def _pairs(zn, sn, DT: gl.constexpr):
        """The zero points as ``M + z`` and the scales in x's dtype, each twice in one 32-bit word (both halves
        of a bf16x2 / f16x2 operand), as ``[BLOCK_N, 1]``: ``M`` is the magic value whose low mantissa bits a
        nibble is OR-ed into (128 in bf16, 1024 in fp16), so that ``(M + q) - (M + z)`` is ``q - z`` exactly."""
        MAGIC: gl.constexpr = 128.0 if DT == gl.bfloat16 else 1024.0
        zb = (zn.to(gl.float32) + MAGIC).to(DT).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        sb = sn.to(DT).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return gl.expand_dims(zb | (zb << 16), 1), gl.expand_dims(sb | (sb << 16), 1)

    @gluon.jit
    def _dequantize_pairs(words, zp, sp, DT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """A tile of words ``[BLOCK_N, BLOCK_K / 8]`` as ``(q - z) s`` in x's dtype ``[BLOCK_N, BLOCK_K]``, two
        values an instruction: per word four LOP3s (nibbles ``m`` and ``m + 4`` OR-ed into the magic value's
        halves), three shifts, four packed subtractions of ``M + z`` and four packed products with ``s``."""
        KW: gl.constexpr = BLOCK_K // 8
        if DT == gl.bfloat16:
            bf = gl.bfloat16
            v = gl.inline_asm_elementwise(_PAIRS_BF16, _PAIRS_IO, [words, zp, sp], dtype=(bf, bf, bf, bf, bf, bf, bf, bf),
                                          is_pure=True, pack=1)
        else:
            hf = gl.float16
            v = gl.inline_asm_elementwise(_PAIRS_F16, _PAIRS_IO, [words, zp, sp], dtype=(hf, hf, hf, hf, hf, hf, hf, hf),
                                          is_pure=True, pack=1)
        # output j is nibble j: input n0 = j // 4 of the pair m = j % 4 = n1 + 2 n2; joined as [.., n0, n1, n2]
        vals = gl.join(gl.join(gl.join(v[0], v[4]), gl.join(v[1], v[5])),
                       gl.join(gl.join(v[2], v[6]), gl.join(v[3], v[7])))
        # [BN, KW, n0, n1, n2], column 8 c1 + 2 q + c -> input 64 c1 + 32 c + 16 n2 + 8 n1 + 2 q + n0
        vals = gl.reshape(vals, (BLOCK_N, KW // 8, 4, 2, 2, 2, 2))
        return gl.reshape(gl.permute(vals, (0, 1, 3, 6, 5, 2, 4)), (BLOCK_N, BLOCK_K))

    @gluon.jit
    def _tile(i, acc, w_prev, zn, sn, x_smem, q_smem, x_ptrs, q_ptrs, x_mask, q_mask, z_ptr, s_ptr, rn, n_ok, num_k,
              k0, N, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, DT: gl.constexpr, w_l: gl.constexpr, a_l: gl.constexpr):
        """K tile ``i``: dequantize it into registers, start its wgmma, wait for wgmma ``i - 1`` (whose
        weight operand ``w_prev`` is free after), refill the ring's slot ``i - 1``. Returns the accumulator,
        this tile's operand (in use until the next wait) and the next tile's zero points and scales."""
        KW: gl.constexpr = BLOCK_K // 8
        zp, sp = _pairs(zn, sn, DT)
        zn, sn = _zeros_scales(z_ptr, s_ptr, rn, n_ok, i + 1, num_k, k0, N, GROUP, BLOCK_K)
        async_copy.wait_group(STAGES - 2)  # this thread's copies of tile i have landed
        fence_async_shared()  # cp.async wrote x through the generic proxy; wgmma reads the async one
        _barrier()  # and every thread's
        words = q_smem.index(i % STAGES).load(w_l)
        w = _dequantize_pairs(words, zp, sp, DT, BLOCK_N, BLOCK_K)
        w = gl.convert_layout(w, a_l)  # the same registers: a renaming
        acc = warpgroup_mma(w, x_smem.index(i % STAGES).permute((1, 0)), acc, is_async=True)
        acc, w_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w_prev))  # wgmma i - 1 is done
        _barrier()  # in every warpgroup: x's slot i - 1 may be refilled
        nxt = i + STAGES - 1
        if nxt < num_k:
            _async_load(x_smem.index(nxt % STAGES), x_ptrs + nxt * BLOCK_K, mask=x_mask)
            _async_load(q_smem.index(nxt % STAGES), q_ptrs + nxt * KW, mask=q_mask)
        async_copy.commit_group()
        return acc, w, zn, sn

    # The row count is not specialized on (its divisibility by 16, or being 1): one compile per tile, so that
    # an eager step of a new row count reuses what the CUDA-graph capture compiled.
    @gluon.jit(do_not_specialize=["M"])
    def _w4a16_mma_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, K, stride_xm, stride_qn,
                          stride_om, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, COMBINE: gl.constexpr,
                          PDL: gl.constexpr, num_warps: gl.constexpr):
        # A program: BLOCK_N outputs (wgmma's M side: 64 a warpgroup) x BLOCK_M rows of x (its N side, 8-256),
        # K split SPLIT_K ways: with COMBINE each split stores its float32 partial in part [SPLIT_K, M, N] and the
        # last to arrive at the tile (arrivals.py) adds them in split order into the output in x's dtype;
        # without, atomic adds into a zeroed float32 output. x and the words arrive through a
        # STAGES-deep cp.async ring; the zero points and scales one tile ahead in registers. wgmma i runs
        # while tile i + 1 is dequantized (one wgmma outstanding).
        DT: gl.constexpr = x_ptr.dtype.element_ty
        KW: gl.constexpr = BLOCK_K // 8
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        x_ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [num_warps, 1], [1, 0])
        q_ld: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // KW, KW // 4], [num_warps, 1], [1, 0])
        x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        w_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 8, 16])  # words: columns 2 q + c
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)

        x_smem = gl.allocate_shared_memory(DT, [STAGES, BLOCK_M, BLOCK_K], x_sl)
        q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, KW], q_sl)

        num_k = K // BLOCK_K // SPLIT_K  # the host makes K split into an even number of whole tiles
        k0 = pid_k * num_k
        rm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_ld))
        rkx = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_ld))
        x_ptrs = x_ptr + gl.expand_dims(rm.to(gl.int64) * stride_xm, 1) + gl.expand_dims(rkx, 0) + k0 * BLOCK_K
        x_mask = gl.expand_dims(rm < M, 1)
        rq = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, q_ld))
        rqw = gl.arange(0, KW, layout=gl.SliceLayout(0, q_ld))
        q_ptrs = qw_ptr + gl.expand_dims(rq.to(gl.int64) * stride_qn, 1) + gl.expand_dims(rqw, 0) + k0 * KW
        q_mask = gl.expand_dims(rq < N, 1)
        rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))
        n_ok = rn < N

        if PDL:  # the next kernel may start (and read its weights) and wait
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        # The first tiles of words, and the zero points and scales, are the weight's: read before waiting for
        # the previous kernel (PDL), x after. Group 0 holds every word tile of the prologue and x's first.
        for s in gl.static_range(STAGES - 1):
            _async_load(q_smem.index(s), q_ptrs + s * KW, mask=q_mask & (s < num_k))
        zn, sn = _zeros_scales(z_ptr, s_ptr, rn, n_ok, 0, num_k, k0, N, GROUP, BLOCK_K)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        for s in gl.static_range(STAGES - 1):
            _async_load(x_smem.index(s), x_ptrs + s * BLOCK_K, mask=x_mask & (s < num_k))
            async_copy.commit_group()

        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=acc_l)
        w_odd = gl.zeros((BLOCK_N, BLOCK_K), dtype=DT, layout=a_l)
        # Unrolled by two, so that the weight operands of consecutive wgmmas are two sets of registers: a
        # wgmma reads its register operand while it runs, and tile i + 1 is dequantized before wgmma i is
        # waited for (a single loop-carried operand would be copied into the registers wgmma i still reads).
        for t in range(0, num_k, 2):
            acc, w_even, zn, sn = _tile(t, acc, w_odd, zn, sn, x_smem, q_smem, x_ptrs, q_ptrs, x_mask, q_mask,
                                        z_ptr, s_ptr, rn, n_ok, num_k, k0, N, GROUP, BLOCK_N, BLOCK_K,
                                        STAGES, DT, w_l, a_l)
            acc, w_odd, zn, sn = _tile(t + 1, acc, w_even, zn, sn, x_smem, q_smem, x_ptrs, q_ptrs, x_mask, q_mask,
                                       z_ptr, s_ptr, rn, n_ok, num_k, k0, N, GROUP, BLOCK_N, BLOCK_K,
                                       STAGES, DT, w_l, a_l)
        acc, w_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_odd))

        o_l: gl.constexpr = gl.BlockedLayout([8, 1], [BLOCK_N // 8, 32 * 8 // BLOCK_N], [1, num_warps], [0, 1])
        on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, o_l))
        om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_l))
        o_ptrs = out_ptr + gl.expand_dims(om.to(gl.int64) * stride_om, 0) + gl.expand_dims(on, 1)
        o_mask = gl.expand_dims(om < M, 0) & gl.expand_dims(on < N, 1)
        if SPLIT_K == 1:
            gl.store(o_ptrs, gl.convert_layout(acc.to(out_ptr.dtype.element_ty), o_l), mask=o_mask)
        elif COMBINE:
            p_offs = gl.expand_dims(om * N, 0) + gl.expand_dims(on, 1)
            gl.store(part_ptr + pid_k * M * N + p_offs, gl.convert_layout(acc, o_l), mask=o_mask)
            _barrier()  # every thread's partial before the one release
            counter = arrivals_ptr + pid_m * gl.num_programs(0) + pid_n
            if gl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
                gl.atomic_xchg(counter, 0)
                total = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=o_l)
                for j in gl.static_range(SPLIT_K):
                    total += gl.load(part_ptr + j * M * N + p_offs, mask=o_mask, other=0.0, cache_modifier=".cg")
                gl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            gl.atomic_add(o_ptrs, gl.convert_layout(acc, o_l), mask=o_mask, sem="relaxed")


def int4_mma_gemm_ok(n: int, k: int, group_size: int, dtype: torch.dtype, config: dict) -> bool:
    """Whether ``int4_mma_gemm`` takes this layer with ``config``."""
    bk, split = config["BLOCK_K"], config.get("SPLIT_K", 1)
    return (AVAILABLE and dtype in (torch.bfloat16, torch.float16) and k % (2 * bk * split) == 0
            and group_size % bk == 0 and k % group_size == 0 and n % 8 == 0)


# Up to how many rows split-K tiles combine their own splits (arrivals.py): at few rows that saves the fill and
# cast kernels, while many rows' partials going through L2 twice cost more than atomic adds (docs/benchmarks.md).
COMBINE_MAX_ROWS = 16


def int4_mma_gemm(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None = None, config: dict | None = None,
                  options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """``x [.., K] @ W.T`` of a 4-bit weight in ``int4_mma_pack``'s layout (``zeros`` uint8 and ``scales``
    ``[G, N]``) on Hopper's tensor cores, from 1 to any number of rows (tiles of 8-256 rows). ``options``:
    split-K's combining and PDL."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    n = packed.shape[0]
    cfg = dict(config or int4_mma_tiles(m, n, k))
    if not int4_mma_gemm_ok(n, k, group_size, x2.dtype, cfg):
        raise ValueError(f"int4_mma_gemm does not take K={k}, N={n}, group_size={group_size}, {x2.dtype} with {cfg}")
    split = cfg.setdefault("SPLIT_K", 1)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    # up to COMBINE_MAX_ROWS the splits are combined by the last one (no fill or cast kernel)
    part, arrivals, out = _split_outputs(x2, m, n, grid[0] * grid[1], split,
                                         combine=m <= COMBINE_MAX_ROWS and options.split_combine)
    combine = arrivals is not None
    _w4a16_mma_kernel[grid](x2, packed, zeros, scales, out, part if combine else out, arrivals if combine else out,
                            m, n, k, x2.stride(0), packed.stride(0), out.stride(0), GROUP=group_size, COMBINE=combine,
                            **cfg, **pdl_args(x2, options.pdl))
    return _finish(out, x, bias)


# Tiles (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps, SPLIT_K) by weight shape and row bucket (the smallest
# bucket at or above the row count): the best configs of benchmarks/int4_mma_gemm_sweep_gpu.py (docs/benchmarks.md)
# at Llama-3-8B's projections (Mistral-7B's are the same); other shapes take int4_mma_tiles' rule.
INT4_MMA_TILES = {
    (28672, 4096): ((4, (8, 64, 128, 4, 4, 1)), (8, (8, 64, 128, 4, 4, 1)), (16, (16, 64, 128, 4, 4, 1)), (32, (32, 64, 128, 4, 4, 1)), (64, (64, 128, 64, 4, 8, 1)), (128, (128, 128, 64, 3, 8, 1)), (256, (256, 128, 64, 4, 8, 1))),
    (4096, 14336): ((4, (8, 64, 128, 4, 4, 8)), (8, (8, 64, 128, 4, 4, 8)), (16, (16, 64, 128, 4, 4, 8)), (32, (32, 64, 128, 4, 4, 4)), (64, (64, 64, 128, 4, 4, 4)), (128, (128, 128, 64, 4, 8, 4)), (256, (256, 128, 64, 4, 8, 4))),
    (6144, 4096): ((4, (8, 64, 128, 4, 4, 4)), (8, (8, 64, 128, 4, 4, 4)), (16, (16, 64, 128, 4, 4, 4)), (32, (32, 64, 128, 4, 4, 4)), (64, (64, 64, 128, 4, 4, 2)), (128, (128, 64, 128, 4, 4, 1)), (256, (128, 128, 128, 3, 8, 1))),
    (4096, 4096): ((4, (8, 64, 128, 4, 4, 8)), (8, (8, 64, 128, 4, 4, 8)), (16, (16, 64, 128, 4, 4, 8)), (32, (32, 64, 128, 4, 4, 4)), (64, (64, 64, 128, 4, 4, 4)), (128, (128, 64, 128, 4, 4, 2)), (256, (256, 128, 64, 4, 8, 4))),
}


def _tile_dict(bm: int, bn: int, bk: int, stages: int, warps: int, split: int) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps, SPLIT_K=split)


def int4_mma_tiles(rows: int, n: int, k: int) -> dict:
    """The tile for ``rows`` rows of an ``[n, k]`` weight: ``INT4_MMA_TILES`` for the shapes it has, else a rule
    read off the same sweep (64 outputs x 128 inputs on 4 warps up to 64 rows, 128 x 64 on 8 warps beyond,
    and K split for about 2-4 programs per SM)."""
    for limit, tile in INT4_MMA_TILES.get((n, k), ()):
        if rows <= limit:
            return _tile_dict(*tile)
    bm = min(256, max(8, triton.next_power_of_2(rows)))
    if rows <= 64:
        tile = _tile_dict(bm, 64, 128, 4, 4, 1)
    else:
        tile = _tile_dict(bm, 128, 64, 4, 8, 1)
    programs = triton.cdiv(n, tile["BLOCK_N"]) * triton.cdiv(rows, bm)
    cap, budget = (8, 1024) if rows <= 16 else (4, 512)
    while tile["SPLIT_K"] < cap and programs * tile["SPLIT_K"] * 2 <= budget \
            and (k // tile["BLOCK_K"]) % (tile["SPLIT_K"] * 4) == 0:
        tile["SPLIT_K"] *= 2
    return tile


def int4_mma_pack_qweight(qweight: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """The MMA row layout of a K-packed 4-bit ``qweight [K / 8, N]``, a block of ``chunk`` outputs at a time
    (the unpacked values are 8 bytes each while they are repacked)."""
    from kvloom.kernels.quant_reference import unpack_int32

    n = qweight.shape[1]
    return torch.cat([int4_mma_pack(unpack_int32(qweight[:, i:i + chunk], 4, 0)) for i in range(0, n, chunk)])
