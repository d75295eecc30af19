"""Overload a kvloom server (started here) at a multiple of its capacity with open-loop (Poisson)
arrivals, bounded in time, and check what admission promises: every answer is 200, 429, 503 or 408
(no other status, no hang), the admitted requests' TTFT p99 stays within the queue timeout, and the
engine's memory (RSS) stays flat.

    python benchmarks/overload.py --seconds 30 --overload 10          # SmolLM2 on the CPU
    python benchmarks/overload.py --model /tmp/kvloom-tiny --seconds 20

Capacity is measured first, closed-loop with ``--max-num-seqs`` clients for ``--warmup`` seconds, in
the same run; the overload phase then sends ``overload x capacity`` requests per second. It prints the
figures as JSON (and writes them with ``--out FILE.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.server_utils import EngineServer, free_port  # noqa: E402

ALLOWED = {200, 408, 429, 503}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def one(http: httpx.AsyncClient, body: dict, out: dict) -> None:
    """A streamed completion: its status, and TTFT when admitted."""
    start = time.monotonic()
    try:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            status = r.status_code
            first = None
            async for line in r.aiter_lines():
                if line.startswith("data:") and first is None:
                    first = time.monotonic() - start
                    if '"error"' in line:
                        status = json.loads(line[5:])["error"]["code"]
                elif line.startswith("data:") and '"error"' in line:
                    status = json.loads(line[5:])["error"]["code"]
    except httpx.HTTPError as e:
        out["statuses"][type(e).__name__] += 1
        return
    out["statuses"][status] += 1
    if status == 200 and first is not None:
        out["ttft"].append(first)


async def closed_loop(url: str, body: dict, clients: int, seconds: float) -> float:
    """Requests per second with ``clients`` back-to-back clients: the server's capacity."""
    done = 0
    stop = time.monotonic() + seconds

    async def client(http):
        nonlocal done
        while time.monotonic() < stop:
            r = await http.post("/v1/completions", json=body)
            done += r.status_code == 200

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        start = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return done / (time.monotonic() - start)


async def open_loop(url: str, body: dict, rate: float, seconds: float, engine_pid: int, seed: int) -> dict:
    rng = random.Random(seed)
    out = {"statuses": collections.Counter(), "ttft": []}
    rss = [rss_mb(engine_pid)]
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as http:
        tasks = []
        start = time.monotonic()
        next_at = start
        while next_at < start + seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(one(http, body, out)))
            next_at += rng.expovariate(rate)
            if len(tasks) % 50 == 0:
                rss.append(rss_mb(engine_pid))
        sent_for = time.monotonic() - start
        await asyncio.wait_for(asyncio.gather(*tasks), 180)  # a hang fails the run
        drained_in = time.monotonic() - start - sent_for
    rss.append(rss_mb(engine_pid))
    return {"sent": len(tasks), "rate": rate, "sent_for_s": sent_for, "drained_in_s": drained_in,
            "statuses": {str(k): v for k, v in sorted(out["statuses"].items(), key=str)},
            "ttft_p50_s": percentile(out["ttft"], 50), "ttft_p99_s": percentile(out["ttft"], 99),
            "engine_rss_mb": {"start": rss[0], "max": max(rss), "end": rss[-1]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--seconds", type=float, default=30.0, help="Length of the overload phase.")
    parser.add_argument("--warmup", type=float, default=15.0, help="Length of the capacity measurement.")
    parser.add_argument("--overload", type=float, default=10.0, help="Arrival rate as a multiple of capacity.")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--queue-timeout", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--api-workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="Also write the figures to this JSON file.")
    args = parser.parse_args()

    body = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": args.max_tokens,
            "ignore_eos": True, "temperature": 0}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = EngineServer(["--model", args.model, "--port", str(port), "--api-workers", str(args.api_workers),
                               "--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests",
                               str(args.max_queued_requests), "--queue-timeout", str(args.queue_timeout),
                               "--no-log-requests"], Path(tmp), port=port)
        try:
            server.wait_ready(600)
            engine = server.child_running("kvloom.core.engine_process")
            capacity = asyncio.run(closed_loop(server.url, body, args.max_num_seqs, args.warmup))
            result = asyncio.run(open_loop(server.url, body, capacity * args.overload, args.seconds, engine,
                                           args.seed))
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
        finally:
            server.stop()
    statuses = {int(k) if k.isdigit() else k for k in result["statuses"]}
    rss = result["engine_rss_mb"]
    figures = {
        "model": args.model, "capacity_rps": capacity, "overload": args.overload, **result,
        "queue_timeout_s": args.queue_timeout, "max_queued_requests": args.max_queued_requests,
        "only_allowed_statuses": statuses <= ALLOWED,
        "ttft_p99_within_queue_timeout": result["ttft_p99_s"] is not None
        and result["ttft_p99_s"] <= args.queue_timeout,
        "engine_rss_growth_mb": rss["end"] - rss["start"],
        "rejections": [line for line in metrics.splitlines() if line.startswith(("kvloom_engine_rejected",
                                                                                  "kvloom_engine_expired"))],
    }
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if figures["only_allowed_statuses"] and figures["ttft_p99_within_queue_timeout"] else 1


if __name__ == "__main__":
    sys.exit(main())
