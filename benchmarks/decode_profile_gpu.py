"""Where a batch-1 decode step's time goes with CUDA graphs on, kernel by kernel, for each of ``--formats``
(dummy weights of a real shape). A tool for tuning, not a benchmark against a peer.

Under programmatic dependent launch a kernel starts while its predecessor runs and waits inside, so
kernel durations overlap and their sum says little. This tool sorts the step's kernels by start and
charges each with the time from the previous kernel's end (or its own start, if later) to its own end:
its share of the step's critical path. Summed by kernel name per step, with the gaps where no kernel ran.

    python benchmarks/decode_profile_gpu.py --shape llama-3-8b --formats bf16,fp8,awq
    python benchmarks/decode_profile_gpu.py --formats awq --kernel-option int4_row_min_weight=0

``--kernel-option NAME=VALUE`` (VALUE in JSON; kvloom/kernels/options.py) sets a kernel choice of the engines,
to compare kernel routings or tiles.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import kernel_options, model_for_benchmark  # noqa: E402


def kernel_spans(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of every device kernel the profiler saw, by start."""
    spans = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            spans.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(spans)


def label_by_layer(spans, attention: str = "_decode_kernel") -> list[tuple[float, float, str]]:
    """A kernel launched more than once between two attention kernels (the GEMVs) gets ``#i`` after its
    name for its ``i``-th launch after the attention: for a dense layer #0 o_proj, #1 gate/up, #2 down,
    #3 the next layer's qkv."""
    seen: dict[str, int] = collections.defaultdict(int)
    count = collections.Counter(name for _, _, name in spans)
    layers = max(count[attention], 1)
    out = []
    for start, stop, name in spans:
        if name == attention:
            seen.clear()
        elif count[name] >= 2 * layers:
            i = seen[name]
            seen[name] = i + 1
            name = f"{name}#{i}"
        out.append((start, stop, name))
    return out


def critical_path(spans, steps: int) -> dict:
    """Each kernel's increment of the running end time, summed per name and divided by ``steps``; idle is
    the time between the running end and a kernel that starts after it."""
    by_name: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    idle = 0.0
    end = spans[0][0]
    for start, stop, name in spans:
        if start > end:
            idle += start - end
            end = start
        if stop > end:
            by_name[name] += stop - end
            end = stop
        count[name] += 1
    total = end - spans[0][0]
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])
    return {"us_per_step": round(total / steps, 1), "idle_us_per_step": round(idle / steps, 1),
            "kernels": [{"kernel": k[:90], "us_per_step": round(v / steps, 2), "calls_per_step": round(count[k] / steps, 1)}
                        for k, v in rows]}


def main(argv=None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from kvloom import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--formats", default="bf16,fp8,awq")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--output", default=None)
    p.add_argument("--kernel-option", action="append", default=[], metavar="NAME=VALUE",
                   help="A kernel choice for the engines (kvloom/kernels/options.py), VALUE in JSON, e.g. "
                        "int4_fused_silu_mul=true; repeatable.")
    args = p.parse_args(argv)
    options = kernel_options(args.kernel_option)
    model, _, _ = model_for_benchmark(None, args.shape)
    out = {"shape": args.shape, "steps": args.steps, "kernel_options": options, "runs": []}
    for fmt in args.formats.split(","):
        llm = LLM(model, load_format="dummy", quantization=None if fmt == "bf16" else fmt, max_num_seqs=4,
                  max_model_len=2048, kernel_options=options)
        prompt = [[100 + i for i in range(512)]]
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            res = llm.generate(prompt, params, use_tqdm=False)[0]
            torch.cuda.synchronize()
        spans = kernel_spans(prof)
        # the prompt's prefill is the first step: drop kernels before the first decode graph's (the
        # prefill's are eager and long); what is left is args.steps decode steps
        # from the first decode step's first attention kernel on (the prompt's prefill and the start of
        # that step dropped); the steps counted by attention launches
        first = next(i for i, s in enumerate(spans) if s[2] == "_decode_kernel")
        spans = spans[first:]
        layers = llm.engine.model.config.num_hidden_layers
        steps = sum(1 for s in spans if s[2] == "_decode_kernel") / layers
        cp = critical_path(label_by_layer(spans), steps)
        cp["kernels"] = cp["kernels"][: args.top]
        r = {"format": fmt, "decode_tok_s": (args.steps) / (res.metrics.latency - res.metrics.ttft), **cp}
        print(json.dumps(r), flush=True)
        out["runs"].append(r)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
