"""Where an offline workload's wall time goes, step by step: device time of pure-decode steps, of prefill
steps and of steps mixing both, and the device's idle gaps between steps (time the host did not keep the
device busy). A tool for tuning, not a benchmark against a peer.

On CUDA each step's device work is bracketed by two events recorded on the runner's stream around
``ModelRunner.execute`` (which only queues work), so a step's device time is from its first kernel's
queue point to its last kernel's end, and the gap to the next step's first event is idle device time.

    python benchmarks/step_profile.py --shape llama-3-8b --num-requests 256 --prompt-len 512 --output-len 256
    python benchmarks/step_profile.py --shape llama-3-8b --num-requests 1 --prompt-len 128 --output-len 256
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import model_for_benchmark  # noqa: E402


def classify(plan) -> str:
    """decode: every sequence feeds one known token (plus drafts); prefill: every sequence feeds a
    prompt chunk; mixed: both in one step."""
    chunks = sum(1 for s in plan.seqs if len(s.token_ids) - len(s.draft_token_ids) > 1)
    if not chunks:
        return "decode"
    return "prefill" if chunks == len(plan.seqs) else "mixed"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--output", default=None, help="Write the figures as JSON here.")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: also count the host-device synchronisations torch reports during the run "
                        "(torch.cuda.set_sync_debug_mode), by where in kvloom they happen. Allocator syncs "
                        "(cudaFree, cudaHostAlloc) are not reported.")
    args = p.parse_args()
    from kvloom import LLM, SamplingParams

    model, load_format, vocab = model_for_benchmark(args.model, args.shape if not args.model else None)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    llm = LLM(model, load_format=load_format, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    runner = llm.engine.runner
    cuda = llm.engine.device.type == "cuda"
    records: list[tuple[str, int, int, object, object, float, float]] = []
    original = runner.execute

    def execute(plan):
        t0 = time.perf_counter()
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        launched = original(plan)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        records.append((classify(plan), plan.num_tokens, sum(s.num_sample_rows for s in plan.seqs), start, end,
                        t0, time.perf_counter()))
        return launched

    runner.execute = execute
    syncs: collections.Counter = collections.Counter()
    if cuda:
        torch.cuda.synchronize()
        if args.sync_debug:
            def record(message, category, filename, lineno, file=None, line=None):
                frames = [f for f in traceback.extract_stack()[:-1] if "/kvloom/" in f.filename]
                where = f"{frames[-1].filename.split('/kvloom/')[-1]}:{frames[-1].lineno} {frames[-1].name}" \
                    if frames else f"{filename}:{lineno}"
                syncs[f"{where}: {str(message)[:80]}"] += 1
            warnings.showwarning = record
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
    alloc_keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
    alloc_before = {k: torch.cuda.memory_stats().get(k, 0) for k in alloc_keys} if cuda else {}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    runner.execute = original
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    kinds: dict[str, dict] = {}
    idle_ms = 0.0
    prev_end = None
    for kind, tokens, rows, start, end, h0, h1 in records:
        k = kinds.setdefault(kind, {"steps": 0, "tokens": 0, "rows": 0, "device_ms": [], "launch_ms": []})
        k["steps"] += 1
        k["tokens"] += tokens
        k["rows"] += rows
        k["launch_ms"].append((h1 - h0) * 1e3)
        if cuda:
            k["device_ms"].append(start.elapsed_time(end))
            if prev_end is not None:
                idle_ms += max(0.0, prev_end.elapsed_time(start))
            prev_end = end
    result = {"shape": args.shape if not args.model else args.model, "num_requests": args.num_requests,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "wall_s": round(wall, 3),
              "output_tok_s": round(out_tokens / wall, 1), "steps": len(records),
              "device_idle_ms_between_steps": round(idle_ms, 1), "kinds": {}}
    for kind, k in kinds.items():
        dev = k["device_ms"]
        result["kinds"][kind] = {
            "steps": k["steps"], "tokens_per_step": round(k["tokens"] / k["steps"], 1),
            "rows_per_step": round(k["rows"] / k["steps"], 1),
            "device_ms_total": round(sum(dev), 1) if dev else None,
            "device_ms_p50": round(statistics.median(dev), 3) if dev else None,
            "launch_ms_p50": round(statistics.median(k["launch_ms"]), 3),
            "launch_ms_total": round(sum(k["launch_ms"]), 1)}
    if cuda:  # the caching allocator's own syncs: a retry frees cached blocks (cudaFree waits for the device)
        stats = torch.cuda.memory_stats()
        result["allocator"] = {k: stats.get(k, 0) - alloc_before[k] for k in alloc_keys}
        result["allocator"]["reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
    if args.sync_debug:
        result["syncs"] = dict(syncs.most_common(15))
    print(json.dumps(result, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
