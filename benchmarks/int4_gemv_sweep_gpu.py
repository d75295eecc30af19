"""Tile sweep of kvloom's 4-bit decode kernels, ``--kernel row`` (``quant.int4_row.int4_row_gemv``: nibbles
turned into floats by bit patterns, one FMA each) or ``--kernel mma`` (``int4_mma_gemm``: bf16 from bit
patterns into the tensor cores, output-major), against cuBLAS on the bf16 weight, PyTorch's int4 GEMM
(tinygemm) and the K-packed tensor-core kernel (``int_matmul``), at a model's projection shapes, group 128. Timed like
``quant_kernels_gpu.py``: a CUDA graph of many calls with the weights rotated past L2. Prints one JSON
line per projection and row count: cuBLAS's and tinygemm's microseconds, and the five fastest tile
configs with bf16's time over theirs and their error against the float32 product.

    python benchmarks/int4_gemv_sweep_gpu.py --shape llama-3-8b
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_kernels_gpu import copies, projection_shapes, timed, tinygemm_pack  # noqa: E402
from shapes import SHAPES  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,2,4", help="Row counts; the sweep runs at the first, the others time "
                                                   "its five best configs.")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="A smaller grid (BLOCK_K 512 and 1024, BLOCK_N up to 64).")
    p.add_argument("--kernel", default="row", choices=["row", "mma"])
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    from kvloom.kernels import quant_reference as qr
    from kvloom.kernels.quant import dispatch, int4_row, int_kpacked

    rows_list = [int(r) for r in args.rows.split(",")]
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sp, num_warps=w, num_stages=st)
            for bn, bk, sp, w, st in itertools.product((16, 32, 64, 128), (256, 512, 1024), (1, 2, 4), (4, 8), (2, 3))
            if 2048 <= bn * bk <= 65536 and (not args.quick or (bk >= 512 and bn <= 64))]
    grid.append(dict(int4_row.INT4_ROW_TILE))
    grid.append(dict(int4_row.INT4_ROW_LONG_K))
    if args.kernel == "mma":
        grid = [dict(BLOCK_N=bn, SPLIT_K=sp, num_warps=w, num_stages=st)
                for bn, sp, w, st in itertools.product((32, 64, 128), (1, 2, 4), (2, 4, 8), (2, 3, 4))
                if bn // w >= 8] + [dict(int4_row.INT4_MMA_TILE)]
    run = int4_row.int4_row_gemv if args.kernel == "row" else int4_row.int4_mma_gemm
    dev, g = "cuda", args.group
    results = []
    for name, (k, n) in projection_shapes(SHAPES[args.shape]).items():
        gen = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        q = torch.randint(0, 16, (k, n), device=dev, generator=gen)
        zeros = torch.randint(4, 12, (k // g, n), device=dev, generator=gen).to(torch.uint8)
        scales = (torch.rand(k // g, n, device=dev, generator=gen) * 0.004 + 0.002).half()
        qweight = qr.pack_int32(q, 4, 0)
        packed = int4_row.int4_row_pack(qweight)  # both kernels read the row layout
        dense = ((q.float() - zeros.float().repeat_interleave(g, 0)) * scales.float().repeat_interleave(g, 0))  # [K, N]
        tiny = tinygemm_pack(q, zeros, scales)
        nbytes = packed.numel() * 4
        bf16_w = [w] + [w.clone() for _ in range(copies(w.numel() * 2, True) - 1)]
        rows_w = [(packed, zeros, scales)] + [(packed.clone(), zeros.clone(), scales.clone())
                                              for _ in range(copies(nbytes, True) - 1)]
        tiny_w = [tiny] + [(tiny[0].clone(), tiny[1].clone()) for _ in range(copies(nbytes, True) - 1)]
        ranked = None
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
            want = x.float() @ dense
            cublas = timed(lambda t: F.linear(x, t), bf16_w, True)
            tinygemm = timed(lambda t: torch._weight_int4pack_mm(x, t[0], g, t[1]), tiny_w, True)
            tiny_err = float((torch._weight_int4pack_mm(x, tiny[0], g, tiny[1]).float() - want).abs().max()
                             / want.abs().max())
            configs = grid if ranked is None else [c for _, c in ranked[:5]]
            timings = []
            for c in configs:
                try:
                    us = timed(lambda t: run(x, *t, g, config=c), rows_w, True)
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: skip it
                    timings.append((float("inf"), c))
                    print(json.dumps({"proj": name, "cfg": c, "error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
                    continue
                timings.append((us, c))
            timings.sort(key=lambda t: t[0])
            if ranked is None:
                ranked = timings
            best = []
            for us, c in timings[:5]:
                got = run(x, packed, zeros, scales, g, config=c).float()
                best.append({"us": round(us, 2), "x_cublas": round(cublas / us, 3), "x_tinygemm": round(tinygemm / us, 3),
                             "tb_s": round(nbytes / us / 1e6, 2), "cfg": c,
                             "max_rel_err": float((got - want).abs().max() / want.abs().max())})
            engine_cfg = int4_row.int4_row_tiles(n, k) if args.kernel == "row" else int4_row.int4_mma_tiles(rows, n)
            engine_us = timed(lambda t: run(x, *t, g, config=engine_cfg), rows_w, True)
            kq = [(qweight, zeros, scales)] + [(qweight.clone(), zeros.clone(), scales.clone())
                                              for _ in range(copies(nbytes, True) - 1)]
            tc_us = timed(lambda t: int_kpacked.int_matmul(x, *t, g, 4), kq, True)
            del kq
            r = {"proj": name, "n": n, "k": k, "rows": rows, "group": g, "cublas_bf16_us": round(cublas, 2),
                 "kernel": args.kernel, "tensor_core_kpacked_us": round(tc_us, 2),
                 "engine": {"tiles": engine_cfg, "us": round(engine_us, 2),
                            "int4_linear_us": round(timed(lambda t: dispatch.int4_linear(x, *t, g, tinygemm=tiny), rows_w,
                                                          True), 2),
                            "dequantize_cublas_us": round(timed(lambda t: dispatch.int4_row_matmul_dequantized(x, *t, g),
                                                                rows_w, True), 2)},
                 "tinygemm_us": round(tinygemm, 2), "tinygemm_x_cublas": round(cublas / tinygemm, 3),
                 "tinygemm_max_rel_err": tiny_err, "best": best,
                 "failed": sum(1 for t in timings if t[0] == float("inf"))}
            print(json.dumps(r), flush=True)
            results.append(r)
        del bf16_w, rows_w, tiny_w
        torch.cuda.empty_cache()
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
