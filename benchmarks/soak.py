"""Soak a kvloom server (started here, with the ZMQ gateway) under steady mixed load and report each
process's memory: RSS (and its anonymous part, ``NAME_anon``) of the launcher, the engine, every API
worker and the gateway every ``--sample-s`` seconds, and the slope of the last ``--slope-minutes`` (MB per
minute, least squares, with its standard error: ``flat_within_noise`` when it is within two of zero or
under 1 MB over the window).

    python benchmarks/soak.py                      # SmolLM2 (the default model), 30 minutes
    python benchmarks/soak.py --minutes 6 --out benchmarks/results/soak.json
    python benchmarks/soak.py --report benchmarks/results/soak.json --slope-minutes 5   # refit a saved run

The load, from ``--http-clients`` HTTP clients and ``--gateway-clients`` gateway clients, each one
request at a time: streamed and whole chat and text completions, ``n`` = 2, logprobs, streams closed
after a few chunks (aborts), gateway streams cancelled and gateway clients that disconnect mid-stream.
Prompts vary in length (10 to ~300 tokens), so the engine's batches vary in shape. It prints the
figures as JSON; the exit status is 1 when any request got a 5xx, a transport error or no answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while Paris sleeps and numbers like 1234 or 3.14 "
         "pass by in café light under 東京 rain").split()
PROCESSES = {"engine": "kvloom.launch.engine_process", "api": "kvloom.frontends.api_server",
             "gateway": "kvloom.frontends.gateway"}


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """A process's resident memory in MB: all of it (VmRSS), or RssAnon, its anonymous part, without the
    file pages (code, mapped weights) that the kernel drops and reads back as the machine needs."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def server_processes(root: int) -> dict[str, int]:
    """{name: pid} of the launcher and its children: ``engine``, ``api0``, ``api1``..., ``gateway``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo, apis = {"launcher": root}, list(children.get(root, [])), 0
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for name, module in PROCESSES.items():
            if module in cmd:
                if name == "api":
                    name, apis = f"api{apis}", apis + 1
                found[name] = pid
        todo.extend(children.get(pid, []))
    return found


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    return slope_fit(samples)[0]


def slope_fit(samples: list[tuple[float, float]]) -> tuple[float | None, float | None, float | None]:
    """Least-squares slope of (seconds, MB) samples in MB per minute, its standard error, and the
    residuals' standard deviation in MB (the samples' swing around the line)."""
    n = len(samples)
    if n < 2:
        return None, None, None
    mean_t = sum(t for t, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return None, None, None
    slope = sum((t - mean_t) * (y - mean_y) for t, y in samples) / var
    residuals = [y - mean_y - slope * (t - mean_t) for t, y in samples]
    if n < 3:
        return 60 * slope, None, None
    sd = (sum(r * r for r in residuals) / (n - 2)) ** 0.5
    return 60 * slope, 60 * sd / var ** 0.5, sd


def rss_figures(rows: list[dict], names, slope_minutes: float) -> dict:
    """Per process: start, end and max RSS, and the fit of the last ``slope_minutes``; flat when the slope
    is within two standard errors of zero (its drift is not told apart from the samples' swing) or drifts
    less than 1 MB over the window."""
    window = rows[-1]["t"] - slope_minutes * 60
    figures = {}
    for name in names:
        series = [(r["t"], r[name]) for r in rows if r.get(name) is not None]
        last = [(t, mb) for t, mb in series if t >= window]
        slope, stderr, sd = slope_fit(last)
        figures[name] = {"start_mb": series[0][1], "end_mb": series[-1][1], "max_mb": max(mb for _, mb in series),
                         "slope_mb_per_min_last_window": slope, "slope_stderr_mb_per_min": stderr,
                         "residual_sd_mb_last_window": sd,
                         "flat_within_noise": None if stderr is None else (abs(slope) <= 2 * stderr
                                                                            or abs(slope) * slope_minutes < 1.0),
                         "mean_mb_last_window": sum(mb for _, mb in last) / len(last)}
    return figures


class Sampler(threading.Thread):
    """Every process's RSS every ``period`` seconds (and once at the start)."""

    def __init__(self, pids: dict[str, int], period: float) -> None:
        super().__init__(daemon=True)
        self.pids, self.period = pids, period
        self.rows: list[dict] = []
        self.stopped = threading.Event()
        self.start_time = time.monotonic()

    def sample(self) -> None:
        row = {"t": round(time.monotonic() - self.start_time, 1)}
        row.update({name: rss_mb(pid) for name, pid in self.pids.items()})
        row.update({f"{name}_anon": rss_mb(pid, "RssAnon") for name, pid in self.pids.items()})
        self.rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    def run(self) -> None:
        self.sample()
        while not self.stopped.wait(self.period):
            self.sample()


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice([8, 30, 80, 200])))


async def http_client(url: str, model: str, rng: random.Random, until: float, outcomes: Counter) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < until:
            kind = rng.choices(["chat_stream", "completion_n2", "abort", "chat", "logprobs"],
                               [40, 20, 15, 15, 10])[0]
            max_tokens = rng.choice([16, 32, 64])
            text = prompt(rng)
            try:
                if kind in ("chat_stream", "chat"):
                    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                            "stream": kind == "chat_stream", "temperature": rng.choice([0.0, 0.8])}
                    path = "/v1/chat/completions"
                else:
                    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0.8,
                            "stream": kind == "abort", "n": 2 if kind == "completion_n2" else 1}
                    if kind == "logprobs":
                        body["logprobs"] = 3
                    path = "/v1/completions"
                async with http.stream("POST", path, json=body) as r:
                    if kind == "abort" and r.status_code == 200:
                        chunks = 0
                        async for _ in r.aiter_lines():
                            chunks += 1
                            if chunks >= 3:
                                break  # closing the response aborts the request
                    else:
                        await r.aread()
                outcomes[f"http {kind} {r.status_code}"] += 1
            except httpx.HTTPError as e:
                outcomes[f"http {kind} transport error {type(e).__name__}"] += 1


async def gateway_client(address: str, rng: random.Random, until: float, outcomes: Counter) -> None:
    from kvloom.client import AsyncClient, GatewayError

    client = AsyncClient(address, timeout=300)
    try:
        while time.monotonic() < until:
            kind = rng.choices(["stream", "cancel", "disconnect"], [70, 20, 10])[0]
            sampling = {"max_tokens": rng.choice([16, 32, 64]), "temperature": 0.8}
            user = client if kind != "disconnect" else AsyncClient(address, timeout=300)
            try:
                chunks = 0
                async for chunk in user.stream(prompt(rng), **sampling):
                    chunks += 1
                    if kind != "stream" and chunks >= 3:
                        break  # "cancel" sends Cancel; "disconnect" closes the socket below
                outcomes[f"gateway {kind} ok"] += 1
            except GatewayError as e:
                outcomes[f"gateway {kind} {e.status}"] += 1
            except TimeoutError:
                outcomes[f"gateway {kind} no answer"] += 1
            finally:
                if user is not client:
                    await user.close()
    finally:
        await client.close()


async def load(url: str, model: str, gateway: str, args, outcomes: Counter) -> None:
    until = time.monotonic() + args.minutes * 60
    rng = random.Random(args.seed)
    await asyncio.gather(
        *(http_client(url, model, random.Random(rng.random()), until, outcomes) for _ in range(args.http_clients)),
        *(gateway_client(gateway, random.Random(rng.random()), until, outcomes) for _ in range(args.gateway_clients)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Model to serve (default: SmolLM2-135M-Instruct, kvloom's default model).")
    parser.add_argument("--minutes", type=float, default=30.0, help="Length of the load.")
    parser.add_argument("--sample-s", type=float, default=30.0, help="Seconds between RSS samples.")
    parser.add_argument("--slope-minutes", type=float, default=10.0, help="The slope is fitted over these last minutes.")
    parser.add_argument("--http-clients", type=int, default=8)
    parser.add_argument("--gateway-clients", type=int, default=2)
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                        help="An extra flag for the server, e.g. --engine-arg=--max-num-seqs=16 (repeatable).")
    parser.add_argument("--out", help="Also write the figures to this JSON file.")
    parser.add_argument("--report", metavar="JSON",
                        help="Run nothing: print the RSS figures of a saved run's samples (this --slope-minutes).")
    args = parser.parse_args(argv)
    if args.report:
        rows = json.loads(Path(args.report).read_text())["samples"]
        names = [k for k in rows[0] if k != "t"]
        print(json.dumps(rss_figures(rows, names, args.slope_minutes), indent=2))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvloom.bench.ab import ServerProcess

    model = args.model
    if model is None:
        from kvloom.core.model.files import default_model_path

        model = str(default_model_path())
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        gateway = f"ipc://{tmp}/gw.sock"
        server = ServerProcess(["--model", model, "--gateway", gateway, "--api-workers", str(args.api_workers),
                                "--no-log-requests", *args.engine_arg], Path(tmp) / "server.log")
        try:
            url = server.wait_ready(900)
            served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            sampler = Sampler(server_processes(server.proc.pid), args.sample_s)
            sampler.start()
            started = time.time()
            asyncio.run(load(url, served, gateway, args, outcomes))
            sampler.sample()
            sampler.stopped.set()
            sampler.join()
            metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(url + "/metrics", timeout=30)
                       .text.splitlines() if line.startswith(("kvloom_kv_cache_free_blocks",
                                                               "kvloom_kv_cache_total_blocks"))}
            log = server.log()
        finally:
            server.stop()
    rows = sampler.rows
    figures = rss_figures(rows, [k for k in rows[0] if k != "t"], args.slope_minutes)
    failures = {k: v for k, v in outcomes.items() if " 5" in k or "transport" in k or "no answer" in k}
    report = {"model": model, "date": time.strftime("%Y-%m-%d", time.localtime(started)), "minutes": args.minutes,
              "slope_window_minutes": min(args.slope_minutes, rows[-1]["t"] / 60), "sample_s": args.sample_s,
              "http_clients": args.http_clients, "gateway_clients": args.gateway_clients,
              "api_workers": args.api_workers, "engine_args": args.engine_arg, "rss": figures,
              "requests": dict(sorted(outcomes.items())), "failures": failures, "samples": rows,
              "kv_blocks_free_at_end": metrics, "tracebacks_in_log": log.count("Traceback")}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failures or report["tracebacks_in_log"] else 0


if __name__ == "__main__":
    sys.exit(main())
