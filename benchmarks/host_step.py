"""The engine's host work per step of a large batch: scheduling, the runner's inputs, advancing the
requests, applying the sampled tokens and the offline loop, without the model's own compute.

On a GPU a decode step of a few hundred requests takes about 10 ms of device time (Llama-3-8B shape,
fp8), and the host must plan and launch the next step within it (async scheduling) or the device waits.
This runs an offline workload on a tiny model on the CPU, times the engine's functions and subtracts
the forward, the logits and the sampler's compute, so what is left is the per-request Python that
grows with the batch. ``--against DIR`` runs the same in another checkout (its kvloom on the path) in
alternated subprocesses and prints the ratio, since timings on a shared CPU are noisy.

    python benchmarks/host_step.py --num-requests 256 --prompt-len 512 --output-len 256
    python benchmarks/host_step.py --against ../main-before --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
            max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)

# (owner attribute path, function name, label): the engine's host parts, and the compute to subtract.
PARTS = [
    ("scheduler", "schedule", "schedule"),
    ("runner", "execute", "execute"),
    ("scheduler", "advance", "advance"),
    ("", "_update", "update"),
    ("", "step", "engine step"),
]
COMPUTE = [("runner.model", "forward", "forward"), ("runner.model", "compute_logits", "logits"),
           ("runner.sampler", "sample", "sample")]


def measure(args) -> dict:
    """One pass in this process: per-step milliseconds of each part over the timed generate."""
    import kvloom
    from kvloom import LLM, SamplingParams

    folder = Path(tempfile.gettempdir()) / "kvloom-host-step"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    llm = LLM(str(folder), load_format="dummy", dtype="float32", max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, TINY["vocab_size"] - 10) for _ in range(args.prompt_len)]
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    engine = llm.engine
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                totals[label] += time.perf_counter() - t0
        setattr(owner, name, wrapper)

    def owner_of(path: str):
        obj = engine
        for attr in filter(None, path.split(".")):
            obj = getattr(obj, attr)
        return obj

    for path, name, label in PARTS + COMPUTE:
        timed(owner_of(path), name, label)
    steps_before = engine.scheduler._step_id
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = engine.scheduler._step_id - steps_before
    compute = sum(totals[label] for _, _, label in COMPUTE)
    ms = {label: 1e3 * v / steps for label, v in totals.items()}
    ms["execute without compute"] = 1e3 * (totals["execute"] - compute) / steps
    ms["host (wall without compute)"] = 1e3 * (wall - compute) / steps
    return {"kvloom": str(Path(kvloom.__file__).parent), "steps": steps, "wall_s": wall,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "ms_per_step": ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--against", default=None, help="Another checkout's folder: run the same there, alternated.")
    p.add_argument("--rounds", type=int, default=3, help="Alternated passes of each build (with --against).")
    p.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)  # a subprocess's single pass
    p.add_argument("--output", default=None, help="Write the figures as JSON here.")
    args = p.parse_args()
    if args.one_pass:
        print(json.dumps(measure(args)))
        return
    builds = {"this": str(Path(__file__).resolve().parents[1])}
    if args.against:
        builds["against"] = str(Path(args.against).resolve())
    flags = [f"--num-requests={args.num_requests}", f"--prompt-len={args.prompt_len}",
             f"--output-len={args.output_len}", f"--max-num-batched-tokens={args.max_num_batched_tokens}"]
    runs: dict[str, list[dict]] = {b: [] for b in builds}
    for i in range(args.rounds if args.against else 1):
        for build, root in (builds.items() if i % 2 == 0 else reversed(builds.items())):  # alternate who goes first
            env = dict(os.environ, PYTHONPATH=root)
            out = subprocess.run([sys.executable, __file__, "--one-pass", *flags], env=env, cwd=root,
                                 capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            if not run["kvloom"].startswith(root):
                raise SystemExit(f"the {build} pass imported kvloom from {run['kvloom']}, not from {root}")
            runs[build].append(run)
    result = {"workload": f"{args.num_requests} x ({args.prompt_len} + {args.output_len}), tiny Llama, CPU",
              "builds": builds, "median_ms_per_step": {}}
    for build, passes in runs.items():
        labels = passes[0]["ms_per_step"]
        result["median_ms_per_step"][build] = {k: round(statistics.median(r["ms_per_step"][k] for r in passes), 3)
                                               for k in labels}
    print(f"{result['workload']}, {runs['this'][0]['steps']} steps; milliseconds a step (median of "
          f"{len(runs['this'])} pass(es) each):")
    names = list(result["median_ms_per_step"]["this"])
    head = f"{'':30s}" + "".join(f"{b:>10s}" for b in builds) + ("     ratio" if args.against else "")
    print(head)
    for name in names:
        row = [result["median_ms_per_step"][b][name] for b in builds]
        ratio = f"{row[1] / row[0]:9.2f}x" if args.against and row[0] else ""
        print(f"{name:30s}" + "".join(f"{v:10.3f}" for v in row) + ratio)
    if args.against:
        key = "host (wall without compute)"
        result["host_ratio_against_over_this"] = round(result["median_ms_per_step"]["against"][key]
                                                        / result["median_ms_per_step"]["this"][key], 3)
    if args.output:
        Path(args.output).write_text(json.dumps({**result, "passes": runs}, indent=1))


if __name__ == "__main__":
    main()
