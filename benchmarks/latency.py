"""Batch-1 decode speed: one request, a fixed prompt, N new tokens (EOS ignored), through kvloom and
through transformers in the same run. Prints JSON with decode tok/s and the fraction of the
weight-read floor (weight bytes / measured copy bandwidth) that kvloom reaches.

    python benchmarks/latency.py --shape llama-3-8b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import load_transformers_model, model_for_benchmark  # noqa: E402


def copy_bandwidth_gbs() -> float | None:
    """Device memory bandwidth in GB/s from a device-to-device copy (bytes read + written per second),
    measured now: the rate at which a decode step can stream the weights."""
    if not torch.cuda.is_available():
        return None
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n * 20 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--hf-new-tokens", type=int, default=64, help="Tokens for transformers (eager is slow).")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()

    from kvloom import LLM, SamplingParams

    model, load_format, vocab = model_for_benchmark(args.model, args.shape)
    rng = random.Random(0)
    prompt = [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]
    llm = LLM(model, load_format=load_format, dtype=args.dtype, max_num_seqs=8,
              enforce_eager=args.enforce_eager, max_model_len=max(2048, args.prompt_len + args.new_tokens))
    model_ = llm.engine.model
    # A decode step reads every weight once, except the input embedding table (one row per token),
    # unless it doubles as the output head.
    weight_bytes = sum(t.numel() * t.element_size() for t in model_.parameters())
    if not model_.tie_word_embeddings:
        weight_bytes -= model_.embed_tokens.weight.numel() * model_.embed_tokens.weight.element_size()

    def timed(n_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.token_ids) == n_tokens
        return out.metrics.ttft, out.metrics.latency

    timed(16)  # warm-up
    ttft, total = timed(args.new_tokens)
    decode_tok_s = (args.new_tokens - 1) / (total - ttft)
    bw = copy_bandwidth_gbs()
    result = {
        "benchmark": "latency_batch1", "model": args.shape or model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "kvloom": {"decode_tok_s": decode_tok_s, "ttft_ms": ttft * 1e3, "total_s": total},
        "weights_read_per_token_gb": weight_bytes / 1e9,
    }
    if bw:
        floor = bw * 1e9 / weight_bytes
        result.update(copy_bandwidth_gbs=bw, weight_read_floor_tok_s=floor, fraction_of_floor=decode_tok_s / floor)
    if not args.skip_hf:
        import gc

        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result["transformers"] = run_hf(args, model, load_format, prompt)
        result["ratio_decode_tok_s"] = decode_tok_s / result["transformers"]["decode_tok_s"]
    print(json.dumps(result, indent=2))


def run_hf(args, model, load_format, prompt) -> dict:
    hf, device = load_transformers_model(model, load_format, args.dtype)
    ids = torch.tensor([prompt], device=device)

    def gen(n):
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                        min_new_tokens=n, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()

    gen(4)
    t0 = time.perf_counter()
    gen(1)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen(args.hf_new_tokens)
    total = time.perf_counter() - t0
    return {"decode_tok_s": (args.hf_new_tokens - 1) / (total - prefill), "new_tokens": args.hf_new_tokens}


if __name__ == "__main__":
    main()
