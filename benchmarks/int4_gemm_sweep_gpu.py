"""Tile sweep of kvloom's many-row 4-bit GEMM (``quant.int4_row.int4_row_gemm``: the row layout dequantized
tile by tile in registers into the tensor cores) against cuBLAS on the bf16 weight and against what the
engine ran before at 17 rows and more (dequantize into a scratch buffer, then cuBLAS), at a model's
projection shapes, group 128. Timed like ``quant_kernels_gpu.py``: a CUDA graph of many calls with the
weights rotated past L2. Prints one JSON line per projection and row count: cuBLAS's and the old path's
microseconds, and the five fastest tiles with bf16's time over theirs and their error against the float32
product.

    python benchmarks/int4_gemm_sweep_gpu.py --shape llama-3-8b --rows 32,64,128,256
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_kernels_gpu import copies, projection_shapes, timed  # noqa: E402
from shapes import SHAPES  # noqa: E402


def tile_grid() -> list[dict]:
    """W as the MMA's second operand (through shared memory) and, with SWAP, as its first (in registers;
    the rows are then the MMA's N), each with split-K 1, 2 and 4."""
    plain = ((64, 128, 128, 4), (64, 128, 64, 4), (128, 128, 64, 8), (128, 64, 128, 4), (128, 128, 64, 4),
             (128, 256, 64, 8), (128, 128, 128, 8), (256, 64, 64, 8), (256, 128, 64, 8), (256, 64, 128, 8))
    swap = ((32, 64, 128, 4), (32, 128, 128, 4), (64, 64, 128, 4), (64, 128, 128, 4), (128, 64, 128, 4),
            (128, 128, 64, 8), (256, 64, 64, 4), (256, 128, 64, 8))
    grid = []
    for sw, tiles in ((False, plain), (True, swap)):
        for (bm, bn, bk, w), sp in itertools.product(tiles, (1, 2, 4)):
            for st in (3, 4) if w == 8 else (3,):
                grid.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=sp, SWAP=sw, num_warps=w,
                                 num_stages=st))
    return grid


def fits(tile: dict, rows: int) -> bool:
    """Row tiles at most twice the rows' power of two (64 at least, wgmma's M when the rows are its M)."""
    return tile["BLOCK_M"] <= max(64, 2 * triton.next_power_of_2(rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="32,64,128,256", help="Row counts; every tile that fits is timed at each.")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--projs", default="qkv,o,gate_up,down")
    p.add_argument("--output", default=None)
    p.add_argument("--table", default=None, help="Write quant.int4_row.INT4_GEMM_TILES's value read off the sweep "
                                                 "(the best tile per shape and row count, None where dequantize + "
                                                 "cuBLAS is faster) to this file.")
    args = p.parse_args(argv)
    from kvloom.kernels import quant_reference as qr
    from kvloom.kernels.quant import dispatch, int4_row

    dev, g = "cuda", args.group
    grid = tile_grid()
    results = []
    for name, (k, n) in projection_shapes(SHAPES[args.shape]).items():
        if name not in args.projs.split(","):
            continue
        gen = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        q = torch.randint(0, 16, (k, n), device=dev, generator=gen)
        zeros = torch.randint(4, 12, (k // g, n), device=dev, generator=gen).to(torch.uint8)
        scales = (torch.rand(k // g, n, device=dev, generator=gen) * 0.004 + 0.002).half()
        packed = int4_row.int4_row_pack(qr.pack_int32(q, 4, 0))
        dense = ((q.float() - zeros.float().repeat_interleave(g, 0)) * scales.float().repeat_interleave(g, 0))
        nbytes = packed.numel() * 4
        bf16_w = [w] + [w.clone() for _ in range(copies(w.numel() * 2, True) - 1)]
        rows_w = [(packed, zeros, scales)] + [(packed.clone(), zeros.clone(), scales.clone())
                                              for _ in range(copies(nbytes, True) - 1)]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
            want = x.float() @ dense
            cublas = timed(lambda t: F.linear(x, t), bf16_w, True)
            deq = timed(lambda t: dispatch.int4_row_matmul_dequantized(x, *t, g), rows_w, True)
            timings = []
            for c in (c for c in grid if fits(c, rows)):
                try:
                    timings.append((timed(lambda t: int4_row.int4_row_gemm(x, *t, g, config=c), rows_w, True), c))
                except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit: skip it
                    print(json.dumps({"proj": name, "cfg": c, "error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
            timings.sort(key=lambda t: t[0])
            best = []
            for us, c in timings[:5]:
                got = int4_row.int4_row_gemm(x, packed, zeros, scales, g, config=c).float()
                best.append({"us": round(us, 2), "x_cublas": round(cublas / us, 3), "x_dequantize": round(deq / us, 3),
                             "cfg": c, "max_rel_err": float((got - want).abs().max() / want.abs().max())})
            r = {"proj": name, "n": n, "k": k, "rows": rows, "group": g, "cublas_bf16_us": round(cublas, 2),
                 "dequantize_cublas_us": round(deq, 2), "best": best,
                 "all": {json.dumps(c, sort_keys=True): round(us, 2) for us, c in timings}}
            print(json.dumps({k2: v for k2, v in r.items() if k2 != "all"}), flush=True)
            results.append(r)
        del bf16_w, rows_w
        torch.cuda.empty_cache()
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    if args.table:
        table = {}
        for r in results:
            b = r["best"][0] if r["best"] else None
            tile = b["cfg"] if b and b["us"] < r["dequantize_cublas_us"] else None
            table.setdefault((r["n"], r["k"]), []).append((r["rows"], tile))
        text = repr({key: tuple(v) for key, v in table.items()})
        Path(args.table).write_text(text)
        print("INT4_GEMM_TILES =", text, flush=True)


if __name__ == "__main__":
    main()
