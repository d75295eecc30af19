"""One MoE layer's experts on the CPU: kvloom's fused reference (rows sorted by expert once, one matmul per
projection per expert with rows) beside transformers' own experts module on the same weights and routing;
prints JSON per token count with both times and their ratio.

    python benchmarks/moe_cpu.py                                # Qwen3-30B-A3B's layer: 128 experts, top-8
    python benchmarks/moe_cpu.py --dtype bfloat16 --tokens 1,16,256 --repeat 5 --threads 1

On a machine whose cores other processes keep busy, pass ``--threads 1``: OpenMP teams that wait on busy
cores slow every small matmul of both sides many times over.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom.kernels.moe import fused_experts  # noqa: E402


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--tokens", default="1,16,256")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.top_k)
    hf = Qwen3MoeExperts(config).to(dtype)
    with torch.no_grad():
        hf.gate_up_proj.normal_(0.0, 0.02)
        hf.down_proj.normal_(0.0, 0.02)
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden, dtype=dtype)
        weights, ids = torch.topk(torch.softmax(torch.randn(tokens, args.experts), -1), args.top_k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        with torch.no_grad():
            ours = timed(lambda: fused_experts(x, hf.gate_up_proj, hf.down_proj, weights, ids), args.repeat)
            theirs = timed(lambda: hf(x, ids, weights), args.repeat)
        print(json.dumps({"tokens": tokens, "experts": args.experts, "top_k": args.top_k, "dtype": args.dtype,
                          "kvloom_ms": round(ours * 1e3, 2), "transformers_ms": round(theirs * 1e3, 2),
                          "ratio": round(theirs / ours, 2)}))


if __name__ == "__main__":
    main()
