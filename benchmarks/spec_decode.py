"""Speculative decoding A/B in one run: output tok/s without speculation and with the ``spec_decode``
plugin on the same workload, their ratio, the acceptance figures, and whether the greedy outputs are
identical. Prints JSON.

CPU (default): SmolLM2-135M-Instruct, batch 1, a copy-heavy chat ("repeat this passage") over this
repository's own docs, ngram proposer:

    python benchmarks/spec_decode.py

GPU: dummy weights of a real shape, batch 1, and the benchmark-only ``replay`` proposer: a first pass
records the target's own greedy output, later passes propose it back corrupted at each ``--corrupt``
rate (each draft token replaced by a random one with that probability), giving speedup against
per-token acceptance. Dummy weights make n-gram acceptance near zero, so replay is what measures the
verification machinery at a known acceptance rate; it is not a real proposer:

    python benchmarks/spec_decode.py --shape llama-3-8b --proposer replay --corrupt 0,0.1,0.2,0.4 -k 4

The same copy-heavy workload under load, through the server (``--write-prompts`` writes it as jsonl,
one passage per request from a different part of the docs):

    python benchmarks/spec_decode.py --write-prompts /tmp/copy.jsonl --batch 32 --max-tokens 64
    engine bench ab --plugins '' --plugins spec_decode --workload jsonl --prompts-file /tmp/copy.jsonl \
        --endpoint chat --concurrency 8,32 --num-requests 32

The overhead where speculation cannot help: every draft rejected (``--corrupt 1``) with the adaptive
policy on, which should back off to plain (graphed, async) decode steps and probe rarely:

    python benchmarks/spec_decode.py --shape llama-3-8b --proposer replay --corrupt 1 -k 4 --adaptive on
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def passage(chars: int, start: int = 0) -> str:
    """Real prose from the repository's docs: docs/plugins.md from about character ``start``."""
    text = (REPO / "docs" / "plugins.md").read_text()
    body = " ".join(line for line in text.splitlines() if line and not line.startswith(("#", "|", "`", "-")))
    start = start % max(1, len(body) - chars)
    if start:
        start = body.find(" ", start) + 1
    return body[start: start + chars].rsplit(" ", 1)[0]


def copy_request(chars: int, start: int = 0) -> list[dict]:
    return [{"role": "user", "content": "Repeat the following passage exactly, word for word:\n\n"
             + passage(chars, start)}]


class ReplayProposer:
    """Benchmark only: proposes the target's recorded greedy continuation, each token replaced by a
    random other token with probability ``corrupt``."""

    name = "replay"

    def __init__(self, recorded: dict[tuple[int, ...], list[int]], k: int, corrupt: float, vocab: int, seed: int = 0):
        self.recorded, self.num_speculative_tokens = recorded, k
        self.corrupt, self.vocab, self.rng = corrupt, vocab, random.Random(seed)

    def propose(self, requests):
        out = {}
        for r in requests:
            ref = self.recorded.get(tuple(r.prompt_token_ids), [])
            pos = r.num_output_tokens
            drafts = []
            for t in ref[pos: pos + self.num_speculative_tokens]:
                if self.rng.random() < self.corrupt:
                    t = (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                drafts.append(t)
            out[r.request_id] = drafts
        return out


def run(llm, prompts, max_tokens: int) -> dict:
    from kvloom import SamplingParams

    before = llm.engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    accepted = after.spec_decode_num_accepted - before.spec_decode_num_accepted
    steps = after.spec_decode_num_steps - before.spec_decode_num_steps
    return {
        "output_tokens": tokens, "seconds": round(elapsed, 3), "output_tok_s": round(tokens / elapsed, 2),
        "draft_tokens": drafts, "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0,
        "mean_acceptance_length": round(1 + accepted / steps, 3) if steps else 0.0, "spec_steps": steps,
        "token_ids": [o.token_ids for o in outs],
    }


def pooled(runs: list[dict]) -> dict:
    """Totals over alternated runs of one side (tok/s over the summed time), and each run's tok/s."""
    tokens, seconds = sum(r["output_tokens"] for r in runs), sum(r["seconds"] for r in runs)
    drafts, accepted = sum(r["draft_tokens"] for r in runs), sum(r["accepted_tokens"] for r in runs)
    steps = sum(r["spec_steps"] for r in runs)
    out = {"output_tokens": tokens, "seconds": round(seconds, 3), "output_tok_s": round(tokens / seconds, 2),
           "draft_tokens": drafts, "accepted_tokens": accepted,
           "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0,
           "mean_acceptance_length": round(1 + accepted / steps, 3) if steps else 0.0}
    if len(runs) > 1:
        out["output_tok_s_per_run"] = [r["output_tok_s"] for r in runs]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model (default: SmolLM2-135M-Instruct).")
    p.add_argument("--shape", default=None, help="A dummy-weight shape from benchmarks/shapes.py (GPU mode).")
    p.add_argument("--proposer", default="ngram", choices=("ngram", "replay"))
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--corrupt", default="0.2", help="replay: comma-separated corruption rates.")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--passage-chars", type=int, default=700)
    p.add_argument("--prompt-len", type=int, default=128, help="Prompt tokens with --shape (random ids).")
    p.add_argument("--adaptive", default="auto", choices=("auto", "on", "off"),
                   help="The adaptive policy (auto: on for ngram, off for replay, which measures verification).")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of the engine (default: its own).")
    p.add_argument("--repeats", type=int, default=1,
                   help="Timed runs of each side, alternated (baseline, speculation, baseline, ...) so that a slow "
                        "spell of a shared machine hits both; figures are the totals over the runs.")
    p.add_argument("--output", default=None, help="Also write the JSON here.")
    p.add_argument("--write-prompts", metavar="FILE.jsonl", default=None,
                   help="Only write --batch copy requests (messages, output_len=--max-tokens) for engine bench.")
    args = p.parse_args()
    if args.write_prompts:
        with open(args.write_prompts, "w") as f:
            for i in range(args.batch):
                f.write(json.dumps({"messages": copy_request(args.passage_chars, 997 * i),
                                    "output_len": args.max_tokens}) + "\n")
        return

    import torch

    from kvloom import LLM
    from shapes import model_for_benchmark

    model, load_format, vocab = model_for_benchmark(args.model, args.shape)
    common = dict(load_format=load_format, dtype=args.dtype, enforce_eager=args.enforce_eager,
                  max_num_seqs=max(8, args.batch), max_model_len=args.max_model_len, threads=args.threads)
    spec_options = {"spec_decode": {"num_speculative_tokens": args.num_speculative_tokens,
                                    "adaptive": args.adaptive == "on" or (args.adaptive == "auto"
                                                                          and args.proposer == "ngram")}}
    # One engine for both runs (the same weights and KV cache): the baseline runs with its speculator
    # switched off, which is exactly the engine without the plugin.
    spec = LLM(model, plugins=["spec_decode"], plugin_options=spec_options, **common)
    speculator = spec.engine.speculator
    if args.shape:
        rng = random.Random(0)
        prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    else:
        from kvloom.frontends.text import apply_chat_template

        ids = apply_chat_template(spec.tokenizer, copy_request(args.passage_chars), True)
        prompts = [ids] * args.batch
    rates = [float(r) for r in args.corrupt.split(",")] if args.proposer == "replay" else [None]
    spec.engine.speculator = None
    run(spec, [prompts[0]], 8)  # warm-up
    base_runs = [run(spec, prompts, args.max_tokens)]
    spec.engine.speculator = speculator
    recorded = {tuple(pr): out for pr, out in zip(prompts, base_runs[0]["token_ids"])}
    runs: dict = {rate: [] for rate in rates}
    for i in range(args.repeats):
        if i:  # alternate: a baseline run between speculation runs
            spec.engine.speculator = None
            base_runs.append(run(spec, prompts, args.max_tokens))
            spec.engine.speculator = speculator
        for rate in rates:
            if rate is not None:
                spec.engine.speculator.proposer = ReplayProposer(recorded, args.num_speculative_tokens, rate, vocab)
            if not i:
                run(spec, [prompts[0]], 8)  # warm-up of the verify path
            runs[rate].append(run(spec, prompts, args.max_tokens))
    base = pooled(base_runs)
    result = {
        "benchmark": "spec_decode", "model": args.shape or model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": str(spec.engine.dtype).removeprefix("torch."), "batch": args.batch, "max_tokens": args.max_tokens,
        "prompt_tokens": len(prompts[0]), "proposer": args.proposer, "k": args.num_speculative_tokens,
        "adaptive": spec_options["spec_decode"]["adaptive"], "cuda_graphs": len(spec.engine.runner.graphs),
        "threads": args.threads, "repeats": args.repeats, "baseline": base, "runs": [],
    }
    for rate in rates:
        row = pooled(runs[rate])
        row.update(corrupt=rate, speedup=round(row["output_tok_s"] / base["output_tok_s"], 3),
                   identical_output=all(r["token_ids"] == base_runs[0]["token_ids"] for r in runs[rate] + base_runs))
        if args.repeats > 1:  # each speculation run against the baseline run before it
            row["speedup_per_repeat"] = [round(r["output_tok_s"] / b["output_tok_s"], 3)
                                         for r, b in zip(runs[rate], base_runs)]
        result["runs"].append(row)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
