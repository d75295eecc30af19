"""Replicas and routing on one workload: the server with one engine, with two replicas routed by prefix
affinity, and with two routed round-robin, each loaded in turn by ``engine bench serve`` with the same
shared-prefix workload; prints throughput, latency and each arm's prefix-cache hit rate side by side.

    python benchmarks/router_ab.py                       # SmolLM2-135M on the CPU, ~3 minutes
    python benchmarks/router_ab.py --model PATH --threads-per-engine 4 --num-requests 64

The replicas share the host's cores: on the CPU two replicas get half the threads each (the same cores
in all), so the comparison is of scheduling and cache reuse, not of more hardware. Each arm records the
host's load average before it starts (``/proc/loadavg``): on a shared host, read the figures with it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom.bench.ab import ServerProcess, engine_stats  # noqa: E402

ARMS = [("1 engine", ["--data-parallel-size", "1"], 1),
        ("2 replicas, prefix affinity", ["--data-parallel-size", "2", "--routing-policy", "prefix_affinity"], 2),
        ("2 replicas, round-robin", ["--data-parallel-size", "2", "--routing-policy", "round_robin"], 2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Model (default: the built-in SmolLM2-135M-Instruct).")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of the host shared by the engines.")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    # Odd: with an even count, round-robin over 2 replicas would send each prefix to one replica by accident.
    p.add_argument("--num-prefixes", type=int, default=5)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--arms", default="0,1,2", help="Which arms to run (0: 1 engine, 1: affinity, 2: round-robin).")
    p.add_argument("--output-json", help="Write every arm's figures here.")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))  # so the servers below are stopped
    tmp = Path(tempfile.mkdtemp(prefix="kvloom-router-ab-"))
    model = ["--model", args.model] if args.model else []
    runs = []
    for i, (name, flags, replicas) in enumerate(ARMS):
        if str(i) not in args.arms.split(","):
            continue
        threads = max(1, args.threads // replicas)
        load_before = os.getloadavg()
        server = ServerProcess([*model, "--plugins", "prefix_cache", "--threads", str(threads),
                                "--kv-cache-memory-gib", "0.5", *flags], tmp / f"server-{i}.log")
        try:
            url = server.wait_ready(600)
            out = tmp / f"arm-{i}.json"
            load = [sys.executable, "-m", "kvloom.cli", "bench", "serve", "--base-url", url, "--no-progress",
                    "--workload", "shared-prefix", "--num-prefixes", str(args.num_prefixes),
                    "--prefix-len", str(args.prefix_len), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--num-requests", str(args.num_requests),
                    "--concurrency", str(args.concurrency), "--output-json", str(out)]
            subprocess.run(load, check=True, stdout=subprocess.DEVNULL)
            level = json.loads(out.read_text())["levels"][0]
            stats = engine_stats(url)
        finally:
            server.stop()
        hit = stats.get("prefix_cache_hits", 0) / max(1, stats.get("prefix_cache_queries", 0))
        runs.append({"arm": name, "threads_per_engine": threads, "prefix_hit_rate": hit,
                     "load_average_before": load_before, **level})
        print(f"{name}: {level['request_throughput']:.2f} req/s, {level['output_throughput']:.1f} output tok/s, "
              f"TTFT p50 {level['ttft_ms']['p50']:.0f} ms, E2E p50 {level['e2e_ms']['p50']:.0f} ms, "
              f"prefix-cache hit rate {hit:.3f} (load average before: {load_before[0]:.2f})", flush=True)
    base = runs[0]  # the x column is against the first arm run
    print(f"\n{'arm':<30} {'req/s':>7} {'x':>6} {'TTFT p50':>9} {'E2E p50':>8} {'hit rate':>9}")
    for r in runs:
        print(f"{r['arm']:<30} {r['request_throughput']:>7.2f} {r['request_throughput'] / base['request_throughput']:>6.2f} "
              f"{r['ttft_ms']['p50']:>9.0f} {r['e2e_ms']['p50']:>8.0f} {r['prefix_hit_rate']:>9.3f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
