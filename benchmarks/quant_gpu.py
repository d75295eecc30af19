"""Quantized weights against the dense model on one workload, in one run: offline throughput of N x
(prompt + output) tokens and batch-1 decode, for each of ``--formats`` (dense first), with dummy weights
of a real shape in each format. Prints JSON: every run, and each format's ratios to the dense one.

    python benchmarks/quant_gpu.py --shape llama-3-8b --formats bf16,fp8,awq          # the H200 run
    python benchmarks/quant_gpu.py --shape tiny --num-requests 4 --prompt-len 16 \\
        --output-len 8 --decode-tokens 8 --device cpu --dtype float32                 # code paths on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import model_for_benchmark  # noqa: E402

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def weight_bytes_read_per_token(model) -> int:
    """A decode step reads every weight once, except the input embedding table (one row per token)."""
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("packed_weight"))
    if not model.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def run_format(args, model: str, fmt: str, vocab: int) -> dict:
    from kvloom import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    quantization = None if fmt in ("bf16", "dense") else fmt
    llm = LLM(model, load_format="dummy", dtype=args.dtype, device=args.device, quantization=quantization,
              max_num_seqs=args.num_requests, max_model_len=args.prompt_len + max(args.output_len, args.decode_tokens) + 16,
              enforce_eager=args.enforce_eager)
    engine = llm.engine
    result = {"format": fmt, "kernel": engine.quantization.describe() if engine.quantization else "dense",
              "weight_gb": weight_bytes_read_per_token(engine.model) / 1e9, "kv_cache": engine.capacity.describe()}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: min(8, len(prompts))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    result["offline"] = {"requests": len(prompts), "prompt_len": args.prompt_len, "output_len": args.output_len,
                         "seconds": elapsed, "output_tok_s": generated / elapsed,
                         "total_tok_s": (generated + len(prompts) * args.prompt_len) / elapsed}
    one = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    out = llm.generate([prompts[0]], one, use_tqdm=False)[0]
    decode = (args.decode_tokens - 1) / (out.metrics.latency - out.metrics.ttft)
    result["batch1"] = {"decode_tokens": args.decode_tokens, "decode_tok_s": decode, "ttft_ms": out.metrics.ttft * 1e3}
    if args.memory_bandwidth_gbs:
        floor = args.memory_bandwidth_gbs * 1e9 / (result["weight_gb"] * 1e9)
        result["batch1"].update(weight_read_floor_tok_s=floor, fraction_of_floor=decode / floor)
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", help="A known shape (benchmarks/shapes.py), or 'tiny'.")
    p.add_argument("--formats", default="bf16,fp8,awq", help="Comma-separated: bf16 (dense, first), fp8, awq, gptq.")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=256, help="Batch-1 decode: tokens generated.")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--memory-bandwidth-gbs", type=float, default=4800.0,
                   help="For the batch-1 memory floor (H200: 4800 GB/s); 0 to leave it out.")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="Also write the JSON here.")
    args = p.parse_args(argv)
    if args.shape == "tiny":
        folder = Path(__import__("tempfile").gettempdir()) / "kvloom-shapes" / "tiny-quant"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(TINY))
        model, vocab = str(folder), TINY["vocab_size"]
    else:
        model, _, vocab = model_for_benchmark(None, args.shape)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    runs = {fmt: run_format(args, model, fmt, vocab) for fmt in formats}
    base = runs[formats[0]]
    ratios = {fmt: {"offline_output_tok_s": r["offline"]["output_tok_s"] / base["offline"]["output_tok_s"],
                    "batch1_decode_tok_s": r["batch1"]["decode_tok_s"] / base["batch1"]["decode_tok_s"],
                    "weight_gb": r["weight_gb"] / base["weight_gb"]}
              for fmt, r in runs.items() if fmt != formats[0]}
    result = {"benchmark": "quant_gpu", "shape": args.shape,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu",
              "baseline": formats[0], "runs": runs, "ratios_to_baseline": ratios}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return result


if __name__ == "__main__":
    main()
