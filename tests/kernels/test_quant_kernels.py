"""The Triton W4A16/W8A16 GEMM against its PyTorch reference (small shapes through the ``tk`` fixture:
interpreted on the CPU, compiled on a GPU), the repacking of AWQ/GPTQ into its layout, and FP8 W8A8."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import quant_reference as qr

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_packed(k: int, n: int, bits: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    groups = -(-k // group)
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).to(torch.uint8)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    return qr.pack_int32(q, bits, 0), zeros, scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("group", [32, 256, 40])  # 40: no K tile divides it, per-element scales
def test_int_matmul_kernel_matches_the_reference(tk, bits, rows, group):
    k, n = 256, 96  # n not a multiple of the 64-wide tiles: the masks are exercised
    qweight, zeros, scales = random_packed(k, n, bits, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    want = qr.int_matmul(x, qweight, zeros, scales, group, bits, bias)
    dev = tk.device
    args = [t.to(dev) for t in (x, qweight, zeros, scales)]
    got = tk.int_kpacked.int_matmul(*args, group, bits, bias.to(dev))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    # split-K (the decode tiles) and single-pass tiles give the same product, with either way of unpacking
    for cfg in (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4, num_warps=4),
                dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4),
                dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, UNPACK_ROWS=True)):
        got = tk.int_kpacked.int_matmul(*args, group, bits, bias.to(dev), config=cfg)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


def test_decode_and_batched_tiles_differ():
    from kvloom.kernels.quant.int_kpacked import tile_config

    assert tile_config(1, 4096, 4096)["SPLIT_K"] > 1 and tile_config(1, 4096, 4096)["BLOCK_M"] == 16
    assert tile_config(256, 4096, 4096)["SPLIT_K"] == 1 and tile_config(256, 4096, 4096)["BLOCK_M"] == 128


def test_awq_repacked_along_the_inputs_is_the_same_weight():
    from tests.quant_checkpoints import awq_quantize

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    t, deq = awq_quantize(w, 32)
    assert torch.equal(qr.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], 32), deq)
    qweight, zeros = qr.repack_awq(t["qweight"], t["qzeros"])
    x = torch.randn(3, 128)
    torch.testing.assert_close(qr.int_matmul(x, qweight, zeros, t["scales"], 32, 4), x @ deq.t(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("v2", [False, True])
def test_gptq_desc_act_repacked_with_sorted_inputs_is_the_same_product(bits, v2):
    from tests.quant_checkpoints import gptq_quantize

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    t, deq = gptq_quantize(w, bits, 32, sym=False, desc_act=True, v2=v2, gen=torch.Generator().manual_seed(2))
    assert torch.equal(qr.dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, 32, not v2), deq)
    perm = torch.argsort(t["g_idx"].long(), stable=True)
    qweight, zeros = qr.repack_gptq(t["qweight"], t["qzeros"], bits, not v2, perm)
    x = torch.randn(3, 128)
    torch.testing.assert_close(qr.int_matmul(x[:, perm], qweight, zeros, t["scales"], 32, bits), x @ deq.t(),
                               atol=1e-5, rtol=1e-5)


def test_fp8_w8a8_matches_the_reference_that_quantizes_activations_the_same_way():
    from kvloom.core.model.quantization.fp8 import fp8_w8a8_linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) * 0.05
    scale = qr.fp8_scale_per_row(w)
    wq = qr.fp8_quantize(w, scale)
    x = torch.randn(5, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    # On a GPU the engine's own path (cuBLASLt); else the CPU's _scaled_mm (row-wise scales since torch 2.12).
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    on = lambda *ts: [t if t is None else t.to(dev) for t in ts]  # noqa: E731
    for input_scale in (None, torch.tensor([0.01])):
        want = qr.fp8_linear_reference(x, wq, scale, input_scale, bias, torch.float32)
        got = fp8_w8a8_linear(*on(x, wq, scale, input_scale, bias)).cpu()
        if dev == "cpu":
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:  # the GPU's activation quantization may round an input one FP8 step apart (~6%): 1% of the output scale
            assert (got - want).abs().max() <= 0.01 * want.abs().max()
    # and the error against the unquantized product is FP8's, small but not zero
    err = (fp8_w8a8_linear(*on(x, wq, scale, None, None)).cpu() - x @ w.t()).abs().max() / (x @ w.t()).abs().max()
    assert 1e-4 < err < 0.05


@requires_cuda
@pytest.mark.parametrize("rows", [1, 256])
def test_int_matmul_on_the_gpu_at_llama_shapes(rows):
    from kvloom.kernels.quant import int_kpacked

    qweight, zeros, scales = random_packed(4096, 4096, 4, 128)
    x = torch.randn(rows, 4096).to(torch.bfloat16)
    want = qr.int_matmul(x.float(), qweight, zeros, scales, 128, 4)
    got = int_kpacked.int_matmul(x.cuda(), qweight.cuda(), zeros.cuda(), scales.cuda(), 128, 4)
    torch.testing.assert_close(got.float().cpu(), want, atol=0.05, rtol=0.02)


def fp8_layer(rows: int, seed: int):
    """An FP8 layer (weight, per-channel scales, bias) of a shape that is no multiple of any tile, so
    the kernels' masks are exercised; activations of ``rows`` rows and the dequantized product."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 80, 300
    w = torch.randn(n, k, generator=gen) * 0.05
    scale = qr.fp8_scale_per_row(w)
    wq = qr.fp8_quantize(w, scale)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    want = x @ (wq.float() * scale).t() + bias
    return x, wq, scale, bias, want


@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("split", [1, 3])
def test_fp8_weight_only_gemv_matches_the_dequantized_product(tk, rows, split):
    """The decode path of FP8 layers: bf16/float32 activations times the FP8 weight with its per-channel
    scales, no activation quantization."""
    x, wq, scale, bias, want = fp8_layer(rows, seed=0)
    dev = tk.device
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=split, num_warps=4)
    got = tk.fp8_weight_only.fp8_weight_only_linear(x.to(dev), wq.to(dev), scale.to(dev), bias.to(dev), config=cfg)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    got = tk.fp8_weight_only.fp8_weight_only_linear(x.to(dev), wq.to(dev), scale.to(dev), bias.to(dev))  # its own tiles
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows,k", [(1, 64), (5, 300), (17, 2500)])
def test_fp8_per_token_activation_quantization_in_one_kernel(tk, rows, k):
    """The W8A8 path's activation quantization (per-row amax / 448, round to e4m3) equals the reference's,
    with the rows padded to 16 for cuBLASLt (zeros, scale 1)."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 2, rows)[:, None]
    want_scale = qr.fp8_scale_per_row(x)
    want = qr.fp8_quantize(x, want_scale)
    xq, scale = tk.fp8_rows.fp8_quantize_rows(x.to(tk.device))
    padded = -(-rows // 16) * 16
    assert xq.shape == (padded, k) and scale.shape == (padded, 1)
    torch.testing.assert_close(scale[:rows].cpu(), want_scale, rtol=1e-6, atol=0)
    close = (xq[:rows].cpu().float() - want.float()).abs() <= 2.0 ** -3 * want.float().abs()  # at most one step
    assert close.all()
    if tk.device == "cpu":  # the interpreter divides exactly, as torch does: the same bytes
        assert torch.equal(xq[:rows].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(xq[rows:].cpu().float(), torch.zeros(padded - rows, k))
    assert torch.equal(scale[rows:].cpu(), torch.ones(padded - rows, 1))


@pytest.mark.parametrize("rows,k,residual", [(3, 64, False), (17, 300, True), (16, 2048, True)])
def test_rms_norm_and_silu_and_mul_quantize_their_rows_as_the_unfused_kernels_do(tk, rows, k, residual):
    """For a W8A8 layer, RMSNorm and SiLU-and-mul quantize their own output per row (``FP8Rows``): the
    same FP8 bytes and scales as their unfused kernel followed by ``fp8_quantize_rows``, padding included,
    and the same new residual."""
    gen = torch.Generator().manual_seed(5)
    dev = tk.device
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, rows)[:, None]).bfloat16().to(dev)
    res = torch.randn(rows, k, generator=gen).bfloat16().to(dev) if residual else None
    w = (torch.rand(k, generator=gen) + 0.5).bfloat16().to(dev)
    want = tk.fused.rms_norm(x, w, 1e-5, res)
    got = tk.fp8_rows.rms_norm_fp8(x, w, 1e-5, res)
    if residual:
        (want, want_res), (got, got_res) = want, got
        assert torch.equal(got_res, want_res)
    pairs = [(got, tk.fp8_rows.fp8_quantize_rows(want))]
    gate_up = torch.randn(rows, 2 * k, generator=gen).bfloat16().to(dev) * 3
    pairs.append((tk.fp8_rows.silu_and_mul_fp8(gate_up), tk.fp8_rows.fp8_quantize_rows(tk.fused.silu_and_mul(gate_up))))
    for got, (want_q, want_scale) in pairs:
        assert isinstance(got, qr.FP8Rows) and got.rows == rows and got.dtype == torch.bfloat16
        assert got.data.shape == want_q.shape == (-(-rows // 16) * 16, k)
        assert torch.equal(got.scale, want_scale)
        assert torch.equal(got.data.view(torch.uint8), want_q.view(torch.uint8))


def test_fused_activation_quantization_leaves_rows_too_wide_to_the_unfused_kernels(tk):
    """Rows wider than ``max_cols`` (``FP8_FUSED_MAX_COLS``; or with ``fp8_fused_quant`` off) get None: the
    caller runs the unfused kernel, and the layer quantizes its input itself. An empty batch gives empty FP8
    rows."""
    from kvloom.kernels.options import KernelOptions

    x = torch.ones(2, 64, device=tk.device)
    assert tk.fp8_rows.rms_norm_fp8(x, torch.ones(64, device=tk.device), 1e-5, max_cols=32) is None
    assert tk.fp8_rows.silu_and_mul_fp8(torch.ones(2, 128, device=tk.device), max_cols=32) is None
    empty = tk.fp8_rows.rms_norm_fp8(x[:0], torch.ones(64, device=tk.device), 1e-5)  # no rows: nothing launched
    assert empty.rows == 0 and empty.data.shape == (0, 64)
    assert tk.fp8_rows.silu_and_mul_fp8(torch.ones(0, 128, device=tk.device)).data.shape == (0, 64)
    off = KernelOptions(fp8_fused_quant=False)
    assert tk.fp8_rows.rms_norm_fp8(x, torch.ones(64, device=tk.device), 1e-5, options=off) is None
    assert tk.fp8_rows.silu_and_mul_fp8(torch.ones(2, 128, device=tk.device), options=off) is None


def _pack_4bit(tk, qweight: torch.Tensor, layout: str) -> torch.Tensor:
    """A K-packed 4-bit weight in the row layout or the Gluon GEMM's MMA row layout, on the test's device."""
    from kvloom.kernels.quant import gluon_int4 as gq

    return tk.int4_row.int4_row_pack(qweight.to(tk.device)) if layout == "row" else \
        gq.int4_mma_pack_qweight(qweight).to(tk.device)


@pytest.mark.parametrize("group,layout", [(32, "row"), (64, "row"), (128, "row"), (64, "mma"), (128, "mma")])
@pytest.mark.parametrize("split,combine", [(1, True), (2, True), (3, True), (2, False)])
def test_int4_row_gemv_matches_the_reference(tk, group, layout, split, combine):
    """The bit-pattern GEMV on its row-major layout (``int4_row_pack``), and on the Gluon GEMM's MMA row layout
    (the same words and groups, x read at other inputs): each nibble becomes the float ``1 + q / 128`` and
    each group's offset and zero point come off its sums, the same product as dequantizing first, to float32
    rounding; three rows, N of 80 (a partial column tile), a bias, tiles of one and of several groups.
    Split-K with the last split combining the partials (``split_combine``; 3 splits of 2 tiles leave one
    empty) and with atomic adds into a zeroed float32 output."""
    from kvloom.kernels.options import KernelOptions

    options = KernelOptions(split_combine=combine)
    k, n = 512, 80
    qweight, zeros, scales = random_packed(k, n, 4, group, seed=11)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(12))
    bias = torch.randn(n)
    want = qr.int_matmul(x, qweight, zeros, scales, group, 4, bias)
    packed = _pack_4bit(tk, qweight, layout)
    assert packed.shape == (n, k // 8) and packed.dtype == torch.int32
    args = [t.to(tk.device) for t in (x, packed, zeros, scales)]
    for block_k in (group, 256):
        cfg = dict(BLOCK_N=32, BLOCK_K=block_k, SPLIT_K=split, num_warps=4)
        got = tk.int4_row.int4_row_gemv(*args, group, bias.to(tk.device), config=cfg, mma_layout=layout == "mma",
                                        options=options)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
        if split > 1 and combine:  # the partials added in split order: the same bits every time
            assert torch.equal(tk.int4_row.int4_row_gemv(*args, group, bias.to(tk.device), config=cfg,
                                                      mma_layout=layout == "mma"), got)
    if split > 1 and combine:
        from kvloom.kernels import arrivals

        assert int(arrivals._COUNTERS[args[0].device].abs().sum()) == 0  # left zero for the next kernel


def test_fp8_qkv_rope_tiles_split_a_heads_rows_and_read_long_k_tiles():
    """The fused qkv + rotary GEMV takes the one-row tiles with half the rows from each half of a head and
    a K tile of 1024 (the decode step's timing at Llama-3-8B's qkv_proj), or K's power of two below it; the
    plain qkv GEMV keeps its own 512."""
    from kvloom.kernels.quant import fp8_weight_only

    llama = fp8_weight_only.fp8_qkv_rope_tiles(6144, 4096)
    assert (llama["BLOCK_N"], llama["BLOCK_K"], llama["SPLIT_K"]) == (4, 1024, 1)
    assert fp8_weight_only.fp8_row_tiles(6144, 4096)["BLOCK_K"] == 512
    assert fp8_weight_only.fp8_qkv_rope_tiles(384, 64)["BLOCK_K"] == 1024  # the 4096 x 4096 tile's own K tile
    assert fp8_weight_only.fp8_qkv_rope_tiles(40000, 512)["BLOCK_K"] == 512  # K below 1024: its power of two
    assert fp8_weight_only.fp8_qkv_rope_tiles(10**6, 4096) is None  # no fixed tiles: not fused


def test_int4_tiles_by_shape_and_rows():
    """The row GEMV splits K on long, narrow weights; the tensor-core kernel widens its tile beyond 16 rows
    and on wide weights."""
    from kvloom.kernels.quant import int4_row

    assert int4_row.int4_row_tiles(4096, 14336) == int4_row.INT4_ROW_LONG_K and int4_row.int4_row_tiles(6144, 4096) == int4_row.INT4_ROW_TILE
    assert [int4_row.int4_mma_tiles(r, n) for r, n in ((8, 6144), (32, 4096), (8, 28672))] == \
        [int4_row.INT4_MMA_TILE, int4_row.INT4_MMA_TILE_ROWS, int4_row.INT4_MMA_TILE_WIDE]


def test_only_groups_the_row_kernels_take_get_the_row_layout():
    """AWQ's and GPTQ's groups of 32-128 run on the row layout; a group of all K inputs (GPTQ group_size -1)
    would make the tensor-core kernel's K tile the whole row, so it keeps the K-packed kernels."""
    from kvloom.kernels.quant.dispatch import int4_row_layout_ok

    assert all(int4_row_layout_ok(4096, g) for g in (32, 64, 128))
    assert not int4_row_layout_ok(4096, 4096) and not int4_row_layout_ok(14336, 14336)
    assert not int4_row_layout_ok(4096, 256) and not int4_row_layout_ok(96, 64)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("split", [1, 2])
def test_int4_tensor_core_kernel_on_the_row_layout_matches_the_reference(tk, group, split):
    """The output-major tensor-core kernel (``int4_mma_gemm``) reads the row layout, x loaded in its K
    order: bf16 ``128 + q`` from bit patterns (fp16 ``1024 + q``), the offset and zero point off each
    group's sums; 1, 5, 16 and 40 rows (padded to 16, 16, 16, 64), N of 80 (a partial tile)."""
    k, n = 256, 80
    qweight, zeros, scales = random_packed(k, n, 4, group, seed=14)
    packed = tk.int4_row.int4_row_pack(qweight.to(tk.device))
    bias = torch.randn(n)
    for rows, dtype in ((1, torch.bfloat16), (5, torch.float16), (16, torch.bfloat16), (40, torch.bfloat16)):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = qr.int_matmul(x.float(), qweight, zeros, scales, group, 4, bias)
        args = [t.to(tk.device) for t in (x, packed, zeros, scales)]
        cfg = dict(BLOCK_N=32, SPLIT_K=split, num_warps=2)
        got = tk.int4_row.int4_mma_gemm(*args, group, bias.to(tk.device), config=cfg).float().cpu()
        assert (got - want).abs().max() <= 0.01 * want.abs().max()  # 16-bit output; exact sums inside


@pytest.mark.parametrize("fma,layout", [(False, "row"), (True, "row"), (True, "mma")])
def test_int4_row_layout_dequantizes_to_the_reference_weight(tk, fma, layout):
    """The many-row path's dequantization from the row layout (and from the MMA row layout): ``(q - z) * s`` as
    the reference, into ``[N, K]`` in input order, to the bit in float32 (and in bf16 on a GPU; the
    interpreter's bf16 cast truncates), with each value built by an integer-to-float conversion or by the bit
    pattern and one FMA (``int4_dequant_fma``), both ways the same bits; then the dense product (a second,
    smaller layer reuses the scratch buffer)."""
    from kvloom.kernels.options import KernelOptions

    options, other = KernelOptions(int4_dequant_fma=fma), KernelOptions(int4_dequant_fma=not fma)
    mma = layout == "mma"
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(15))
    for k, n, group in ((256, 96, 64 if mma else 32), (128, 64, 64)):
        qweight, zeros, scales = random_packed(k, n, 4, group, seed=k)
        dense = qr.int_matmul(torch.eye(k), qweight, zeros, scales, group, 4)  # [K, N]
        packed = _pack_4bit(tk, qweight, layout)
        args = [t.to(tk.device) for t in (packed, zeros, scales)]
        buf = torch.empty(k * n, device=tk.device)
        torch.testing.assert_close(tk.int4_row.int4_row_dequantize(*args, group, buf, mma, options).cpu(),
                                   dense.t(), atol=0, rtol=0)
        buf16 = torch.empty(k * n, device=tk.device, dtype=torch.bfloat16)
        got16 = tk.int4_row.int4_row_dequantize(*args, group, buf16, mma, options).cpu()
        if tk.device == "cuda":  # the interpreter's float32 -> bf16 cast truncates instead of rounding
            assert torch.equal(got16, dense.t().to(torch.bfloat16))
        assert torch.equal(tk.int4_row.int4_row_dequantize(*args, group, buf16, mma, other).cpu(), got16)  # the other way
        want = qr.int_matmul(x[:, :k], qweight, zeros, scales, group, 4)
        got = tk.dispatch.int4_row_matmul_dequantized(x[:, :k].to(tk.device), *args, group, mma_layout=mma,
                                                      options=options)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fma", [True, False])
def test_int4_row_gemm_matches_the_reference(tk, fma):
    """The many-row GEMM (``int4_row_gemm``): the row layout dequantized tile by tile in registers, each
    value built by the bit pattern and one FMA or by conversion, into the tensor cores; partial row and
    output tiles (70 rows, 96 and 80 outputs), K tiles of one group and of half of one, bf16 and fp16 x,
    split-K (2, and 3, which does not divide the K tiles) and the transposed (output-major) tile."""
    for k, n, group, rows, dtype in ((256, 96, 32, 70, torch.bfloat16), (256, 80, 128, 33, torch.float16),
                                     (128, 64, 64, 17, torch.bfloat16)):
        qweight, zeros, scales = random_packed(k, n, 4, group, seed=k + rows)
        packed = tk.int4_row.int4_row_pack(qweight.to(tk.device))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        bias = torch.randn(n).to(dtype)
        want = qr.int_matmul(x.float(), qweight, zeros, scales, group, 4, bias.float())
        args = [t.to(tk.device) for t in (x, packed, zeros, scales)]
        for cfg in (dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, FMA=fma),
                    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, SPLIT_K=2, num_warps=4, FMA=fma),
                    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, SPLIT_K=3, SWAP=True, num_warps=4, FMA=fma)):
            got = tk.int4_row.int4_row_gemm(*args, group, bias.to(tk.device), config=cfg)
            assert got.dtype == dtype and got.shape == (rows, n)
            # 16-bit weights and output; the interpreter's casts to them truncate instead of rounding (1.04% was
            # seen there on one run, against about 0.4% compiled)
            tol = 0.01 if tk.device == "cuda" else 0.02
            assert (got.float().cpu() - want).abs().max() <= tol * want.abs().max()
    with pytest.raises(ValueError, match="group_size=40"):
        tk.int4_row.int4_row_gemm(*args, 40)


def test_int4_many_row_tiles_follow_the_measured_table_and_rule(monkeypatch):
    """``int4_gemm_tiles``: Llama-3-8B's shapes take the H200 sweep's tiles, None (dequantize + cuBLAS)
    where that measured faster; other shapes the rule (output-major 64 x 64 tiles up to 64 rows, split-K
    until a layer has about two programs an SM, never more K splits than K tiles allow). And
    ``int4_linear`` routes by rows: 17-256 to ``int4_row_gemm`` unless the tiles say None, more to
    dequantize + cuBLAS."""
    from kvloom.kernels.quant import dispatch, int4_row

    assert int4_row.int4_gemm_tiles(256, 6144, 4096) is None and int4_row.int4_gemm_tiles(129, 4096, 4096) is None
    t = int4_row.int4_gemm_tiles(256, 28672, 4096)
    assert (t["BLOCK_M"], t["BLOCK_N"], t["SPLIT_K"], t["SWAP"]) == (128, 128, 1, False)
    assert int4_row.int4_gemm_tiles(17, 4096, 14336)["SPLIT_K"] == 4 and int4_row.int4_gemm_tiles(17, 4096, 14336)["SWAP"]
    t = int4_row.int4_gemm_tiles(40, 3584, 3584)  # Qwen2-7B's o_proj: not in the table
    assert t["SWAP"] and t["BLOCK_N"] == 64 and t["SPLIT_K"] == 4  # 56 programs
    assert int4_row.int4_gemm_tiles(40, 37888, 3584)["SPLIT_K"] == 1  # 592 programs already
    assert int4_row.int4_gemm_tiles(100, 1152, 256)["SPLIT_K"] == 1  # four K tiles: a split would get fewer
    assert int4_row.int4_gemm_tiles(200, 3584, 3584) is None and int4_row.int4_gemm_tiles(200, 3584, 18944) is not None
    # a benchmark's own table (kernel_options, JSON: "NxK" keys) replaces the measured one
    from kvloom.kernels.options import KernelOptions

    mine = KernelOptions.from_mapping({"int4_gemm_tiles": {"6144x4096": [[300, dict(int4_row.INT4_GEMM_TILE)]]}})
    assert int4_row.int4_gemm_tiles(256, 6144, 4096, mine) == int4_row.INT4_GEMM_TILE
    assert int4_row.int4_gemm_tiles(40, 3584, 3584, mine) == int4_row.int4_gemm_tiles(40, 3584, 3584)
    calls = []
    monkeypatch.setattr(dispatch, "int4_row_gemm", lambda *a, **k: calls.append("gemm"))
    monkeypatch.setattr(dispatch, "int4_row_matmul_dequantized", lambda *a, **k: calls.append("dequantize"))
    monkeypatch.setattr(dispatch, "int4_mma_gemm", lambda *a, **k: calls.append("mma"))
    packed = torch.zeros(6144, 512, dtype=torch.int32)
    for rows in (16, 17, 128, 129, 256, 257):
        dispatch.int4_linear(torch.zeros(rows, 4096, dtype=torch.bfloat16), packed, None, None, 128)
    assert calls == ["mma", "gemm", "gemm", "dequantize", "dequantize", "dequantize"]


def test_int4_row_gemm_compiles_to_hopper_tensor_cores():
    """Compiled for an H100/H200 (sm90) on this machine, GPU or not, every tile the engine gives the many-row
    4-bit GEMM issues wgmma, not the older mma.sync."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_INT4_GEMM_SM90], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    found = run.stdout.strip().splitlines()[-1].split()
    assert found and set(found) == {"wgmma"}, found


_COMPILE_INT4_GEMM_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvloom.kernels.quant import int4_row

fn = int4_row._int4_row_gemm_kernel
names = list(fn.arg_names)
types = dict(x_ptr="*bf16", qw_ptr="*i32", z_ptr="*u8", s_ptr="*fp16", out_ptr="*bf16", M="i32", N="i32", K="i32",
             stride_xm="i32", stride_qn="i32", stride_om="i32", NIB_MASK="i32")
engine_tiles = [int4_row.INT4_GEMM_TILE, int4_row.INT4_GEMM_TILE_FEW] + [
    t for b in int4_row.INT4_GEMM_TILES.values() for _, t in b if t]
tiles = {repr(sorted(t.items())): t for t in engine_tiles}
found = []
for tile in tiles.values():
    tile = dict(int4_row.INT4_GEMM_TILE, **tile)
    opts = dict(num_warps=tile.pop("num_warps"), num_stages=tile.pop("num_stages"))
    const = dict(tile, GROUP=128, FMA=True, F32_DOT=False)
    signature = {n: "constexpr" if n in const else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    found.append("wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none")
print(" ".join(found))
"""


def test_int4_row_pack_places_each_input_where_the_kernel_reads_it():
    """Nibble ``j`` of word ``w`` of an output row holds input ``(w // 4) * 32 + 4 * j + w % 4``."""
    from kvloom.kernels.quant.int4_row import int4_row_pack

    k, n = 64, 3
    q = (torch.arange(k * n).reshape(k, n) * 7) % 16
    packed = int4_row_pack(qr.pack_int32(q, 4, 0))
    for row in range(n):
        for w in range(k // 8):
            for j in range(8):
                assert (int(packed[row, w]) >> (4 * j)) & 15 == int(q[(w // 4) * 32 + 4 * j + w % 4, row])


@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_gemv_without_tensor_cores_matches_the_dequantized_product(tk, rows, combine):
    """With and without split-K, the splits combined by the last to arrive (``split_combine``: the same bits
    every time, the counters left zero) or atomically added."""
    from kvloom.kernels.options import KernelOptions

    options = KernelOptions(split_combine=combine)
    x, wq, scale, bias, want = fp8_layer(rows, seed=4)
    dev = tk.device
    args = (x.to(dev), wq.to(dev), scale.to(dev), bias.to(dev))
    for cfg in (dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, num_warps=4), dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, num_warps=4)):
        got = tk.fp8_weight_only.fp8_gemv(*args, config=cfg, options=options)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
        if combine and cfg["SPLIT_K"] > 1:
            from kvloom.kernels import arrivals

            assert torch.equal(tk.fp8_weight_only.fp8_gemv(*args, config=cfg, options=options), got)
            assert int(arrivals._COUNTERS[args[0].device].abs().sum()) == 0


@pytest.mark.parametrize("x_tile", [False, True])
def test_fp8_gemv_with_silu_and_mul_in_its_epilogue(tk, x_tile):
    """One row of a merged [gate; up] FP8 weight with SiLU-and-mul fused (the MLP's decode step), reading x
    either way (``fp8_silu_mul_x_tile``): the same as ``silu_and_mul`` of the GEMV's output; the tiles halve
    so a program covers the same rows."""
    from kvloom.kernels import reference
    from kvloom.kernels.options import KernelOptions
    from kvloom.kernels.quant.fp8_weight_only import fp8_silu_mul_tiles

    options = KernelOptions(fp8_silu_mul_x_tile=x_tile)
    assert fp8_silu_mul_tiles(40, 64, options)["X_TILE"] is x_tile
    x, wq, scale, _, _ = fp8_layer(1, seed=8)  # 80 rows: gate and up of 40, a partial tile
    want = reference.silu_and_mul(x @ (wq.float() * scale).t())
    dev = tk.device
    got = tk.fp8_weight_only.fp8_gemv(x.to(dev), wq.to(dev), scale.to(dev), silu_mul=True, options=options)
    assert got.shape == (1, 40)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
    assert fp8_silu_mul_tiles(14336, 4096)["BLOCK_N"] * 2 == 8 and fp8_silu_mul_tiles(14336, 4096)["SPLIT_K"] == 1
    with pytest.raises(ValueError, match="one row"):
        tk.fp8_weight_only.fp8_gemv(torch.cat([x, x]).to(dev), wq.to(dev), scale.to(dev), silu_mul=True)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_row_gemv_with_silu_and_mul_in_its_epilogue(tk, group):
    """One row of a merged [gate; up] 4-bit weight on the row layout with SiLU-and-mul fused: the same as
    ``silu_and_mul`` of the reference product (gate and up each 40 outputs: a partial tile)."""
    from kvloom.kernels import reference

    k, n = 256, 80
    qweight, zeros, scales = random_packed(k, n, 4, group, seed=13)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(14))
    want = reference.silu_and_mul(qr.int_matmul(x, qweight, zeros, scales, group, 4))
    dev = tk.device
    packed = tk.int4_row.int4_row_pack(qweight.to(dev))
    got = tk.int4_row.int4_row_gemv(x.to(dev), packed, zeros.to(dev), scales.to(dev), group, silu_mul=True,
                                 config=dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, num_warps=4))
    assert got.shape == (1, 40)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


def test_fp8_one_row_fixed_tiles_match_the_dequantized_product(tk):
    """Every fixed one-row tile shape (``fp8_row_tiles``, one per Llama-3-8B projection) on ``fp8_layer``'s
    ragged shape (K below their K tiles, N no multiple of their N tile: the masks); beyond, the autotuner."""
    from kvloom.kernels.quant.fp8_weight_only import FP8_ROW_TILES, fp8_row_tiles

    assert [fp8_row_tiles(n, k) for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096))] == \
        [tiles for _, tiles in FP8_ROW_TILES]
    assert fp8_row_tiles(128256, 4096) is None
    x, wq, scale, bias, want = fp8_layer(1, seed=6)
    for _, tiles in FP8_ROW_TILES:
        for x_tile in (False, True):  # x through shared memory, or read in the weights' layout
            got = tk.fp8_weight_only.fp8_gemv(x.to(tk.device), wq.to(tk.device), scale.to(tk.device), bias.to(tk.device),
                                    config=dict(tiles, X_TILE=x_tile))
            torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_then_dense_matmul_is_the_reference_product(tk, bits):
    """The big-batch path: the packed weight dequantized into a scratch buffer exactly as the reference
    does, then a dense matmul; a second, smaller layer reuses the buffer."""
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(5))
    for k, n, group in ((256, 96, 32), (128, 64, 64)):
        qweight, zeros, scales = random_packed(k, n, bits, group, seed=k)
        dense = qr.int_matmul(torch.eye(k), qweight, zeros, scales, group, bits)  # the dequantized [K, N]
        buf = torch.empty(k * n, device=tk.device)
        args = [t.to(tk.device) for t in (qweight, zeros, scales)]
        torch.testing.assert_close(tk.int_kpacked.int_dequantize(*args, group, bits, buf).cpu(), dense, atol=0, rtol=0)
        want = qr.int_matmul(x[:, :k], qweight, zeros, scales, group, bits)
        got = tk.int_kpacked.int_matmul_dequantized(x[:, :k].to(tk.device), *args, group, bits)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@requires_cuda
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_every_int4_path_on_the_gpu_at_llama_shapes(rows):
    """What ``int_matmul`` dispatches to by row count (GEMV, tensor-core kernel, dequantize + cuBLAS), each
    autotuned at a real shape, against the float32 reference."""
    from kvloom.kernels.quant import dispatch, int_kpacked, tinygemm

    qweight, zeros, scales = random_packed(4096, 6144, 4, 128, seed=7)
    x = torch.randn(rows, 4096).to(torch.bfloat16)
    want = qr.int_matmul(x.float(), qweight, zeros, scales, 128, 4)
    args = [t.cuda() for t in (x, qweight, zeros, scales)]
    for path in (int_kpacked.int_matmul, int_kpacked.int_matmul_dequantized):
        torch.testing.assert_close(path(*args, 128, 4).float().cpu(), want, atol=0.05, rtol=0.02)
    # PyTorch's int4 GEMM on the second layout (bf16 scales and zeros: a coarser tolerance)
    tiny = tinygemm.tinygemm_pack(*args[1:], 128)
    assert tiny is not None
    got = tinygemm.tinygemm_linear(args[0], *tiny, 128).float().cpu()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    # and the dispatcher, whichever path it picks for this shape
    got = dispatch.int_linear(*args, 128, 4, tinygemm=tiny).float().cpu()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@requires_cuda
@pytest.mark.parametrize("rows", [1, 2])
def test_int4_row_gemv_on_the_gpu_at_llama_shapes(rows):
    """qkv_proj's shape in bf16: the row GEMV's default tile, and ``int4_linear`` at 1-200 rows (each of its
    paths), against the float32 reference."""
    from kvloom.kernels.quant import dispatch, int4_row, tinygemm

    qweight, zeros, scales = random_packed(4096, 6144, 4, 128, seed=13)
    x = torch.randn(rows, 4096).to(torch.bfloat16)
    want = qr.int_matmul(x.float(), qweight, zeros, scales, 128, 4)
    packed = int4_row.int4_row_pack(qweight.cuda())
    got = int4_row.int4_row_gemv(x.cuda(), packed, zeros.cuda(), scales.cuda(), 128).float().cpu()
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    # through the dispatcher (with tinygemm's copy, as the engine holds it), at this and other row counts
    tiny = tinygemm.tinygemm_pack(qweight.cuda(), zeros.cuda(), scales.cuda(), 128)
    for r in (rows, 4, 9, 63, 64, 200):
        xr = torch.randn(r, 4096).to(torch.bfloat16)
        want = qr.int_matmul(xr.float(), qweight, zeros, scales, 128, 4)
        got = dispatch.int4_linear(xr.cuda(), packed, zeros.cuda(), scales.cuda(), 128, tinygemm=tiny).float().cpu()
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), r


@requires_cuda
@pytest.mark.parametrize("rows,n", [(1, 6144), (1, 4096), (8, 6144)])
def test_fp8_gemv_on_the_gpu_at_llama_shapes(rows, n):
    """qkv_proj and o_proj: at one row the fixed tiles, at eight the autotuned ones."""
    from kvloom.kernels.quant import fp8_weight_only

    w = torch.randn(n, 4096) * 0.02
    scale = qr.fp8_scale_per_row(w)
    wq = qr.fp8_quantize(w, scale)
    x = torch.randn(rows, 4096).to(torch.bfloat16)
    want = x.float() @ (wq.float() * scale).t()
    got = fp8_weight_only.fp8_gemv(x.cuda(), wq.cuda(), scale.cuda())
    torch.testing.assert_close(got.float().cpu(), want, atol=0.02, rtol=0.02)


@requires_cuda
def test_silu_and_mul_fused_into_the_one_row_gemvs_on_the_gpu_at_llama_shapes():
    """Llama-3-8B's gate_up_proj (2 x 14336 x 4096) in bf16, FP8 and 4-bit: the fused GEMV against the
    GEMV followed by the SiLU-and-mul kernel (the same bf16 roundings; the K sums may be ordered apart)."""
    from kvloom.kernels import triton_fused
    from kvloom.kernels.quant import fp8_weight_only, int4_row

    gen = torch.Generator().manual_seed(21)
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16).cuda()
    w = torch.randn(2 * 14336, 4096, generator=gen) * 0.02
    scale = qr.fp8_scale_per_row(w)
    wq, scale = qr.fp8_quantize(w, scale).cuda(), scale.cuda()
    want = triton_fused.silu_and_mul(fp8_weight_only.fp8_gemv(x, wq, scale))
    got = fp8_weight_only.fp8_gemv(x, wq, scale, silu_mul=True)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-2)
    qweight, zeros, scales = random_packed(4096, 2 * 14336, 4, 128, seed=22)
    packed = int4_row.int4_row_pack(qweight.cuda())
    zeros, scales = zeros.cuda(), scales.cuda()
    tiles = int4_row.int4_row_tiles(2 * 14336, 4096)
    want = triton_fused.silu_and_mul(int4_row.int4_row_gemv(x, packed, zeros, scales, 128, config=tiles))
    got = int4_row.int4_row_gemv(x, packed, zeros, scales, 128, config=tiles, silu_mul=True)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("slot", [13, -1])
def test_fp8_qkv_gemv_with_rotary_and_cache_write_is_the_unfused_kernels(tk, cache_dtype, with_bias, slot):
    """One row of an FP8 qkv projection (4 q heads, 2 kv heads of 32) with rotary and the KV-cache write in
    its epilogue (``fp8_qkv_rope_gemv``) gives, byte for byte, what the GEMV, the bias add and
    ``rotary_and_write_kv_cache`` give: q and k rotated in the output, k and v in the cache at the slot
    (none at a padding slot), with an fp8 cache's scales."""
    from tests.kernels.test_triton_kernels import cos_sin_cache

    hq, hkv, d, k_in, block_size = 4, 2, 32, 96, 8
    n = (hq + 2 * hkv) * d
    gen = torch.Generator().manual_seed(41)
    w = torch.randn(n, k_in, generator=gen) * 0.05
    scale = qr.fp8_scale_per_row(w)
    wq = qr.fp8_quantize(w, scale)
    x = torch.randn(1, k_in, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    positions = torch.tensor([37])
    slots = torch.tensor([slot], dtype=torch.int64)
    table = cos_sin_cache(64, d)
    k_cache = (torch.randn(4, block_size, hkv, d, generator=gen) * 0.1).to(cache_dtype)
    v_cache = (torch.randn(4, block_size, hkv, d, generator=gen) * 0.1).to(cache_dtype)
    scales = (0.5, 0.25) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    dev = tk.device
    xd, wd, sd, pd, td, sl = (t.to(dev) for t in (x, wq, scale, positions, table, slots))
    bd = bias.to(dev) if bias is not None else None
    cfg = dict(BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, num_warps=4)
    qkv = tk.fp8_weight_only.fp8_gemv(xd, wd, sd, bd, config=dict(cfg, BLOCK_N=16))
    q, kk, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    want_k, want_v = k_cache.clone().to(dev), v_cache.clone().to(dev)
    q = tk.attention.rotary_and_write_kv_cache(pd, q.reshape(1, hq, d), kk.reshape(1, hkv, d).clone(),
                                               v.reshape(1, hkv, d), td, want_k, want_v, sl, *scales)
    got_k, got_v = k_cache.clone().to(dev), v_cache.clone().to(dev)
    got = tk.fp8_weight_only.fp8_qkv_rope_gemv(xd, wd, sd, bd, pd, td, got_k, got_v, sl, hq, hkv, *scales, config=cfg)
    assert got.shape == (1, n)

    def same(a, b):
        # The interpreter's casts to bfloat16 truncate where torch's ``out + bias`` rounds to nearest:
        # byte for byte on a GPU or without bias; within a step of the cache's dtype otherwise.
        a, b = a.cpu(), b.cpu()
        if dev == "cuda" or bias is None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=0.13 if a.element_size() == 1 else 2**-6)

    same(got[:, :hq * d], q.reshape(1, -1))  # q rotated
    same(got[:, -hkv * d:], v.reshape(1, -1))  # v as projected
    same(got_k, want_k)
    same(got_v, want_v)
    if slot < 0:
        assert torch.equal(got_k.cpu().view(torch.uint8), k_cache.view(torch.uint8))
    else:
        assert not torch.equal(got_k.cpu().view(torch.uint8), k_cache.view(torch.uint8))
    with pytest.raises(ValueError, match="qkv weight"):
        tk.fp8_weight_only.fp8_qkv_rope_gemv(xd, wd[:-d], sd[:-d], None, pd, td, got_k, got_v, sl, hq, hkv, config=cfg)


_COMPILE_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvloom.kernels.quant import fp8_weight_only

types = dict(
    x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16", M="i32", N="i32", K="i32", M_BUCKET="i32",
    stride_xm="i32", stride_wn="i32", stride_om="i32", bias_ptr="*bf16", pos_ptr="*i64", cos_sin_ptr="*fp32",
    k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_ptr="*i64", stride_cs="i32", stride_cb="i32", stride_cslot="i32",
    stride_ch="i32", block_size="i32", num_q_heads="i32", num_kv_heads="i32", k_inv_scale="fp32", v_inv_scale="fp32",
    part_ptr="*fp32", arrivals_ptr="*i32")
fn = fp8_weight_only._fp8_gemv_kernel
names = list(fn.arg_names)
done = {}
for variant in sys.argv[1:]:
    rope = variant.startswith("rope")
    split = variant == "split_combine"
    const = dict(BLOCK_N=4 if rope else 8, BLOCK_K=512, SPLIT_K=2 if split else 1, PDL=True,
                 SILU_MUL=variant.startswith("silu"), X_TILE=variant.startswith("silu"), ROPE=rope, HEAD_DIM=128,
                 KV_FP8=variant == "rope_fp8_cache", SPLIT_COMBINE=split)
    ts = dict(types)
    if variant == "rope_fp8_cache":
        const["bias_ptr"] = None
        ts["k_cache_ptr"] = ts["v_cache_ptr"] = "*fp8e4nv"
    signature = {n: "constexpr" if n in const else ts[n] for n in names}
    # pointers 16-byte aligned, as a launch specializes them (without it nothing is vectorized or pipelined)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2, launch_pdl=True))
    done[variant] = ".target sm_90" in k.asm["ptx"] and len(k.asm["cubin"]) > 0 and (
        not split or "atom.global.gpu.acq_rel.add" in k.asm["ptx"])
print(json.dumps(done))
"""


def test_fp8_gemv_variants_compile_for_sm90():
    """The FP8 GEMV's variants (plain; SiLU-and-mul reading x in the weights' layout; qkv with rotary and
    the cache write, with a bias, and with an fp8 cache and no bias; split-K combined by its last split)
    compile for an H100/H200 (sm90, PDL) on this machine, GPU or not. The interpreter runs them as Python
    and does not catch what only the compiler rejects (a value whose type changes inside a runtime branch,
    say). In a fresh interpreter: this module's kernels are interpreted."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    variants = ["plain", "silu_mul_x_tile", "rope_bias", "rope_fp8_cache", "split_combine"]
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90, *variants], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {v: True for v in variants}
