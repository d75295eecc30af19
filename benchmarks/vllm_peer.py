"""kvloom's server against vLLM's (its CPU build, a peer in its own virtualenv) on the same model folder
and the same `engine bench serve` load, the servers started in turn and alternated; prints JSON with
both and the ratio at each level.

    ../shared/tools/vllm-cpu-peer.sh                # once: the vLLM virtualenv (prints its python)
    python benchmarks/gguf_to_hf.py                 # once: SmolLM2 as a safetensors folder
    python benchmarks/vllm_peer.py                  # concurrency 1, 8, 32; 128 prompt + 64 output tokens
    python benchmarks/vllm_peer.py --busy-core 1    # the same while a busy loop holds core 1

Only one server runs at a time (both would share this machine's cores); each is stopped before the
next starts, and the order alternates between rounds (vLLM, kvloom, then kvloom, vLLM, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_to_hf import DEFAULT_FOLDER, export  # noqa: E402

VLLM_PYTHON = Path.home() / ".cache" / "kvloom-vllm-peer" / "bin" / "python"
BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
FIGURES = ("output_throughput", "request_throughput")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, args, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
        env.pop("PYTHONPATH", None)  # vLLM's own virtualenv, nothing of ours
        return ([str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
                 "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
                 "--max-model-len", str(args.max_model_len), *args.vllm_arg], env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return ([sys.executable, "-m", "kvloom.cli", "--model", str(args.model), "--host", "127.0.0.1", "--port",
             str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
             "--kv-cache-memory-gib", str(args.kv_cache_gib), *args.kvloom_arg], env)


def start(engine: str, args, log_dir: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    cmd, env = server_command(engine, args, port)
    log = log_dir / f"{engine}-{port}.log"
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{engine} exited with {proc.returncode}; its log ({log}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"{engine} not healthy within {args.start_timeout:g}s; its log: {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this server leads (vLLM has child processes)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(url: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kvloom.cli", "bench", "serve", "--base-url", url, "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--concurrency", args.concurrency, "--num-requests",
           str(args.num_requests), "--warmup-requests", "2", "--no-progress", "--output-json", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench serve against {url} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def engines_to_run(args) -> list[str]:
    """``--engines`` as a list, once vLLM's virtualenv and the model folder are there."""
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "vllm" in engines and not args.vllm_python.exists():
        raise SystemExit(f"no vLLM virtualenv at {args.vllm_python}: run ../shared/tools/vllm-cpu-peer.sh first")
    export(args.model, args.dtype)
    return engines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_FOLDER, help="A Hugging Face folder (made if missing).")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=64, help="Per level.")
    p.add_argument("--rounds", type=int, default=1, help="Each server's runs; the order alternates per round.")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of each server (vLLM takes whole GiB).")
    p.add_argument("--busy-core", type=int, help="Keep this core busy with a spinning process during the loads.")
    p.add_argument("--start-timeout", type=float, default=1200.0,
                   help="Seconds for a server to start (vLLM compiles its model on a first start: minutes).")
    p.add_argument("--engines", default="vllm,kvloom", help="Which servers to run (the first is each ratio's base).")
    p.add_argument("--vllm-arg", action="append", default=[], help="An extra flag for vLLM's server (repeat).")
    p.add_argument("--kvloom-arg", action="append", default=[], help="An extra flag for kvloom's server (repeat).")
    p.add_argument("--output-json", help="Also write the JSON here.")
    args = p.parse_args()
    engines = engines_to_run(args)
    log_dir = Path(tempfile.mkdtemp(prefix="kvloom-vllm-peer-"))
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for rnd in range(args.rounds):
        for engine in engines if rnd % 2 == 0 else engines[::-1]:
            proc, url, log = start(engine, args, log_dir)
            busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy_core)]) \
                if args.busy_core is not None else None
            try:
                result = bench(url, args, log_dir / f"{engine}-{rnd}.json")
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
                stop(proc)
            runs[engine].append(result)
            print(f"[round {rnd}] {engine}: " + ", ".join(
                f"c={lv['level']['concurrency']} {lv['output_throughput']:.1f} tok/s" for lv in result["levels"]),
                file=sys.stderr, flush=True)
    levels = []
    for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
        row = {"concurrency": c}
        for e in engines:
            lvs = [r["levels"][i] for r in runs[e]]
            row[e] = {"output_throughput": statistics.median(lv["output_throughput"] for lv in lvs),
                      "runs_output_throughput": [round(lv["output_throughput"], 1) for lv in lvs],
                      **{f"{m}_p50": statistics.median(lv[m]["p50"] for lv in lvs) for m in LATENCIES},
                      "client_saturated": any(lv["client_saturated"] for lv in lvs)}
        base = engines[0]
        for e in engines[1:]:
            row[f"{e}_over_{base}"] = round(row[e]["output_throughput"] / row[base]["output_throughput"], 3)
        levels.append(row)
    result = {"benchmark": "vllm_peer", "model": str(args.model), "dtype": args.dtype,
              "workload": f"{args.num_requests} x ({args.input_len} + {args.output_len}) per level",
              "busy_core": args.busy_core, "rounds": args.rounds, "logs": str(log_dir), "levels": levels}
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(text + "\n")
    for row in levels:
        print(f"concurrency {row['concurrency']:3d}: " + "  ".join(
            f"{e} {row[e]['output_throughput']:7.1f} tok/s" for e in engines) + "  " + "  ".join(
            f"{k} {v:.2f}x" for k, v in row.items() if k.endswith(f"_over_{engines[0]}")), file=sys.stderr)


if __name__ == "__main__":
    main()
