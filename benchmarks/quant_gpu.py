"""Quantized weights against the dense model on one workload, in one run: offline throughput of N x
(prompt + output) tokens and batch-1 decode, for each of ``--formats`` (dense first), with dummy weights
of a real shape in each format. Prints JSON: every run, and each format's ratios to the dense one.

    python benchmarks/quant_gpu.py --shape llama-3-8b --formats bf16,fp8,awq,kvfp8    # the H200 run
    python benchmarks/quant_gpu.py --kernels-only                                     # the GEMMs alone

``kvfp8`` is the dense model with ``kv_cache_dtype="fp8"``. ``--kernels`` first times each quantized
GEMM against the bf16 one (``torch.matmul``) at the shape's projection sizes, for a few row counts.
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
from shapes import kernel_options, model_for_benchmark  # noqa: E402

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


def compiled_kernels() -> int:
    """How many kernels Triton's cache holds (one ``__grp__*.json`` each): its growth over a pass is the
    kernels compiled during it."""
    import os

    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in folder.glob("*/__grp__*.json")) if folder.is_dir() else 0


def run_format(args, model: str, fmt: str, vocab: int) -> dict:
    from kvloom import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    quantization = None if fmt in ("bf16", "dense", "kvfp8") else fmt
    llm = LLM(model, load_format="dummy", dtype=args.dtype, device=args.device, quantization=quantization,
              kv_cache_dtype="fp8" if fmt == "kvfp8" else "auto",
              max_num_seqs=args.num_requests, max_model_len=args.prompt_len + max(args.output_len, args.decode_tokens) + 16,
              enforce_eager=args.enforce_eager, kernel_options=args.kernel_options)
    engine = llm.engine
    result = {"format": fmt, "kernel": engine.quantization.describe() if engine.quantization else "dense",
              "weight_gb": weight_bytes_read_per_token(engine.model) / 1e9, "kv_cache": engine.capacity.describe()}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # warm-up: the whole workload's prefill and a few decode steps (the first format's first pass still
    # compiled one kernel on the H200 at f413cad: ``kernels_compiled``)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    passes = []
    for _ in range(args.offline_passes):
        compiled = compiled_kernels()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        generated = sum(len(o.token_ids) for o in outs)
        passes.append({"seconds": elapsed, "output_tok_s": generated / elapsed,
                       "total_tok_s": (generated + len(prompts) * args.prompt_len) / elapsed,
                       "kernels_compiled": compiled_kernels() - compiled})
    result["offline"] = {"requests": len(prompts), "prompt_len": args.prompt_len, "output_len": args.output_len,
                         **passes[-1]}
    if len(passes) > 1:  # the last pass is the figure; the first shows what it paid once
        result["offline"]["passes"] = passes
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


def kernel_times(hf_config: dict, rows_list=(1, 16, 256, 2048), group_size: int = 128) -> list[dict]:
    """Microseconds per GEMM (``triton.testing.do_bench``) at each projection of the shape: bf16
    ``torch.matmul``, the W4A16 kernel, FP8 W8A8 ``_scaled_mm`` and the FP8 weight-only GEMV (small rows)."""
    import triton

    from kvloom.core.model.quantization.fp8 import fp8_w8a8_linear
    from kvloom.kernels import quant_reference as qr
    from kvloom.kernels.quant import dispatch, fp8_weight_only, int_kpacked

    h, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads, kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    d = h // heads
    shapes = {"qkv": (h, (heads + 2 * kv) * d), "o": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    out = []
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = torch.randint(0, 16, (k, n), device="cuda")
        qweight = qr.pack_int32(q, 4, 0)
        zeros = torch.full((k // group_size, n), 8, dtype=torch.uint8, device="cuda")
        scales = torch.full((k // group_size, n), 0.01, dtype=torch.float16, device="cuda")
        ws = qr.fp8_scale_per_row(w)
        wq = qr.fp8_quantize(w, ws)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            r = {"proj": name, "rows": rows, "n": n, "k": k,
                 "bf16_us": triton.testing.do_bench(lambda: x @ w.t()) * 1e3,
                 "int4_us": triton.testing.do_bench(lambda: int_kpacked.int_matmul(x, qweight, zeros, scales,
                                                                                   group_size, 4)) * 1e3,
                 "fp8_w8a8_us": triton.testing.do_bench(lambda: fp8_w8a8_linear(x, wq, ws, None, None)) * 1e3}
            if rows <= dispatch.FP8_GEMV_MAX_ROWS:
                r["fp8_gemv_us"] = triton.testing.do_bench(lambda: fp8_weight_only.fp8_weight_only_linear(x, wq, ws)) * 1e3
            for key in ("int4_us", "fp8_w8a8_us", "fp8_gemv_us"):
                if key in r:
                    r[key.replace("_us", "_speedup")] = round(r["bf16_us"] / r[key], 3)
            out.append(r)
            print(json.dumps(r), flush=True)
    return out


def kv_write_check(n: int = 1 << 20) -> dict:
    """Where the Triton cache write's fp8 bytes differ from torch's cast (CUDA and CPU), over values from
    1e-5 to 2e3: a count and the first examples (input, Triton, torch)."""
    from kvloom.kernels import reference as ref
    from kvloom.kernels import triton_attention

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 16, generator=gen) * torch.logspace(-5, 3.3, n)[:, None, None]
    cache = torch.zeros(n // 16, 16, 1, 16, dtype=torch.float8_e4m3fn, device="cuda")
    other = torch.zeros_like(cache)
    slots = torch.arange(n, device="cuda")
    xc = x.cuda()
    triton_attention.write_kv_cache(xc, xc, cache, other, slots)
    got = cache.view(-1).cpu()
    out = {}
    for where, want in (("torch_cuda", ref.quantize_kv(xc, torch.float8_e4m3fn).view(-1).cpu()),
                        ("torch_cpu", ref.quantize_kv(x, torch.float8_e4m3fn).view(-1))):
        differ = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
        out[where] = {"differ": int(differ.numel()), "of": int(got.numel()),
                      "examples": [(float(x.view(-1)[i]), float(got[i].float()), float(want[i].float()),
                                    int(got.view(torch.uint8)[i]), int(want.view(torch.uint8)[i]))
                                   for i in differ[:6].tolist()]}
    print(json.dumps({"kv_write_check": out}), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3-8b", help="A known shape (benchmarks/shapes.py), or 'tiny'.")
    p.add_argument("--formats", default="bf16,fp8,awq", help="Comma-separated: bf16 (dense, first), fp8, awq, gptq.")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=256, help="Batch-1 decode: tokens generated.")
    p.add_argument("--offline-passes", type=int, default=2,
                   help="Offline runs of the same requests in one engine (the last is the reported figure).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--memory-bandwidth-gbs", type=float, default=4800.0,
                   help="For the batch-1 memory floor (H200: 4800 GB/s); 0 to leave it out.")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="Also write the JSON here.")
    p.add_argument("--kernel-option", action="append", default=[], metavar="NAME=VALUE",
                   help="A kernel choice for the engines (kvloom/kernels/options.py), VALUE in JSON, e.g. "
                        "int4_fused_silu_mul=true; repeatable.")
    p.add_argument("--kernels", action="store_true", help="Also time the GEMMs alone first (CUDA).")
    p.add_argument("--kernels-only", action="store_true", help="Only time the GEMMs alone (CUDA).")
    args = p.parse_args(argv)
    args.kernel_options = kernel_options(args.kernel_option)
    kernels = None
    if args.kernels or args.kernels_only:
        from shapes import SHAPES

        kv_write_check()
        kernels = kernel_times(TINY if args.shape == "tiny" else SHAPES[args.shape])
        if args.kernels_only:
            return {"benchmark": "quant_gpu", "shape": args.shape, "kernels": kernels}
    if args.shape == "tiny":
        folder = Path(__import__("tempfile").gettempdir()) / "kvloom-shapes" / "tiny-quant"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(TINY))
        model, vocab = str(folder), TINY["vocab_size"]
    else:
        model, _, vocab = model_for_benchmark(None, args.shape)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    runs = {}
    for fmt in formats:  # each run printed as it ends, so a cut-short run still reports the others
        runs[fmt] = run_format(args, model, fmt, vocab)
        print(json.dumps({"run": fmt, "offline_output_tok_s": round(runs[fmt]["offline"]["output_tok_s"], 1),
                          "batch1_decode_tok_s": round(runs[fmt]["batch1"]["decode_tok_s"], 1),
                          "fraction_of_floor": round(runs[fmt]["batch1"].get("fraction_of_floor", 0), 3),
                          "offline_passes": [round(r["output_tok_s"], 1) for r in runs[fmt]["offline"].get("passes", [])],
                          "kv_cache": runs[fmt]["kv_cache"]}), flush=True)
    base = runs[formats[0]]
    ratios = {fmt: {"offline_output_tok_s": r["offline"]["output_tok_s"] / base["offline"]["output_tok_s"],
                    "batch1_decode_tok_s": r["batch1"]["decode_tok_s"] / base["batch1"]["decode_tok_s"],
                    "weight_gb": r["weight_gb"] / base["weight_gb"]}
              for fmt, r in runs.items() if fmt != formats[0]}
    result = {"benchmark": "quant_gpu", "shape": args.shape,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu",
              "baseline": formats[0], "kernel_options": args.kernel_options, "runs": runs, "ratios_to_baseline": ratios, "kernels": kernels}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return result


if __name__ == "__main__":
    main()
