"""Where the time of the quantized linear layers goes, kernel by kernel: each quantized path against the
bf16 GEMM at the projection shapes of a model and a few row counts, timed on CUDA by replaying a CUDA
graph of many calls (what the engine's decode steps do, so no Python launch cost is counted), with the
weights rotated over enough copies that they come from HBM, not L2. Prints one JSON line per shape and
row count: microseconds per call, GB/s of weight bytes read, and bf16's time over each path's.

    python benchmarks/quant_kernels_gpu.py --shape llama-3-8b --rows 1,16,256,4096      # the H200 run
    python benchmarks/quant_kernels_gpu.py --profile bf16,fp8,awq                        # + decode profile
    TRITON_INTERPRET=1 python benchmarks/quant_kernels_gpu.py --tiny                     # code paths, CPU

Paths: ``int4`` (the tensor-core W4A16 kernel), ``int4_gemv`` (the row GEMV on its layout, no tensor cores),
``int4_deq`` (dequantize into a scratch buffer, then cuBLAS), ``int4_tinygemm`` (PyTorch's
``_weight_int4pack_mm``, for reference); ``fp8_w8a8`` (per-token activation quantization + ``_scaled_mm``),
``fp8_mm_only`` (``_scaled_mm`` on already quantized activations), ``fp8_mm_fast`` (that, with fast
accumulation, as the engine runs it), ``fp8_mm_swapped`` (the same as ``(W @ x.T).T``, transposed back),
``fp8_w8a8_fast`` (with ``use_fast_accum``), ``fp8_gemv_dot`` (the ``tl.dot`` weight-only GEMV) and ``fp8_gemv`` (no tensor cores).

``--profile`` then runs one batch-1 decode of each format under torch.profiler (eager, so each kernel is
listed) and prints the kernels with the most CUDA time per decode step.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
L2_BYTES = 150e6  # more than the H200's L2 (50 MB) several times over


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // heads)
    return {"qkv": (h, (heads + 2 * kv) * d), "o": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def timed(fn, weights: list, cuda: bool, calls: int = 24) -> float:
    """Microseconds per ``fn(weights[i])`` call, cycling over the copies."""
    for w in weights[:2] * 2:  # autotuning and compilation happen here, outside any graph
        fn(w)
    if not cuda:
        t0 = time.perf_counter()
        for i in range(len(weights)):
            fn(weights[i])
        return (time.perf_counter() - t0) / len(weights) * 1e6
    calls = max(calls, len(weights))
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture warm-up on a side stream, as torch.cuda.graphs recommends
        fn(weights[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def copies(nbytes: int, cuda: bool) -> int:
    return max(1, min(12, math.ceil(L2_BYTES / nbytes))) if cuda else 1


def tinygemm_pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor):
    """PyTorch's int4 layout (``_convert_weight_to_int4pack``): q [K, N] 0..15 -> packed, and
    ``(q - 8) * s + zf`` scales/zeros [G, N, 2] bf16 with zf = (8 - z) * s."""
    w = q.t().contiguous().to(torch.int32)
    packed = torch._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
    s = scales.float()
    sz = torch.stack([s, (8 - zeros.float()) * s], -1).to(torch.bfloat16).contiguous()  # [G, N, 2]
    return packed, sz


def bench_shape(name: str, k: int, n: int, rows_list, group: int, dtype, dev: str, on_result=None) -> list[dict]:
    from kvloom.core.model.quantization.fp8 import fp8_w8a8_linear
    from kvloom.kernels import quant_reference as qr
    from kvloom.kernels.quant import fp8_rows, fp8_weight_only, int4_row, int_kpacked

    cuda = dev == "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(dtype)
    q = torch.randint(0, 16, (k, n), device=dev, generator=gen)
    qweight = qr.pack_int32(q, 4, 0)
    zeros = torch.randint(4, 12, (k // group, n), device=dev, generator=gen).to(torch.uint8)
    scales = (torch.rand(k // group, n, device=dev, generator=gen) * 0.004 + 0.002).half()
    ws = qr.fp8_scale_per_row(w)
    wq = qr.fp8_quantize(w, ws)
    bf16_w = [w] + [w.clone() for _ in range(copies(w.numel() * 2, cuda) - 1)]
    int4_bytes = qweight.numel() * 4 + zeros.numel() + scales.numel() * 2
    int4_w = [(qweight, zeros, scales)] + [(qweight.clone(), zeros.clone(), scales.clone())
                                           for _ in range(copies(int4_bytes, cuda) - 1)]
    packed = int4_row.int4_row_pack(qweight)  # the row GEMV's layout (what the engine's 4-bit layers hold on CUDA)
    row_w = [(packed, zeros, scales)] + [(packed.clone(), zeros.clone(), scales.clone())
                                        for _ in range(copies(int4_bytes, cuda) - 1)]
    fp8_w = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies(wq.numel(), cuda) - 1)]
    tiny = None
    if cuda:
        try:
            packed, sz = tinygemm_pack(q, zeros, scales)
            tiny = [(packed, sz)] + [(packed.clone(), sz.clone()) for _ in range(copies(int4_bytes, cuda) - 1)]
        except Exception as e:  # noqa: BLE001 - a torch without the op: say so and go on
            print(json.dumps({"proj": name, "tinygemm": f"unavailable: {type(e).__name__}: {e}"[:300]}), flush=True)
    results = []
    for rows in rows_list:
        x = torch.randn(rows, k, device=dev, generator=gen).to(dtype)
        xq, xs = fp8_rows.fp8_quantize_rows(x) if cuda else (None, None)
        paths = {
            "bf16": (lambda t: F.linear(x, t), bf16_w, w.numel() * 2),
            "int4": (lambda t: int_kpacked.int_matmul(x, *t, group, 4), int4_w, int4_bytes),
            "int4_deq": (lambda t: int_kpacked.int_matmul_dequantized(x, *t, group, 4), int4_w, int4_bytes),
        }
        if rows <= 16:
            paths["int4_gemv"] = (lambda t: int4_row.int4_row_gemv(x, *t, group), row_w, int4_bytes)
            paths["fp8_gemv_dot"] = (lambda t: fp8_weight_only.fp8_weight_only_linear(x, *t), fp8_w, wq.numel() + 4 * n)
            paths["fp8_gemv"] = (lambda t: fp8_weight_only.fp8_gemv(x, *t), fp8_w, wq.numel() + 4 * n)
        if cuda:
            paths["fp8_w8a8"] = (lambda t: fp8_w8a8_linear(x, t[0], t[1], None, None), fp8_w, wq.numel() + 4 * n)
            paths["fp8_w8a8_fast"] = (lambda t: _w8a8_fast(x, t[0], t[1]), fp8_w, wq.numel() + 4 * n)
            paths["fp8_mm_only"] = (lambda t: torch._scaled_mm(xq, t[0].t(), scale_a=xs, scale_b=t[1].reshape(1, -1),
                                                               out_dtype=dtype), fp8_w, wq.numel() + 4 * n)
            paths["fp8_mm_fast"] = (lambda t: fp8_mm(xq, xs, *t, dtype), fp8_w, wq.numel() + 4 * n)
            paths["fp8_mm_swapped"] = (lambda t: fp8_mm_swapped(xq, xs, *t, dtype), fp8_w, wq.numel() + 4 * n)
            if tiny is not None and dtype == torch.bfloat16:
                paths["int4_tinygemm"] = (lambda t: torch._weight_int4pack_mm(x, t[0], group, t[1]), tiny, int4_bytes)
        r = {"proj": name, "rows": rows, "n": n, "k": k}
        for path, (fn, ws_list, nbytes) in paths.items():
            try:
                us = timed(fn, ws_list, cuda)
            except Exception as e:  # noqa: BLE001 - one broken path must not hide the others' figures
                r[path] = f"error: {type(e).__name__}: {e}"[:200]
                continue
            r[path] = {"us": round(us, 2), "weight_gbs": round(nbytes / us / 1e3, 1)}
        base = r["bf16"]["us"] if isinstance(r.get("bf16"), dict) else None
        for path in paths:
            if base and isinstance(r.get(path), dict) and path != "bf16":
                r[path]["x_bf16"] = round(base / r[path]["us"], 3)
        if cuda and tiny is not None and rows <= 256:  # how far each int4 path is from the reference product
            want = int_kpacked.int_matmul_dequantized(x, qweight, zeros, scales, group, 4).float()
            for path, fn in (("int4", lambda: int_kpacked.int_matmul(x, qweight, zeros, scales, group, 4)),
                             ("int4_gemv", lambda: int4_row.int4_row_gemv(x, *row_w[0], group) if rows <= 16 else None),
                             ("int4_tinygemm", lambda: torch._weight_int4pack_mm(x, tiny[0][0], group, tiny[0][1]))):
                try:
                    got = fn()
                    if got is not None and isinstance(r.get(path), dict):
                        r[path]["max_rel_err"] = float((got.float() - want).abs().max() / want.abs().max())
                except Exception as e:  # noqa: BLE001
                    r[path + "_check"] = f"error: {type(e).__name__}: {e}"[:200]
        print(summary(r), flush=True)
        results.append(r)
        if on_result:
            on_result(r)
    return results


def summary(r: dict) -> str:
    """One line per shape and row count: bf16's microseconds, then each path's and its speed against bf16."""
    parts = [f"{r['proj']} M={r['rows']}:"]
    for path, v in r.items():
        if isinstance(v, dict):
            parts.append(f"{path} {v['us']:.1f}us {v['weight_gbs']:.0f}GB/s" + (f" {v['x_bf16']:.2f}x" if "x_bf16" in v else "")
                         + (f" err {v['max_rel_err']:.1e}" if "max_rel_err" in v else ""))
        elif isinstance(v, str) and path not in ("proj",):
            parts.append(f"{path} {v[:90]}")
    return " | ".join(parts)


def fp8_mm(xq, xs, wq, ws, dtype):
    """The engine's ``_scaled_mm`` (fast accumulation) on already quantized activations."""
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=dtype,
                            use_fast_accum=xq.is_cuda)


def fp8_mm_swapped(xq, xs, wq, ws, dtype):
    """The same product as ``(W @ x.T).T``: cuBLASLt picks its kernel for N x M instead of M x N, which may
    suit a few hundred rows better; the transpose back to row-major is part of the time."""
    out = torch._scaled_mm(wq, xq.t(), scale_a=ws.reshape(-1, 1), scale_b=xs.reshape(1, -1), out_dtype=dtype,
                           use_fast_accum=xq.is_cuda)
    return out.t().contiguous()


def _quantized(x):
    from kvloom.kernels.quant import fp8_rows

    return fp8_rows.fp8_quantize_rows(x)


def _w8a8_fast(x, wq, ws):
    xq, xs = _quantized(x)
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=x.dtype,
                            use_fast_accum=True)[: x.shape[0]]


def profile_decode(shape: str, formats: list[str], steps: int, rows: int, on_result=None) -> list[dict]:
    """Kernel times of a batch-1 decode (eager) per format, per step."""
    from torch.profiler import ProfilerActivity, profile

    from kvloom import LLM, SamplingParams
    from shapes import model_for_benchmark

    model, _, vocab = model_for_benchmark(None, shape)
    out = []
    for fmt in formats:
        llm = LLM(model, load_format="dummy", quantization=None if fmt == "bf16" else fmt, max_num_seqs=1,
                  max_model_len=1024, enforce_eager=True)
        prompt = [[100 + i for i in range(16)]]
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, params, use_tqdm=False)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        total = sum(e.self_device_time_total for e in events)
        top = [{"kernel": e.key[:80], "us_per_step": round(e.self_device_time_total / steps, 1),
                "calls_per_step": round(e.count / steps, 1), "share": round(e.self_device_time_total / total, 3)}
               for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]]
        r = {"profile": fmt, "kernel": llm.engine.quantization.describe() if llm.engine.quantization else "dense",
             "gpu_us_per_step": round(total / steps, 1), "top": top}
        print(json.dumps(r), flush=True)
        out.append(r)
        if on_result:
            on_result(out)
        del llm
        gc.collect()  # the engine holds reference cycles: without this its ~130 GiB stay allocated
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--rows", default="1,16,256,4096")
    p.add_argument("--projections", default="qkv,o,gate_up,down")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="Small shapes on the CPU (TRITON_INTERPRET=1): the code paths.")
    p.add_argument("--profile", default="", help="Formats to profile at batch-1 decode, e.g. bf16,fp8,awq.")
    p.add_argument("--profile-steps", type=int, default=32)
    p.add_argument("--no-kernels", action="store_true", help="Only the profile.")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    dev = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    cfg = TINY if args.tiny else SHAPES[args.shape]
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")] if not args.tiny else [1, 3, 20]
    result = {"benchmark": "quant_kernels_gpu", "shape": "tiny" if args.tiny else args.shape,
              "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "kernels": [], "profile": []}

    def save(_=None):  # after every figure, so a run cut short by a timeout keeps what it measured
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=1))

    def keep(r):
        result["kernels"].append(r)
        save()

    if not args.no_kernels:
        group = 32 if args.tiny else args.group_size
        for name, (k, n) in projection_shapes(cfg).items():
            if name in args.projections.split(","):
                bench_shape(name, k, n, rows, group, dtype, dev, keep)
    if args.profile:
        def keep_profile(out):
            result["profile"] = out
            save()

        profile_decode(args.shape, args.profile.split(","), args.profile_steps, 14, keep_profile)
    save()
    return result


if __name__ == "__main__":
    main()
