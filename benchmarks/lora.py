"""What serving LoRA adapters costs: one offline workload through kvloom's LLM on the base model, then with
every request on one adapter, spread over ``--adapters`` adapters that fit the slots, and over more
adapters than slots (they take turns); prints JSON with each run's output tokens/s (the best of
``--repeats`` passes, the runs interleaved so a busy machine weighs on all alike) and its ratio to the
base run of the same process.

    python benchmarks/lora.py                                   # SmolLM2 on this machine
    python benchmarks/lora.py --shape llama-3-8b --rank 16      # dummy weights of a real shape (GPU)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import model_for_benchmark  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config, rank: int, seed: int, dtype: torch.dtype) -> str:
    """A random PEFT adapter on every projection of every layer (small values: outputs stay sane)."""
    from safetensors.torch import save_file

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGETS:
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            n_in, n_out = shapes[module]
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) * 0.01).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(TARGETS)}))
    return str(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--shape", help="dummy weights of a known shape (benchmarks/shapes.py)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4, help="adapters of the mixed run (= max_loras)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory-gib", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from kvloom import LLM, SamplingParams

    model, load_format, vocab = model_for_benchmark(args.model, args.shape)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    options = dict(load_format=load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_lora=True,
                   max_loras=args.adapters, max_lora_rank=args.rank,
                   max_cpu_loras=2 * args.adapters)
    if args.kv_cache_memory_gib:
        options["kv_cache_memory_gib"] = args.kv_cache_memory_gib
    llm = LLM(model, **options)
    folder = Path(tempfile.mkdtemp(prefix="kvloom-lora-bench-"))
    names = []
    for i in range(2 * args.adapters):
        name = f"lora{i}"
        llm.load_lora_adapter(name, write_adapter(folder / name, llm.engine.hf_config, args.rank, i,
                                                  llm.engine.dtype))
        names.append(name)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    n = len(prompts)
    runs = {"base": [None] * n, "one adapter": [names[0]] * n,
            f"{args.adapters} adapters": [names[i % args.adapters] for i in range(n)],
            f"{2 * args.adapters} adapters, {args.adapters} slots": [names[i % len(names)] for i in range(n)]}
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), lora=runs[f"{args.adapters} adapters"],
                 use_tqdm=False)  # warm-up: kernels compiled, slots filled
    best: dict[str, float] = {}
    tokens = args.num_requests * args.output_len
    for _ in range(args.repeats):
        for label, lora in runs.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora=lora, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[label] = min(best.get(label, float("inf")), time.perf_counter() - t0)
            assert sum(len(o.token_ids) for o in outs) == tokens
    results = {label: {"seconds": round(s, 3), "output_tokens_per_s": round(tokens / s, 1)} for label, s in best.items()}
    base = results["base"]["output_tokens_per_s"]
    for r in results.values():
        r["ratio_to_base"] = round(r["output_tokens_per_s"] / base, 3)
    print(json.dumps({"model": args.shape or model, "device": str(llm.engine.device), "dtype": str(llm.engine.dtype),
                      "rank": args.rank, "requests": args.num_requests, "prompt_len": args.prompt_len,
                      "output_len": args.output_len, "slot_loads": llm.engine.adapters.num_loads,
                      "runs": results}, indent=2))


if __name__ == "__main__":
    main()
