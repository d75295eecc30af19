"""Where the device time of an offline workload goes: runs kvloom under torch.profiler and prints the
kernels that took the most GPU time, grouped by name (a tool for tuning, not a benchmark).

    python benchmarks/profile_gpu.py --shape llama-3-8b --num-requests 256 --prompt-len 512 --output-len 256
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import kernel_options, model_for_benchmark  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--quantization", default=None, help="fp8, awq or gptq (dummy weights in that format).")
    p.add_argument("--warmup", choices=("short", "full"), default="short",
                   help="Before the profile, 4 requests (short) or the whole workload once (full: compiles out).")
    p.add_argument("--gaps", type=int, default=0, metavar="N",
                   help="Also print the N largest sums of idle device time, by the kernels before and after each gap.")
    p.add_argument("--kernel-option", action="append", default=[], metavar="NAME=VALUE",
                   help="A kernel choice for the engines (kvloom/kernels/options.py), VALUE in JSON, e.g. "
                        "int4_fused_silu_mul=true; repeatable.")
    args = p.parse_args()
    options = kernel_options(args.kernel_option)
    from kvloom import LLM, SamplingParams

    model, load_format, vocab = model_for_benchmark(None, args.shape)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    llm = LLM(model, load_format=load_format, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
              quantization=args.quantization, kernel_options=options)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts if args.warmup == "full" else prompts[:4], params, use_tqdm=False)
    torch.cuda.synchronize()
    if args.warmup == "full":
        elapsed = time.perf_counter() - t0
        print(f"warm-up (no profiler) {elapsed:.2f}s, {args.num_requests * args.output_len / elapsed:.0f} output tok/s")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    print(f"elapsed {elapsed:.2f}s (under the profiler), {args.num_requests * args.output_len / elapsed:.0f} output tok/s")
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0]
    total = sum(getattr(e, "self_device_time_total", 0) for e in events)
    print(f"GPU busy (sum of kernel times): {total / 1e6:.2f}s")
    for e in sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0))[: args.rows]:
        t = getattr(e, "self_device_time_total", 0)
        print(f"{t / 1e6:8.3f}s {100 * t / max(total, 1):5.1f}% {e.count:7d}  {e.key[:90]}")
    if args.gaps:
        print_idle_gaps(prof, elapsed, args.gaps)


def print_idle_gaps(prof, elapsed: float, top: int) -> None:
    """The device's idle time (the profiled wall time less the union of its kernels' and copies'
    intervals), and the gaps over 5 us summed by the (kernel before, kernel after) pair that bounds them."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA")
    if not spans:
        return
    busy, (start, end, name) = 0.0, spans[0]
    by_pair = collections.defaultdict(lambda: [0.0, 0])
    for s, e, n in spans[1:]:
        if s > end:
            busy += end - start
            if s - end > 5:
                pair = by_pair[(name[:45], n[:45])]
                pair[0] += s - end
                pair[1] += 1
            start, end, name = s, e, n
        elif e > end:
            end, name = e, n
    busy += end - start
    print(f"device busy {busy / 1e6:.2f}s of {elapsed:.2f}s; idle {elapsed - busy / 1e6:.2f}s, "
          f"of which gaps over 5 us {sum(v[0] for v in by_pair.values()) / 1e6:.2f}s:")
    for (before, after), (t, n) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / 1e6:8.3f}s {n:7d}  {before} -> {after}")


if __name__ == "__main__":
    main()
