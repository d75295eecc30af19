"""Offline throughput, kvloom's ``LLM`` against vLLM's (its CPU build, in its own virtualenv), on the same
safetensors folder and the same token-id prompts; each engine runs in its own process in turn (never both
at once), the order alternating between rounds; prints JSON with every pass and the ratio.

    ../shared/tools/vllm-cpu-peer.sh                 # once: the vLLM virtualenv
    python benchmarks/gguf_to_hf.py                  # once: SmolLM2 as a safetensors folder
    python benchmarks/vllm_offline_peer.py           # 32 x (128 + 64), greedy, ignore_eos

Each engine is loaded once per round, warmed up on the same prompts with two output tokens, then timed
over ``--repeat`` passes (the median is its figure for the round). vLLM's OpenMP threads are bound to every core
(``VLLM_CPU_OMP_THREADS_BIND``, ``--vllm-cores``); unbound, its CPU build computes on one.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_to_hf import DEFAULT_FOLDER  # noqa: E402
from vllm_peer import VLLM_PYTHON, engines_to_run  # noqa: E402

# Run by each engine's python with: model folder, dtype, max_model_len, kv GiB, repeat, workload JSON path.
# vLLM starts worker processes by spawning, so its LLM must be made under `if __name__ == "__main__"`.
CHILD = r'''
import json, sys, time
model, dtype, max_len, kv_gib, repeat, path = sys.argv[1:7]
work = json.load(open(path))
prompts, outputs = work["prompts"], work["outputs"]

def run_vllm():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=model, dtype=dtype, max_model_len=int(max_len), seed=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    def once(n_out):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in n_out]
        outs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return once

def run_kvloom():
    from kvloom import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, max_model_len=int(max_len), kv_cache_memory_gib=float(kv_gib))
    def once(n_out):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in n_out]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.token_ids) for o in outs)
    return once

if __name__ == "__main__":
    once = run_vllm() if work["engine"] == "vllm" else run_kvloom()
    once([2] * len(prompts))  # warm-up: every step shape the passes will see
    times = []
    for _ in range(int(repeat)):
        t0 = time.perf_counter()
        n = once(outputs)
        times.append(time.perf_counter() - t0)
        if n != sum(outputs):
            raise SystemExit(f"{work['engine']} produced {n} tokens, {sum(outputs)} were asked for")
    print("RESULT " + json.dumps({"times": times}), flush=True)
'''


def run_engine(engine: str, args, work: dict, tmp: Path) -> list[float]:
    path = tmp / f"work-{engine}.json"
    path.write_text(json.dumps({**work, "engine": engine}))
    script = tmp / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    if engine == "vllm":
        python = str(args.vllm_python)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.kv_cache_gib))
        # its CPU build otherwise keeps a core for a frontend the offline API does not run: one core computes
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cores or f"0-{len(os.sched_getaffinity(0)) - 1}"
        env.pop("PYTHONPATH", None)  # vLLM's own virtualenv, nothing of ours
    else:
        python = sys.executable
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [python, str(script), str(args.model), args.dtype, str(args.max_model_len), str(args.kv_cache_gib),
           str(args.repeat), str(path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["times"]
    raise SystemExit(f"{engine} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_FOLDER, help="A Hugging Face folder (made if missing).")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--vllm-cores", help="VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N).")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="Timed passes per engine per round.")
    p.add_argument("--rounds", type=int, default=2, help="The order alternates per round.")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--engines", default="vllm,kvloom", help="Which engines to run (the first is the ratio's base).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", help="Also write the JSON here.")
    args = p.parse_args()
    engines = engines_to_run(args)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    work = {"prompts": [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)] for _ in range(args.num_requests)],
            "outputs": [args.output_len] * args.num_requests}
    tmp = Path(tempfile.mkdtemp(prefix="kvloom-vllm-offline-"))
    times: dict[str, list[float]] = {e: [] for e in engines}
    for rnd in range(args.rounds):
        for engine in engines if rnd % 2 == 0 else engines[::-1]:
            t = run_engine(engine, args, work, tmp)
            times[engine] += t
            print(f"[round {rnd}] {engine}: " + ", ".join(f"{sum(work['outputs']) / x:.1f}" for x in t) + " output tok/s",
                  file=sys.stderr, flush=True)
    n_out = sum(work["outputs"])
    result = {"benchmark": "vllm_offline_peer", "model": str(args.model), "dtype": args.dtype,
              "workload": f"{args.num_requests} x ({args.input_len} + {args.output_len})", "rounds": args.rounds,
              "repeat": args.repeat}
    for e in engines:
        result[e] = {"output_tok_s": n_out / statistics.median(times[e]),
                     "runs_output_tok_s": [round(n_out / x, 1) for x in times[e]]}
    for e in engines[1:]:
        result[f"{e}_over_{engines[0]}"] = round(result[e]["output_tok_s"] / result[engines[0]]["output_tok_s"], 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
