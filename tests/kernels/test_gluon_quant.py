"""The Gluon W4A16 GEMM (``kvloom.kernels.quant.gluon_int4``): its MMA row layout here, its sm90 build on any machine
(the Triton wheel compiles for Hopper without a GPU), and its products natively on an sm90 GPU."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import quant_reference as qr
from kvloom.kernels.quant import gluon_int4 as gq

needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
                                     and gq.AVAILABLE), reason="needs an sm90 GPU (wgmma) and Gluon")


def test_mma_pack_puts_each_lanes_inputs_in_one_word():
    """Word ``2 q + c`` of a 64-input block holds inputs ``32 c + 16 n2 + 8 n1 + 2 q + n0`` at nibble
    ``n1 + 2 n2 + 4 n0`` (nibbles ``m`` and ``m + 4``: the two halves of one bf16x2 register); the unpacking inverts it, and the loader's repack of a K-packed qweight (a block of
    outputs at a time) gives the same words."""
    q = torch.randint(0, 16, (192, 40), generator=torch.Generator().manual_seed(0))
    words = gq.int4_mma_pack(q)
    assert words.shape == (40, 24) and words.dtype == torch.int32
    for n in (0, 17, 39):
        for blk in range(3):
            for lane in range(4):
                for c in range(2):
                    word = int(words[n, 8 * blk + 2 * lane + c]) & 0xFFFFFFFF
                    for nib in range(8):
                        n1, n2, n0 = nib & 1, (nib >> 1) & 1, nib >> 2
                        k = 64 * blk + 32 * c + 16 * n2 + 8 * n1 + 2 * lane + n0
                        assert (word >> (4 * nib)) & 15 == int(q[k, n])
    assert torch.equal(gq.int4_mma_unpack(words), q)
    assert torch.equal(gq.int4_mma_pack_qweight(qr.pack_int32(q, 4, 0), chunk=16), words)  # the load's path
    with pytest.raises(ValueError, match="multiple of 64"):
        gq.int4_mma_pack(q[:96])


@pytest.mark.parametrize("rows", [1, 8, 17, 64, 256, 1000])
def test_the_tile_rule_gives_tiles_the_kernel_takes(rows):
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (576, 1536)):
        tile = gq.int4_mma_tiles(rows, n, k)
        assert 8 <= tile["BLOCK_M"] <= 256 and tile["BLOCK_N"] == 16 * tile["num_warps"]
        assert (k // tile["BLOCK_K"]) % (2 * tile["SPLIT_K"]) == 0 and 128 % tile["BLOCK_K"] == 0
        if gq.AVAILABLE:
            assert gq.int4_mma_gemm_ok(n, k, 128, torch.bfloat16, tile)
    assert not gq.int4_mma_gemm_ok(4096, 4096, 32, torch.bfloat16, gq.int4_mma_tiles(16, 4096, 4096))


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvloom.kernels.quant import gluon_int4 as gq

cfg = json.loads(sys.argv[1])
fn = gq._w4a16_mma_kernel
names = list(fn.arg_names)
const = dict(GROUP=128, COMBINE=cfg["SPLIT_K"] > 1, PDL=True, **cfg)
out = "bf16"
types = dict(x_ptr="*bf16", qw_ptr="*i32", z_ptr="*u8", s_ptr="*fp16", out_ptr="*" + out, part_ptr="*fp32", arrivals_ptr="*i32", M="i32", N="i32", K="i32",
             stride_xm="i32", stride_qn="i32", stride_om="i32")
sig = {n: "constexpr" if n in const else types[n] for n in names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if sig[n].startswith("*") or n in ("K", "N", "stride_xm", "stride_qn", "stride_om")}
src = GluonASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"]))
print(json.dumps({"ttgir": k.asm["ttgir"], "ptx": k.asm["ptx"]}))
"""


def _compile_sm90(cfg: dict) -> dict:
    """The kernel compiled for sm90 in a fresh process (this one may hold Triton in interpreter mode, where
    Gluon does not import): its TTGIR and PTX."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cfg)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _gluon_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None and \
        importlib.util.find_spec("triton.experimental.gluon") is not None


@pytest.mark.skipif(not _gluon_importable(), reason="this Triton has no Gluon")
@pytest.mark.parametrize("cfg", [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, SPLIT_K=1),
                                 dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=128, STAGES=4, num_warps=4, SPLIT_K=2)])
def test_the_weight_goes_from_registers_into_wgmma(cfg):
    """Compiled for sm90: wgmma takes the dequantized weight as its register operand (a dot-operand tensor,
    not shared memory), the only shared buffers are x's and the words' rings, values are dequantized in pairs
    (packed bf16 subtractions and products), the kernel waits for its predecessor (PDL) and a split-K tile
    counts its arrivals with an acq_rel atomic (arrivals.py)."""
    k = _compile_sm90(cfg)
    ttgir, ptx = k["ttgir"], k["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "sub.rn.bf16x2" in ptx and "mul.rn.bf16x2" in ptx
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert ("atom.global.gpu.acq_rel.add" in ptx) == (cfg["SPLIT_K"] > 1)
    dots = [line for line in ttgir.splitlines() if "ttng.warp_group_dot " in line]
    assert dots and all("#ttg.dot_op<{opIdx = 0" in line for line in dots), dots
    assert ttgir.count("ttg.local_alloc") == 2
    assert "wgmma.wait_group.sync.aligned 1" in ptx  # one wgmma outstanding while the next tile dequantizes


def _problem(rows: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    x = torch.randn(rows, k, generator=gen).to(dtype)
    # the dequantize pass's values, (q - z) s rounded once to x's dtype
    deq = ((q.double() - zeros.double().repeat_interleave(group, 0)) * scales.double().repeat_interleave(group, 0))
    want = x.double() @ deq.to(dtype).double()
    dev = "cuda"
    return x.to(dev), gq.int4_mma_pack(q).to(dev), zeros.to(dev), scales.to(dev), want


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 8, 17, 130, 300])
def test_int4_mma_gemm_matches_the_dequantized_product(rows, dtype):
    n, k, group = 200, 512, 128  # n no multiple of the 64-output tiles: the masks
    x, packed, zeros, scales, want = _problem(rows, n, k, group, dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    configs = [None, dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=128, STAGES=4, num_warps=4, SPLIT_K=2),
               dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, SPLIT_K=1),
               dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, STAGES=3, num_warps=8, SPLIT_K=2),
               dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, SPLIT_K=1)]
    for cfg in configs:
        got = gq.int4_mma_gemm(x, packed, zeros, scales, group, bias, config=cfg)
        assert got.shape == (rows, n) and got.dtype == dtype
        err = ((got.double() - bias.double()).cpu() - want).abs().max() / want.abs().max()
        assert err < 1e-2, (cfg, float(err))


@needs_sm90
def test_int4_mma_gemm_groups_and_llama_shapes():
    """Groups of 64 (K tiles of 64) and a down_proj-shaped K split four ways."""
    for rows, n, k, group, cfg in ((24, 256, 1024, 64, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, STAGES=4, num_warps=4,
                                                             SPLIT_K=2)),
                                   (256, 512, 14336, 128, None)):
        x, packed, zeros, scales, want = _problem(rows, n, k, group, torch.bfloat16, seed=3)
        got = gq.int4_mma_gemm(x, packed, zeros, scales, group, config=cfg)
        err = (got.double().cpu() - want).abs().max() / want.abs().max()
        assert err < 1e-2, (rows, n, k, float(err))
    with pytest.raises(ValueError, match="does not take"):
        gq.int4_mma_gemm(x, packed, zeros, scales, 64, config=dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, STAGES=4,
                                                                   num_warps=4, SPLIT_K=1))


def test_int4_linear_routes_rows_on_the_mma_layout(monkeypatch):
    """On the MMA row layout: 1-4 rows on tinygemm where it is held, 1-256 rows otherwise on the Gluon GEMM with
    ``int4_mma_tiles``' tile, more on dequantize + cuBLAS from that layout; a shape the Gluon GEMM does not take
    on the row GEMV reading that layout (one row) or dequantize + cuBLAS. On the row layout nothing changes."""
    from kvloom.kernels.quant import dispatch

    calls = []
    monkeypatch.setattr(gq, "int4_mma_gemm_ok", lambda n, k, g, dtype, tile: k % 256 == 0)
    monkeypatch.setattr(gq, "int4_mma_gemm", lambda *a, config=None, **kw: calls.append(("gluon", config["BLOCK_M"])))
    for name in ("int4_row_gemv", "tinygemm_linear", "int4_mma_gemm", "int4_row_gemm", "int4_row_matmul_dequantized"):
        monkeypatch.setattr(dispatch, name, lambda *a, _n=name, **kw: calls.append((_n, kw.get("mma_layout", False))))
    x = lambda rows, k=4096: torch.zeros(rows, k, dtype=torch.bfloat16)  # noqa: E731
    packed, tiny = torch.zeros(28672, 512, dtype=torch.int32), (object(), object())
    for rows in (1, 2, 4, 5, 16, 17, 256, 257):
        dispatch.int4_linear(x(rows), packed, None, None, 128, mma_layout=True)
    assert calls == [("gluon", 8), ("gluon", 8), ("gluon", 8), ("gluon", 8), ("gluon", 16), ("gluon", 32),
                     ("gluon", 256), ("int4_row_matmul_dequantized", True)]
    calls.clear()
    small = torch.zeros(4096, 512, dtype=torch.int32)
    for rows in (1, 4, 5):
        dispatch.int4_linear(x(rows), small, None, None, 128, tinygemm=tiny, mma_layout=True)
    assert calls == [("tinygemm_linear", False), ("tinygemm_linear", False), ("gluon", 8)]
    calls.clear()
    odd = torch.zeros(4096, 520, dtype=torch.int32)  # K of 4160: not the Gluon GEMM's
    dispatch.int4_linear(x(20, 4160), odd, None, None, 64, mma_layout=True)
    dispatch.int4_linear(x(1, 4160), odd, None, None, 64, mma_layout=True)
    dispatch.int4_linear(x(20), packed, None, None, 128)  # the row layout
    dispatch.int4_linear(x(1), packed, None, None, 128)
    assert calls == [("int4_row_matmul_dequantized", True), ("int4_row_gemv", True), ("int4_row_gemm", False),
                     ("int4_row_gemv", False)]
