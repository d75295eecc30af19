"""The Gluon W4A16 GEMM (kvloom/kernels/gluon_quant.py) over a grid of tiles at 1-256 rows of Llama-3-8B's
projections, against cuBLAS bf16 and the engine's int4_linear (row GEMV, tinygemm, Triton GEMMs), on an sm90 GPU.
Each config's largest error against the float32 product of the dequantized weight is recorded beside its time.

    python3 benchmarks/int4_mma_gemm_sweep_gpu.py --output results.jsonl
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_kernels_gpu import copies, timed  # noqa: E402

from kvloom.kernels import gluon_quant as gq  # noqa: E402
from kvloom.kernels import quant_reference as qr  # noqa: E402
from kvloom.kernels import triton_quant as tq  # noqa: E402


def swap_gemm(x, packed, zeros, scales, group, cfg):
    return gq.int4_mma_gemm(x, packed, zeros, scales, group, config=cfg)


def tiles(rows):
    bm = min(max(rows, 8), 256)
    out = []
    if rows <= 16:
        return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, num_warps=nw, SPLIT_K=split)
                for bn, nw in ((64, 4), (128, 8)) for bk, st in ((128, 4), (256, 3)) for split in (1, 2, 4, 8)]
    for bn, nw, bk, st in ((128, 8, 64, 3), (128, 8, 128, 3), (64, 4, 128, 4 if rows < 256 else 2), (128, 8, 64, 4)):
        for split in (1, 2, 4):
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, num_warps=nw, SPLIT_K=split))
    if rows == 256:
        out += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, STAGES=3, num_warps=8, SPLIT_K=1) for bk in (64, 128)]
        out += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, SPLIT_K=1, maxnreg=128)]
    if rows == 128:
        out += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=3, num_warps=8, SPLIT_K=s, maxnreg=128) for s in (1, 2)]
    return out


import argparse  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--output", default="int4_mma_gemm_sweep.jsonl", help="One JSON line per projection and row count.")
args = p.parse_args()
dev, grp = "cuda", 128
for name, n, k in (("gate_up", 28672, 4096), ("down", 4096, 14336), ("qkv", 6144, 4096), ("o", 4096, 4096)):
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randint(0, 16, (k, n), device=dev, generator=gen)
    zeros = torch.randint(4, 12, (k // grp, n), device=dev, generator=gen).to(torch.uint8)
    scales = (torch.rand(k // grp, n, device=dev, generator=gen) * 0.004 + 0.002).half()
    packed = tq.int4_row_pack(qr.pack_int32(q, 4, 0))
    mpacked = gq.int4_mma_pack(q)
    dense = (q.float() - zeros.float().repeat_interleave(grp, 0)) * scales.float().repeat_interleave(grp, 0)
    w = dense.t().contiguous().to(torch.bfloat16)
    nc = copies(packed.numel() * 4, True)
    ws = [(packed, zeros, scales)] + [(packed.clone(), zeros.clone(), scales.clone()) for _ in range(nc - 1)]
    ms = [(mpacked, zeros, scales)] + [(mpacked.clone(), zeros.clone(), scales.clone()) for _ in range(nc - 1)]
    wb = [w] + [w.clone() for _ in range(copies(w.numel() * 2, True) - 1)]
    tiny = tq.tinygemm_pack(qr.pack_int32(q, 4, 0), zeros, scales, grp)
    ws = [(p, z, s, tiny if i == 0 or tiny is None else tuple(t.clone() for t in tiny)) for i, (p, z, s) in enumerate(ws)]
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
        want = x.float() @ dense
        ref = tq.int4_linear(x, packed, zeros, scales, grp, tinygemm=tiny)
        r = {"proj": name, "rows": rows, "cublas": timed(lambda t: F.linear(x, t), wb, True),
             "int4_linear": timed(lambda t: tq.int4_linear(x, *t[:3], grp, tinygemm=t[3]), ws, True),
             "int4_err": float((ref.float() - want).abs().max() / want.abs().max()), "swap": {}}
        for c in tiles(rows):
            if (k // c["BLOCK_K"]) % c["SPLIT_K"]:
                continue
            try:
                got = swap_gemm(x, mpacked, zeros, scales, grp, c).float()
                err = float((got - want).abs().max() / want.abs().max())
                us = timed(lambda t: swap_gemm(x, *t, grp, c), ms, True)
                r["swap"][json.dumps(c)] = (round(us, 2), round(err, 5))
            except Exception as e:  # noqa: BLE001
                r["swap"][json.dumps(c)] = str(e)[:160]
        try:
            rule = gq.int4_mma_tiles(rows, n, k)
            r["rule"] = (rule, round(timed(lambda t: swap_gemm(x, *t, grp, rule), ms, True), 2))
        except Exception as e:  # noqa: BLE001
            r["rule"] = str(e)[:160]
        ok = [(v, c) for c, v in r["swap"].items() if isinstance(v, tuple)]
        best = min(ok, default=None)
        if best is None:
            print("errors:", list(r["swap"].values())[:2], flush=True)
        with open(args.output, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(name, rows, "cublas %.1f int4 %.1f (err %.4f)" % (r["cublas"], r["int4_linear"], r["int4_err"]),
              "rule", r["rule"][1] if isinstance(r["rule"], tuple) else r["rule"], "swap", best[0] if best else None, best[1].replace('"', "").replace("BLOCK_", "") if best else "", flush=True)
    del ws, ms, wb
