"""Offline throughput: one workload through kvloom's LLM and through Hugging Face transformers'
``generate`` (static batches) in the same run; prints JSON with both and their ratio.

    python benchmarks/offline_throughput.py                       # SmolLM2 on this machine
    python benchmarks/offline_throughput.py --shape llama-3-8b    # dummy weights of a real shape (GPU)
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


def workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    def length(spec: str) -> int:
        lo, _, hi = spec.partition(":")
        return rng.randint(int(lo), int(hi or lo))
    prompts, outputs = [], []
    for _ in range(args.num_requests):
        prompts.append([rng.randrange(10, vocab - 10) for _ in range(length(args.prompt_len))])
        outputs.append(length(args.output_len))
    return prompts, outputs


def run_kvloom(args, model: str, load_format: str, prompts, outputs) -> dict:
    from kvloom import LLM, SamplingParams

    options = dict(load_format=load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager)
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.kv_cache_memory_gib:
        options["kv_cache_memory_gib"] = args.kv_cache_memory_gib
    t0 = time.perf_counter()
    llm = LLM(model, **options)
    load_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    # Warm-up on the same prompts with two output tokens: every step shape the run will see (prefill
    # chunk sizes, decode batch sizes) has its Triton kernels compiled before the clock starts.
    llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)] * len(prompts),
                 use_tqdm=False)
    _sync()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    _sync()
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == sum(outputs), "kvloom produced a different number of tokens than asked for"
    n_in = sum(len(p) for p in prompts)
    result = {"output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed, "elapsed_s": elapsed,
              "load_s": load_s, "kv_cache": llm.engine.capacity.describe()}
    del llm, outs
    _free_memory()
    return result


def run_hf(args, model: str, load_format: str, prompts, outputs) -> dict:
    hf, device = load_transformers_model(model, load_format, args.dtype)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    batch = args.hf_batch_size
    n_out = 0

    def generate(chunk, chunk_out):
        longest = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        with torch.no_grad():
            gen = hf.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              max_new_tokens=max(chunk_out), min_new_tokens=max(chunk_out), pad_token_id=pad)
        return (gen.shape[1] - longest) * len(chunk)

    generate(prompts[:2], [4, 4])  # warm-up
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        n_out += generate(prompts[i:i + batch], outputs[i:i + batch])
    _sync()
    elapsed = time.perf_counter() - t0
    useful = sum(outputs)  # tokens asked for; static batches also generate padding past shorter outputs
    n_in = sum(len(p) for p in prompts)
    return {"output_tok_s": useful / elapsed, "total_tok_s": (n_in + useful) / elapsed, "elapsed_s": elapsed,
            "generated_incl_padding": n_out, "batch_size": batch}


def _free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model path or name (default: SmolLM2-135M-Instruct).")
    p.add_argument("--shape", default=None, help="Dummy weights of a known shape: llama-3-8b, qwen3-0.6b, ...")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", default="128", help="Tokens, or a range LO:HI (uniform).")
    p.add_argument("--output-len", default="64", help="Tokens, or a range LO:HI (uniform).")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--hf-num-requests", type=int, default=None,
                   help="Run transformers on only the first N requests (its static batches are slow on long outputs).")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--profile", action="store_true", help="Print where kvloom's host time goes (cProfile).")
    args = p.parse_args()

    model, load_format, vocab = model_for_benchmark(args.model, args.shape)
    prompts, outputs = workload(args, vocab)
    result = {
        "benchmark": "offline_throughput", "model": args.shape or model, "load_format": load_format,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)",
        "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "kvloom": run_kvloom(args, model, load_format, prompts, outputs),
    }
    if not args.skip_hf:
        n_hf = args.hf_num_requests or len(prompts)
        result["transformers"] = run_hf(args, model, load_format, prompts[:n_hf], outputs[:n_hf])
        result["transformers"]["num_requests"] = n_hf
        result["ratio_output_tok_s"] = result["kvloom"]["output_tok_s"] / result["transformers"]["output_tok_s"]
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
