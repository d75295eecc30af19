"""A/B benchmark of the prefix_cache plugin: one shared-system-prompt workload through ``kvloom.LLM``
without and with prefix caching, in one run. Prints JSON: TTFT (mean, p50) and throughput of each run
and their ratios.

    python benchmarks/prefix_cache_ab.py                      # SmolLM2-135M-Instruct on this machine
    python benchmarks/prefix_cache_ab.py --model PATH --num-requests 64 --system-tokens 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from kvloom import LLM, SamplingParams
from kvloom.core.config import DEFAULT_MODEL

TOPICS = ["billing", "shipping", "returns", "warranty", "accounts", "privacy", "discounts", "repairs"]
POLICY = (
    "You are the support assistant of Loomworks, a company that sells handmade looms and weaving supplies. "
    "Answer politely and concisely. Orders ship within {n} business days from our workshop. Returns are "
    "accepted within {m} days if the item is unused. Warranty covers manufacturing defects for {n} years. "
    "Never share customer data. Escalate legal questions to a human. Section {i} of the handbook applies. "
)


def system_prompt(tokenizer, num_tokens: int) -> str:
    """A support-handbook system prompt cut to ``num_tokens`` tokens."""
    text, i = "", 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += POLICY.format(n=2 + i % 5, m=14 + i, i=i)
        i += 1
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:num_tokens])


def question(tokenizer, i: int, num_tokens: int) -> str:
    """A distinct question of about ``num_tokens`` tokens."""
    text = (f"Customer #{1000 + 37 * i} asks about {TOPICS[i % len(TOPICS)]}: order {i * 7919 % 100000} "
            f"placed {i % 28 + 1} days ago, item {i % 13} of {i % 5 + 1}. What should they do next, and why?")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


def run(args, plugins: list[str]) -> dict:
    llm = LLM(args.model, plugins=plugins, block_size=args.block_size,
              max_num_batched_tokens=args.max_num_batched_tokens)
    tok = llm.tokenizer
    system = system_prompt(tok, args.system_tokens)
    conversations = [[{"role": "system", "content": system},
                      {"role": "user", "content": question(tok, i, args.question_tokens)}]
                     for i in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate(["Warm-up: hello there"], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.engine.reset_prefix_cache()
    before = llm.engine.stats()

    start = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    stats = llm.engine.stats()
    ttfts = [o.metrics.ttft for o in outs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(o.token_ids) for o in outs)
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    result = {
        "plugins": plugins,
        "requests": len(outs),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "prefix_cache_hit_rate": (stats.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "requests_per_s": len(outs) / elapsed,
    }
    token_ids = [o.token_ids for o in outs]
    del llm, outs
    gc.collect()
    return result | {"_token_ids": token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=400, help="Tokens of the shared system prompt.")
    parser.add_argument("--question-tokens", type=int, default=30, help="Tokens of each distinct question.")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    off = run(args, [])
    on = run(args, ["prefix_cache"])
    off_ids, on_ids = off.pop("_token_ids"), on.pop("_token_ids")
    differ = sum(a != b for a, b in zip(off_ids, on_ids))
    report = {
        "workload": {k: getattr(args, k) for k in ("model", "num_requests", "system_tokens", "question_tokens",
                                                   "output_tokens", "block_size", "max_num_batched_tokens")},
        "without_prefix_cache": off,
        "with_prefix_cache": on,
        "ratio_with_over_without": {
            "ttft_mean": on["ttft_mean_s"] / off["ttft_mean_s"],
            "ttft_p50": on["ttft_p50_s"] / off["ttft_p50_s"],
            "output_tokens_per_s": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        },
        "same_greedy_tokens": differ == 0,
        "sequences_with_other_greedy_tokens": differ,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
