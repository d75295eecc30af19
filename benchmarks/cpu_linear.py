"""The CPU's linear layers: ``F.linear`` against the oneDNN-packed weights kvloom uses on the CPU
(``kvloom.kernels.cpu_linear.PackedLinear``), per projection of a model, at decode and prefill row counts.
Prints JSON: milliseconds per call and GFLOP/s for each.

    python benchmarks/cpu_linear.py                          # SmolLM2-135M shapes, float32 and bfloat16
    python benchmarks/cpu_linear.py --rows 1,32,2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from kvloom.core.worker.cpu_malloc import keep_freed_memory
from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

# (out_features, in_features) of SmolLM2-135M's projections, q/k/v and gate/up fused as kvloom runs them
SMOLLM2 = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
           "lm_head": (49152, 576)}


def per_call_ms(fn, min_seconds: float) -> float:
    fn()
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,2048", help="Comma-separated row counts (tokens in a step).")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--seconds", type=float, default=0.5, help="Time per measurement.")
    args = p.parse_args()
    keep_freed_memory()  # as the engine runs
    results = []
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        if not packing_supported(dtype):
            results.append({"dtype": dtype_name, "skipped": "no oneDNN packed linear for this dtype here"})
            continue
        for rows in (int(r) for r in args.rows.split(",")):
            for name, (n, k) in SMOLLM2.items():
                if name == "lm_head" and rows > 64:
                    continue  # logits are computed for the sampled rows only
                weight = torch.randn(n, k, dtype=dtype) * 0.05
                x = torch.randn(rows, k, dtype=dtype)
                packed = PackedLinear(weight, None, batch_hint=32)
                plain_ms = per_call_ms(lambda: F.linear(x, weight), args.seconds)
                packed_ms = per_call_ms(lambda: packed(x), args.seconds)
                gflop = 2 * rows * n * k / 1e9
                results.append({"dtype": dtype_name, "rows": rows, "layer": name,
                                "f_linear_ms": round(plain_ms, 4), "packed_ms": round(packed_ms, 4),
                                "f_linear_gflops": round(gflop / plain_ms * 1e3, 1),
                                "packed_gflops": round(gflop / packed_ms * 1e3, 1),
                                "speedup": round(plain_ms / packed_ms, 2)})
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"benchmark": "cpu_linear", "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
