"""Offline throughput: one workload through kvloom's LLM and through Hugging Face transformers'
``generate`` (static batches) in the same run; prints JSON with both and their ratio.

    python benchmarks/offline_throughput.py                       # SmolLM2 on this machine
    python benchmarks/offline_throughput.py --shape llama-3-8b    # dummy weights of a real shape (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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


class KvloomRunner:
    """kvloom's LLM, loaded once and warmed up; ``run()`` times one pass over the workload."""

    def __init__(self, args, model: str, load_format: str, prompts, outputs) -> None:
        from kvloom import LLM, SamplingParams

        options = dict(load_format=load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       enforce_eager=args.enforce_eager)
        for name in ("max_num_batched_tokens", "max_model_len", "kv_cache_memory_gib"):
            if getattr(args, name):
                options[name] = getattr(args, name)
        self.args, self.prompts, self.outputs = args, prompts, outputs
        t0 = time.perf_counter()
        self.llm = LLM(model, **options)
        self.load_s = time.perf_counter() - t0
        self.dtype = str(self.llm.engine.dtype).removeprefix("torch.")
        self.params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        # Warm-up on the same prompts with two output tokens: every step shape the run will see (prefill
        # chunk sizes, decode batch sizes) has its Triton kernels compiled before the clock starts.
        self.llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)] * len(prompts),
                          use_tqdm=False)
        _sync()

    def run(self) -> float:
        profiler = None
        if self.args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=not self.args.quiet)
        _sync()
        elapsed = time.perf_counter() - t0
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(40)
        n_out = sum(len(o.token_ids) for o in outs)
        assert n_out == sum(self.outputs), "kvloom produced a different number of tokens than asked for"
        return elapsed

    def describe(self) -> dict:
        return {"load_s": self.load_s, "dtype": self.dtype, "kv_cache": self.llm.engine.capacity.describe()}

    def close(self) -> None:
        del self.llm
        _free_memory()


class TransformersRunner:
    """transformers' ``generate`` in static batches, the same model and dtype; ``run()`` times one pass."""

    def __init__(self, args, model: str, load_format: str, dtype: str, prompts, outputs) -> None:
        self.hf, self.device = load_transformers_model(model, load_format, dtype)
        self.dtype = dtype
        self.pad = self.hf.config.pad_token_id if self.hf.config.pad_token_id is not None else 0
        self.batch = args.hf_batch_size
        self.prompts, self.outputs = prompts, outputs
        self._generate(prompts[:2], [4, 4])  # warm-up
        _sync()

    def _generate(self, chunk, chunk_out) -> int:
        longest = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), longest), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        with torch.no_grad():
            gen = self.hf.generate(ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                                   max_new_tokens=max(chunk_out), min_new_tokens=max(chunk_out), pad_token_id=self.pad)
        return (gen.shape[1] - longest) * len(chunk)

    def run(self) -> float:
        t0 = time.perf_counter()
        self.generated_incl_padding = 0
        for i in range(0, len(self.prompts), self.batch):
            self.generated_incl_padding += self._generate(self.prompts[i:i + self.batch], self.outputs[i:i + self.batch])
        _sync()
        return time.perf_counter() - t0

    def describe(self) -> dict:
        # static batches also generate padding past shorter outputs; throughput counts the tokens asked for
        return {"dtype": self.dtype, "batch_size": self.batch, "num_requests": len(self.prompts),
                "generated_incl_padding": self.generated_incl_padding}

    def close(self) -> None:
        del self.hf
        _free_memory()


def _figures(times: list[float], prompts, outputs) -> dict:
    elapsed = statistics.median(times)
    n_in, n_out = sum(len(p) for p in prompts), sum(outputs)
    return {"output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed, "elapsed_s": elapsed,
            "elapsed_s_runs": [round(t, 3) for t in times]}


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
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="Default: the engine's.")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None)
    p.add_argument("--dtype", default="auto", help="kvloom's dtype (auto: the engine's choice).")
    p.add_argument("--hf-dtype", default=None, help="transformers' dtype (default: the dtype kvloom resolved).")
    p.add_argument("--repeat", type=int, default=None,
                   help="Timed runs per engine, alternated on the CPU; the median counts (default: 3 on CPU, 1 on GPU).")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--profile", action="store_true", help="Print where kvloom's host time goes (cProfile).")
    args = p.parse_args()

    model, load_format, vocab = model_for_benchmark(args.model, args.shape)
    prompts, outputs = workload(args, vocab)
    on_gpu = torch.cuda.is_available()
    repeat = args.repeat or (1 if on_gpu else 3)
    result = {
        "benchmark": "offline_throughput", "model": args.shape or model, "load_format": load_format,
        "device": torch.cuda.get_device_name() if on_gpu else f"cpu ({torch.get_num_threads()} threads)",
        "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "repeat": repeat,
    }
    n_hf = args.hf_num_requests or len(prompts)
    kv = KvloomRunner(args, model, load_format, prompts, outputs)
    kv_times, hf_times, hf = [], [], None
    if args.skip_hf or on_gpu:
        # On a GPU the two engines do not fit side by side (kvloom's KV cache takes the free memory):
        # kvloom's runs first, then transformers'.
        kv_times = [kv.run() for _ in range(repeat)]
        result["kvloom"] = {**_figures(kv_times, prompts, outputs), **kv.describe()}
        kv.close()
        if not args.skip_hf:
            hf = TransformersRunner(args, model, load_format, args.hf_dtype or result["kvloom"]["dtype"],
                                    prompts[:n_hf], outputs[:n_hf])
            hf_times = [hf.run() for _ in range(repeat)]
    else:
        # Both loaded, runs alternated: a slow spell of a shared machine hits both engines alike.
        hf = TransformersRunner(args, model, load_format, args.hf_dtype or kv.dtype, prompts[:n_hf], outputs[:n_hf])
        for _ in range(repeat):
            kv_times.append(kv.run())
            hf_times.append(hf.run())
        result["kvloom"] = {**_figures(kv_times, prompts, outputs), **kv.describe()}
        kv.close()
    if hf is not None:
        result["transformers"] = {**_figures(hf_times, prompts[:n_hf], outputs[:n_hf]), **hf.describe()}
        hf.close()
        result["ratio_output_tok_s"] = result["kvloom"]["output_tok_s"] / result["transformers"]["output_tok_s"]
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
