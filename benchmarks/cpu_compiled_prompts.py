"""Steps holding prompts on the CPU, compiled (``kvloom.core.worker.cpu_compile.CompiledPrompts``) against eager, in
one engine: N prompts of 128 tokens with one output token each (the prefill alone), the two ways alternated
round by round on the same loaded model, medians and their ratio printed.

    python benchmarks/cpu_compiled_prompts.py                       # SmolLM2-135M-Instruct Q4_1, 1, 8, 32 prompts
    python benchmarks/cpu_compiled_prompts.py --prompts 8 --rounds 6 --model path/to/model
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvloom import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", default="1,8,32", help="prompts a run (comma-separated)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=512)
    runner = llm.engine.runner
    compiled = runner.compiled_prompts
    if compiled is None:
        raise SystemExit("this engine does not compile its prompt steps (see the start-up log)")
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    results = []
    for n in (int(v) for v in args.prompts.split(",")):
        prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(n)]
        times = {"eager": [], "compiled": []}
        for way in times:  # warm both (the first eager run pays oneDNN's primitive creation)
            runner.compiled_prompts = compiled if way == "compiled" else None
            llm.generate(prompts, params, use_tqdm=False)
        for r in range(args.rounds):
            for way in (list(times) if r % 2 == 0 else list(times)[::-1]):
                runner.compiled_prompts = compiled if way == "compiled" else None
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[way].append((time.perf_counter() - t0) * 1e3)
        med = {way: statistics.median(v) for way, v in times.items()}
        row = {"prompts": n, "prompt_len": args.prompt_len, **{f"{w}_ms": round(m, 1) for w, m in med.items()},
               "runs_ms": {w: [round(x, 1) for x in v] for w, v in times.items()},
               "compiled_over_eager": round(med["compiled"] / med["eager"], 3)}
        results.append(row)
        print(f"{n:3d} x {args.prompt_len}: eager {med['eager']:8.1f} ms  compiled {med['compiled']:8.1f} ms  "
              f"compiled / eager {row['compiled_over_eager']:.2f}", flush=True)
    runner.compiled_prompts = compiled
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "rounds": args.rounds, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
