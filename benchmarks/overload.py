"""Overload a kvloom server (started here) at a multiple of its capacity with open-loop (Poisson)
arrivals from ``engine bench serve``'s load generator, bounded in time, and check what admission
promises: every answer is 200, 429, 503 or 408 (no other status, no hang), the admitted requests'
TTFT p99 stays within the queue timeout, a refusal (429/503) comes within ``--refusal-bound-ms``
at p99, and the engine's memory (RSS) stays flat.

    python benchmarks/overload.py --seconds 20 --overload 10          # SmolLM2 on the CPU
    python benchmarks/overload.py --model /tmp/kvloom-tiny --random-token-range 0:300 --seconds 20

Capacity is measured first, closed-loop with ``--max-num-seqs`` streams (``--capacity-rounds`` rounds
of requests), in the same run; the overload phase then sends ``overload x capacity`` requests per second for
``--seconds``, and waits for the last answers. It prints the figures as JSON (``--out FILE.json``
also writes them, and a plot beside it as FILE.png). The exit status is 0 only if every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvloom.bench.ab import ServerProcess
from kvloom.bench.serve import LoadSpec, run_sweep
from kvloom.bench.workloads import Workload

ALLOWED = {200, 408, 429, 503}
REFUSED = {429, 503}
HANG_S = 120.0  # no answer at all within this: a hang


def descendant_running(pid: int, module: str) -> int:
    """The pid of the process below ``pid`` whose command line runs ``module``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            if module in (Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()):
                return child
        except OSError:
            continue
        todo.extend(children.get(child, []))
    raise RuntimeError(f"no process runs {module} under pid {pid}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RssSampler(threading.Thread):
    """The engine's RSS every ``period`` seconds, as ``(seconds since start, MB)``."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append((time.monotonic() - self.start_time, rss_mb(self.pid)))
            self.stopped.wait(self.period)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def status_of(record: dict) -> int | str:
    if record["ok"]:
        return 200
    if record["status"] is not None and record["status"] != 200:
        return record["status"]
    return "hang" if "within --request-timeout" in (record["error"] or "") else "transport error"


def plot(path: Path, records: list[dict], rss: list[tuple[float, float]], overload_started: float,
         figures: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    colors = {200: "tab:green", 429: "tab:orange", 503: "tab:red", 408: "tab:purple"}
    for status in sorted({status_of(r) for r in records}, key=str):
        rows = [r for r in records if status_of(r) == status]
        top.hist([r["start"] for r in rows], bins=40, histtype="step", linewidth=1.5,
                 color=colors.get(status, "black"), label=f"{status}: {len(rows)}")
    top.set_ylabel("requests per bin")
    top.set_title(f"{figures['overload']:g}x capacity ({figures['capacity_rps']:.1f} req/s) on {figures['model']}")
    top.legend(fontsize=8)
    admitted = [r for r in records if r["ok"] and r["chunk_times"]]
    mid.scatter([r["start"] for r in admitted], [r["chunk_times"][0] for r in admitted], s=4,
                color="tab:green", label="TTFT of admitted (s)")
    refused = [r for r in records if status_of(r) in REFUSED and r["error_s"] is not None]
    mid.scatter([r["start"] for r in refused], [r["error_s"] for r in refused], s=4, color="tab:orange",
                label="time to a 429/503 (s)")
    mid.axhline(figures["queue_timeout_s"], color="tab:purple", linestyle="--", label="queue timeout")
    mid.set_yscale("log")
    mid.set_ylabel("seconds")
    mid.legend(fontsize=8)
    low.plot([t - overload_started for t, _ in rss], [mb for _, mb in rss], color="tab:blue")
    low.ticklabel_format(axis="y", useOffset=False)
    low.set_ylabel("engine RSS (MB)")
    low.set_xlabel("seconds since the overload started (arrival time)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--seconds", type=float, default=30.0, help="Length of the overload phase.")
    parser.add_argument("--capacity-rounds", type=int, default=2,
                        help="The capacity is measured with this many rounds of --max-num-seqs requests.")
    parser.add_argument("--overload", type=float, default=10.0, help="Arrival rate as a multiple of capacity.")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--queue-timeout", type=float, default=5.0)
    parser.add_argument("--input-len", type=int, default=64, help="Prompt tokens of each request.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--random-token-range", default="1000:10000", metavar="LOW:HIGH",
                        help="Prompt token ids are drawn from [LOW, HIGH) (a tiny test model needs a small HIGH).")
    parser.add_argument("--api-workers", type=int, default=2)
    parser.add_argument("--refusal-bound-ms", type=float, default=250.0,
                        help="Most milliseconds a 429/503 may take at p99.")
    parser.add_argument("--rss-growth-bound-mb", type=float, default=64.0,
                        help="Most the engine's RSS may grow over the overload phase.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="Also write the figures to this JSON file, and a plot beside it (.png).")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["--model", args.model, "--api-workers", str(args.api_workers),
                                "--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests",
                                str(args.max_queued_requests), "--queue-timeout", str(args.queue_timeout),
                                "--no-log-requests"], Path(tmp) / "server.log")
        try:
            url = server.wait_ready(600)
            engine = descendant_running(server.proc.pid, "kvloom.launch.engine_process")
            workload = Workload(input_len=(args.input_len, args.input_len),
                                output_len=(args.max_tokens, args.max_tokens), seed=args.seed,
                                token_range=tuple(int(x) for x in args.random_token_range.split(":")))
            closed = run_sweep(LoadSpec(base_url=url, concurrency=[args.max_num_seqs],
                                        num_requests=args.capacity_rounds * args.max_num_seqs, progress=False),
                               workload)["levels"][0]
            capacity = closed["request_throughput"]
            rate = capacity * args.overload
            sampler = RssSampler(engine)
            sampler.start()
            overload_started = time.monotonic() - sampler.start_time
            # The arrivals stop after --seconds; the level then waits for the last answers (or a hang).
            level = run_sweep(LoadSpec(base_url=url, request_rate=[rate], num_requests=max(1, int(rate * args.seconds)),
                                       max_duration_s=args.seconds + HANG_S, request_timeout_s=HANG_S,
                                       warmup_requests=0, save_requests=True, progress=False,
                                       client_processes=1), workload)["levels"][0]
            sampler.stopped.set()
            sampler.join()
            metrics = httpx.get(url + "/metrics", timeout=30).text
        finally:
            server.stop()
    records = level["requests"]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(status_of(r))] = statuses.get(str(status_of(r)), 0) + 1
    ttfts = [r["chunk_times"][0] for r in records if r["ok"] and r["chunk_times"]]
    refusals_ms = [r["error_s"] * 1000 for r in records if status_of(r) in REFUSED and r["error_s"] is not None]
    rss = [mb for t, mb in sampler.samples if t >= overload_started]
    figures = {
        "model": args.model, "capacity_rps": capacity, "overload": args.overload, "rate_rps": rate,
        "sent": len(records), "arrivals_for_s": args.seconds, "level_wall_s": level["duration_s"], "statuses": statuses,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99), "ttft_max_s": max(ttfts, default=None),
        "refusal_ms": {"count": len(refusals_ms), "p50": percentile(refusals_ms, 50),
                       "p99": percentile(refusals_ms, 99), "max": max(refusals_ms, default=None),
                       "bound_p99": args.refusal_bound_ms},
        "engine_rss_mb": {"start": rss[0], "max": max(rss), "end": rss[-1], "bound_growth": args.rss_growth_bound_mb},
        "queue_timeout_s": args.queue_timeout, "max_queued_requests": args.max_queued_requests,
        "max_num_seqs": args.max_num_seqs, "api_workers": args.api_workers, "input_len": args.input_len,
        "max_tokens": args.max_tokens, "host_load_average": os.getloadavg(),
        "rejections": [line for line in metrics.splitlines() if line.startswith(("kvloom_engine_rejected",
                                                                                  "kvloom_engine_expired"))],
    }
    checks = {
        "only_allowed_statuses": set(statuses) <= {str(s) for s in ALLOWED},
        "ttft_p99_within_queue_timeout": figures["ttft_p99_s"] is not None and figures["ttft_p99_s"] <= args.queue_timeout,
        "refusal_p99_within_bound": bool(refusals_ms) and figures["refusal_ms"]["p99"] <= args.refusal_bound_ms,
        "engine_rss_flat": rss[-1] - rss[0] <= args.rss_growth_bound_mb,
    }
    figures["checks"] = checks
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        try:
            plot(Path(args.out).with_suffix(".png"), records, sampler.samples, overload_started, figures)
        except ImportError:
            print("no plot: matplotlib is missing (pip install 'kvloom[bench]')", file=sys.stderr)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
