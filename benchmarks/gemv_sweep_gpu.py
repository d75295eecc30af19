"""Tile sweep of kvloom's FMA GEMV (``quant.fp8_weight_only.fp8_gemv``'s kernel, no tensor cores) at one row, on
bf16 and FP8 weights, against cuBLAS (``F.linear`` on the bf16 weight) and the FP8 layer's current rule,
at a model's projection shapes and its LM head. Timed like ``quant_kernels_gpu.py``: a CUDA graph of
many calls with the weights rotated past L2. Prints one JSON line per shape and weight dtype: cuBLAS's
microseconds, the rule's, and the five fastest tile configs with bf16's time over theirs.

    python benchmarks/gemv_sweep_gpu.py --shape llama-3-8b
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
from quant_kernels_gpu import copies, projection_shapes, timed  # noqa: E402
from shapes import SHAPES  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--fp8-projs", default="qkv,o", help="The projections whose FP8 weights are swept too.")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    from kvloom.core.model.quantization.fp8 import fp8_linear
    from kvloom.kernels import quant_reference as qr
    from kvloom.kernels.quant import dispatch, fp8_weight_only

    cfg = SHAPES[args.shape]
    shapes = dict(projection_shapes(cfg))
    shapes["lm_head"] = (cfg["hidden_size"], cfg["vocab_size"])
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sp, num_warps=w, num_stages=st)
            for bn, bk, sp, w, st in itertools.product((4, 8, 16, 32), (256, 512, 1024), (1, 2, 4), (4, 8), (2, 4))
            if bn * bk <= 16384]
    results = []
    dev = "cuda"
    for name, (k, n) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        bf16_w = [w] + [w.clone() for _ in range(copies(w.numel() * 2, True) - 1)]
        ref = F.linear(x.float(), w.float())
        cublas = timed(lambda t: F.linear(x, t), bf16_w, True)
        for dt in args.dtypes.split(","):
            if dt == "fp8" and name not in args.fp8_projs.split(","):
                continue
            if dt == "bf16":
                ones = torch.ones(n, device=dev, dtype=torch.float32)
                ws_list = [(t, ones) for t in bf16_w]
                want, rule = ref, None
            else:
                ws = qr.fp8_scale_per_row(w)
                wq = qr.fp8_quantize(w, ws)
                ws_list = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies(wq.numel(), True) - 1)]
                want = F.linear(x.float(), wq.float() * ws.float().reshape(n, 1))
                rule = {"path": dispatch.fp8_linear_path(1, n, k),
                        "us": round(timed(lambda t: fp8_linear(x, t[0], t[1], None, None), ws_list, True), 2)}
            timings = []
            for c in grid:
                try:
                    us = timed(lambda t: fp8_weight_only.fp8_gemv(x, *t, config=c), ws_list, True)
                except Exception as e:  # noqa: BLE001 - a config that does not compile: skip it
                    timings.append((float("inf"), c, f"{type(e).__name__}"))
                    continue
                timings.append((us, c, None))
            timings.sort(key=lambda t: t[0])
            best = []
            for us, c, err in timings[:5]:
                got = fp8_weight_only.fp8_gemv(x, *ws_list[0], config=c).float()
                best.append({"us": round(us, 2), "x_cublas": round(cublas / us, 3), "cfg": c,
                             "max_rel_err": float((got - want).abs().max() / want.abs().max())})
            r = {"proj": name, "n": n, "k": k, "weights": dt, "cublas_bf16_us": round(cublas, 2), "rule": rule,
                 "best": best, "failed": sum(1 for t in timings if t[2])}
            print(json.dumps(r), flush=True)
            results.append(r)
        del bf16_w
        torch.cuda.empty_cache()
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
