"""What the HTTP frontend costs per streamed token, and so how many API workers a device needs.

An engine on a tiny model shape (dummy weights, SmolLM2's 49,152-token vocabulary and tokenizer) steps far
faster than any real model, so its API workers, not the engine, set the pace. This script serves it with
``--api-workers`` 1 (then any other counts given), loads it with ``engine bench serve`` (streams of
``--output-len`` tokens at ``--concurrency``), and reads the CPU time of every API-worker process and of
the engine from /proc over the load. It prints, per worker count: streamed tokens (SSE events) per second,
API-worker CPU microseconds per event, how busy the busiest worker was, and the engine's share; then how
many workers a device streaming E tokens/s needs at this host's cost per event (E from --device-tok-s,
e.g. the H200's offline 8B figure). Run it on the host that serves: the cost per event is that CPU's.

    python benchmarks/export_tokenizer.py            # once: .smollm2-tokenizer
    python benchmarks/frontend_cost.py --api-workers 1,2 --concurrency 64 --device-tok-s 10000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvloom.bench.ab import ServerProcess

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
            max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def role(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    if "kvloom.frontends.api_server" in cmd:
        return "api"
    if "engine_process" in cmd or "kvloom.core.engine" in cmd:
        return "engine"
    return "other"


def measure(args, model: Path, workers: int, out: Path) -> dict:
    server = ServerProcess(["--model", str(model), "--load-format", "dummy", "--tokenizer", args.tokenizer,
                            "--device", args.device, "--api-workers", str(workers),
                            "--max-num-seqs", str(max(args.concurrency, 8))], out / f"server_w{workers}.log")
    try:
        url = server.wait_ready(300)
        pids = {}
        for child in children(server.proc.pid):
            pids[child] = role(child)
        api = [p for p, r in pids.items() if r == "api"]
        engine = [p for p, r in pids.items() if r == "engine"]
        if len(api) != workers or len(engine) != 1:
            raise SystemExit(f"expected {workers} API workers and 1 engine under the launcher, found {pids}")
        result_json = out / f"bench_w{workers}.json"
        bench = [sys.executable, "-m", "kvloom.cli", "bench", "serve", "--base-url", url,
                 "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                 "--random-token-range", "1000:49000", "--concurrency", str(args.concurrency),
                 "--num-requests", str(args.num_requests), "--warmup-requests", "2", "--no-progress",
                 "--output-json", str(result_json)]
        before = {p: cpu_seconds(p) for p in api + engine}
        t0 = time.monotonic()
        done = subprocess.run(bench, capture_output=True, text=True, timeout=args.timeout)
        wall = time.monotonic() - t0
        after = {p: cpu_seconds(p) for p in api + engine}
        if done.returncode != 0:
            raise SystemExit(f"bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        level = json.loads(result_json.read_text())["levels"][0]
        # Each streamed token is one SSE event (no spec decoding here); the warm-up's few are in the CPU
        # time too, a small overcount of the cost per event.
        events = level["output_tokens"]
        api_cpu = [after[p] - before[p] for p in api]
        duration = level["duration_s"]
        return {
            "api_workers": workers, "concurrency": args.concurrency, "completed": level["completed"],
            "failed": level["failed"], "events": events, "duration_s": round(duration, 2),
            "events_per_s": round(events / duration, 1),
            "api_cpu_s": [round(c, 2) for c in api_cpu],
            "api_us_per_event": round(sum(api_cpu) / events * 1e6, 1),
            "busiest_api_worker": round(max(api_cpu) / wall, 3),
            "engine_cpu_s": round(after[engine[0]] - before[engine[0]], 2),
            "tpot_ms_p50": level["tpot_ms"]["p50"], "itl_ms_p50": level["itl_ms"]["p50"],
            "client_saturated": level.get("client_saturated"), "itl_burst_share": level.get("itl_burst_share"),
        }
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api-workers", default="1", help="Comma-separated worker counts to measure.")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--tokenizer", default=".smollm2-tokenizer")
    p.add_argument("--device", default="cpu", help="Where the tiny engine runs (cpu or cuda).")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--device-tok-s", type=float, default=10_000.0,
                   help="A device's streamed tokens per second, for the workers-needed line (the H200's "
                        "offline Llama-3-8B figure is about 10,000).")
    p.add_argument("--output", help="Write the JSON here too.")
    args = p.parse_args()
    if not Path(args.tokenizer, "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer at {args.tokenizer}: run python benchmarks/export_tokenizer.py first")
    out = Path(tempfile.mkdtemp(prefix="kvloom-frontend-cost-"))
    model = out / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    runs = [measure(args, model, int(w), out) for w in args.api_workers.split(",")]
    for r in runs:
        print(json.dumps(r))
    cost = min(r["api_us_per_event"] for r in runs) * 1e-6
    # A worker kept at most 70% busy leaves room for bursts and for the event loop to answer promptly.
    needed = math.ceil(args.device_tok_s * cost / 0.7)
    summary = {"benchmark": "frontend_cost", "host_cpus": len(os.sched_getaffinity(0)), "runs": runs,
               "api_us_per_event": round(cost * 1e6, 1), "device_tok_s": args.device_tok_s,
               "api_workers_needed_at_70pct": needed, "logs": str(out)}
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
