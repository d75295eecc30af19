"""Tile sweep of the Gluon W4A16 GEMM (``quant.gluon_int4.int4_mma_gemm``: the weight dequantized into wgmma's register
operand, from the MMA row layout) at a model's projection shapes, group 128, on an sm90 GPU, against cuBLAS on the
bf16 weight and against what the engine runs without it (``quant.dispatch.int4_linear``: the row GEMV or tinygemm at
1-4 rows, the Triton tensor-core GEMMs, dequantize + cuBLAS). Timed like ``quant_kernels_gpu.py``: a CUDA graph of
many calls with the weights rotated past L2. Writes one JSON line per projection and row count: the times, each
config's ``(us, largest error against the float32 product over the largest output)`` under ``swap``, and the
engine rule's tile (``int4_mma_tiles``) under ``rule``.

    python3 benchmarks/int4_mma_gemm_sweep_gpu.py --shape llama-3-8b --output results.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_kernels_gpu import copies, projection_shapes, timed  # noqa: E402
from shapes import SHAPES  # noqa: E402


def tiles(rows: int) -> list[dict]:
    """The configs timed at ``rows`` rows: BLOCK_M the rows' bucket (8 to 256), a few N/K tiles and K splits."""
    bm = min(max(rows, 8), 256)
    if rows <= 16:  # deeper rings too: at one row the kernel streams the weight at 1.5-2.2 TB/s (H200, f413cad)
        return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, num_warps=nw, SPLIT_K=split)
                for bn, nw in ((64, 4), (128, 8)) for bk, st in ((128, 4), (128, 6), (128, 8), (256, 3), (256, 4))
                for split in (1, 2, 4, 8)]
    out = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, num_warps=nw, SPLIT_K=split)
           for bn, nw, bk, st in ((128, 8, 64, 3), (128, 8, 128, 3), (64, 4, 128, 4 if rows < 256 else 2),
                                  (128, 8, 64, 4))
           for split in (1, 2, 4)]
    if rows == 256:
        out += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, STAGES=3, num_warps=8, SPLIT_K=1) for bk in (64, 128)]
        out += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, SPLIT_K=1, maxnreg=128)]
    if rows == 128:
        out += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, SPLIT_K=s, maxnreg=128) for s in (1, 2)]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--projs", default="gate_up,down,qkv,o")
    p.add_argument("--output", default="int4_mma_gemm_sweep.jsonl", help="One JSON line per projection and row count.")
    args = p.parse_args(argv)
    from kvloom.kernels.quant import gluon_int4 as gq
    from kvloom.kernels import quant_reference as qr
    from kvloom.kernels.quant import dispatch, int4_row, tinygemm

    dev, g = "cuda", 128
    for name, (k, n) in projection_shapes(SHAPES[args.shape]).items():
        if name not in args.projs.split(","):
            continue
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randint(0, 16, (k, n), device=dev, generator=gen)
        zeros = torch.randint(4, 12, (k // g, n), device=dev, generator=gen).to(torch.uint8)
        scales = (torch.rand(k // g, n, device=dev, generator=gen) * 0.004 + 0.002).half()
        qweight = qr.pack_int32(q, 4, 0)
        packed, mpacked = int4_row.int4_row_pack(qweight), gq.int4_mma_pack(q)
        tiny = tinygemm.tinygemm_pack(qweight, zeros, scales, g)
        dense = (q.float() - zeros.float().repeat_interleave(g, 0)) * scales.float().repeat_interleave(g, 0)
        w = dense.t().contiguous().to(torch.bfloat16)
        nc = copies(packed.numel() * 4, True)
        clone = lambda ts: None if ts is None else tuple(t.clone() for t in ts)  # noqa: E731
        row_w = [(packed, zeros, scales, tiny)] + [(*clone((packed, zeros, scales)), clone(tiny)) for _ in range(nc - 1)]
        mma_w = [(mpacked, zeros, scales)] + [clone((mpacked, zeros, scales)) for _ in range(nc - 1)]
        bf16_w = [w] + [w.clone() for _ in range(copies(w.numel() * 2, True) - 1)]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
            want = x.float() @ dense
            err = lambda got: float((got.float() - want).abs().max() / want.abs().max())  # noqa: E731
            r = {"proj": name, "rows": rows, "cublas": timed(lambda t: F.linear(x, t), bf16_w, True),
                 "int4_linear": timed(lambda t: dispatch.int4_linear(x, *t[:3], g, tinygemm=t[3]), row_w, True),
                 "int4_err": err(dispatch.int4_linear(x, packed, zeros, scales, g, tinygemm=tiny)), "swap": {}}
            for c in tiles(rows):
                if not gq.int4_mma_gemm_ok(n, k, g, x.dtype, c):
                    continue
                try:
                    got = gq.int4_mma_gemm(x, mpacked, zeros, scales, g, config=c)
                    us = timed(lambda t: gq.int4_mma_gemm(x, *t, g, config=c), mma_w, True)
                    r["swap"][json.dumps(c)] = (round(us, 2), round(err(got), 5))
                except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit: record it
                    r["swap"][json.dumps(c)] = f"{type(e).__name__}: {e}"[:160]
            rule = gq.int4_mma_tiles(rows, n, k)
            r["rule"] = (rule, round(timed(lambda t: gq.int4_mma_gemm(x, *t, g, config=rule), mma_w, True), 2))
            with open(args.output, "a") as f:
                f.write(json.dumps(r) + "\n")
            best = min(((v, c) for c, v in r["swap"].items() if isinstance(v, tuple)), default=None)
            print(json.dumps({"proj": name, "rows": rows, "cublas_us": round(r["cublas"], 2),
                              "int4_linear_us": round(r["int4_linear"], 2), "rule_us": r["rule"][1],
                              "best": best}), flush=True)
        del row_w, mma_w, bf16_w


if __name__ == "__main__":
    main()
