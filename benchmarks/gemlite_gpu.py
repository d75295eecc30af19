"""GemLite's Triton low-bit GEMMs (PyPI ``gemlite``) against the paths kvloom has for each quantized
format, at a model's projection shapes and a few row counts, timed like ``quant_kernels_gpu.py``
(a CUDA graph of many calls, weights rotated past L2). One JSON line per shape and row count:
microseconds per call and bf16's time over each path's (> 1 is faster than bf16).

    python benchmarks/gemlite_gpu.py --shape llama-3-8b --rows 1,2,4,8,16,64,256

Paths: ``bf16`` (cuBLAS), ``tinygemm`` (``torch._weight_int4pack_mm``), ``int4_kvloom`` (kvloom's
rule for 4-bit layers, ``quant.dispatch.int_linear``), ``gemlite_w4`` (GemLite A16W4, group 128,
``(q - z) * s``), ``gemlite_bf16`` (GemLite's 16-bit kernels on the bf16 weight), ``fp8_kvloom`` (kvloom's FP8 rule),
``gemlite_fp8`` (GemLite A16W8 with e4m3 weights
and per-channel scales). Also each GemLite path's largest error against the dequantized weight's
product, relative to its largest output.
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,16,64,256")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--config", default=None, help="a GemLite autotune cache to load (default: its h100.json)")
    p.add_argument("--save-config", default=None, help="write GemLite's autotune results here")
    p.add_argument("--formats", default="w4,fp8,bf16")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    import gemlite
    from gemlite import DType, GemLiteLinearTriton

    from kvloom.core.model.quantization.fp8 import fp8_linear
    from kvloom.kernels import quant_reference as qr
    from kvloom.kernels.quant import dispatch, tinygemm

    cfg_file = args.config or str(Path(gemlite.__file__).parent / "configs" / "h100.json")
    print(json.dumps({"gemlite": gemlite.__version__, "config": cfg_file,
                      "loaded": GemLiteLinearTriton.load_config(cfg_file)}), flush=True)
    dev, dtype, g = "cuda", torch.bfloat16, args.group
    formats = args.formats.split(",")
    results = []
    for name, (k, n) in projection_shapes(SHAPES[args.shape]).items():
        gen = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(dtype)
        q = torch.randint(0, 16, (n, k), device=dev, generator=gen, dtype=torch.uint8)  # [N, K]
        z = torch.randint(4, 12, (n, k // g), device=dev, generator=gen).to(torch.uint8)
        s = (torch.rand(n, k // g, device=dev, generator=gen) * 0.004 + 0.002).half()
        # kvloom's K-packed layout of the same weight
        qweight = qr.pack_int32(q.t().contiguous().to(torch.int64), 4, 0)
        zeros_k, scales_k = z.t().contiguous(), s.t().contiguous()
        int4_bytes = qweight.numel() * 4 + zeros_k.numel() + scales_k.numel() * 2
        nc = copies(int4_bytes, True)
        kv_int4 = [(qweight, zeros_k, scales_k, tinygemm.tinygemm_pack(qweight, zeros_k, scales_k, g))]
        kv_int4 += [(a.clone(), b.clone(), c.clone(), tuple(t.clone() for t in d)) for a, b, c, d in kv_int4 * (nc - 1)]
        gl_w4 = []
        if "w4" in formats:
            for _ in range(nc):
                lin = GemLiteLinearTriton(4, group_size=g, in_features=k, out_features=n,
                                          input_dtype=DType.BF16, output_dtype=DType.BF16)
                lin.pack(q, s.to(dtype), z.to(dtype), bias=None, fma_mode=False)
                gl_w4.append(lin)
        ws = qr.fp8_scale_per_row(w)
        wq = qr.fp8_quantize(w, ws)
        nf = copies(wq.numel(), True)
        kv_fp8 = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(nf - 1)]
        gl_fp8 = []
        if "fp8" in formats:
            for _ in range(nf):
                gl_fp8.append(gemlite.helper.A16W8_FP8(device=dev, dtype=dtype).from_weights(
                    wq.clone(), bias=None, scales=ws.reshape(n, 1).to(dtype)))
        bf16_w = [w] + [w.clone() for _ in range(copies(w.numel() * 2, True) - 1)]
        gl_bf16 = []
        if "bf16" in formats:
            for t in bf16_w:
                lin = GemLiteLinearTriton(16, group_size=k, in_features=k, out_features=n,
                                          input_dtype=DType.BF16, output_dtype=DType.BF16)
                lin.pack(t.clone(), None, None, bias=None)
                gl_bf16.append(lin)
        w4_ref = ((q.float() - z.float().repeat_interleave(g, 1)) * s.float().repeat_interleave(g, 1))
        fp8_ref = wq.float() * ws.float().reshape(n, 1)

        for rows in [int(r) for r in args.rows.split(",")]:
            x = (torch.randn(rows, k, device=dev, generator=gen)).to(dtype)
            paths = {"bf16": (lambda t: F.linear(x, t), bf16_w),
                     "int4_kvloom": (lambda t: dispatch.int_linear(x, t[0], t[1], t[2], g, 4, None, t[3]), kv_int4)}
            if rows <= 8:
                paths["tinygemm"] = (lambda t: tinygemm.tinygemm_linear(x, *t[3], g), kv_int4)
            if gl_w4:
                paths["gemlite_w4"] = (lambda t: t(x), gl_w4)
            paths["fp8_kvloom"] = (lambda t: fp8_linear(x, t[0], t[1], None, None), kv_fp8)
            if gl_fp8:
                paths["gemlite_fp8"] = (lambda t: t(x), gl_fp8)
            if gl_bf16:
                paths["gemlite_bf16"] = (lambda t: t(x), gl_bf16)
            r = {"proj": name, "rows": rows, "n": n, "k": k}
            for path, (fn, ws_list) in paths.items():
                try:
                    r[path] = {"us": round(timed(fn, ws_list, True), 2)}
                except Exception as e:  # noqa: BLE001 - one broken path must not hide the others
                    r[path] = f"error: {type(e).__name__}: {e}"[:300]
            base = r["bf16"]["us"]
            for path in paths:
                if isinstance(r.get(path), dict) and path != "bf16":
                    r[path]["x_bf16"] = round(base / r[path]["us"], 3)
            for path, ref in (("gemlite_w4", w4_ref), ("gemlite_fp8", fp8_ref), ("int4_kvloom", w4_ref),
                              ("fp8_kvloom", fp8_ref)):
                if not isinstance(r.get(path), dict):
                    continue
                fn, weights = paths[path]
                want = x.float() @ ref.t()
                got = fn(weights[0]).float()
                r[path]["max_rel_err"] = float((got - want).abs().max() / want.abs().max())
            print(json.dumps(r), flush=True)
            results.append(r)
        del gl_w4, gl_fp8, gl_bf16, kv_int4, kv_fp8, bf16_w
        torch.cuda.empty_cache()
    if args.save_config:
        GemLiteLinearTriton.cache_config(args.save_config)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
