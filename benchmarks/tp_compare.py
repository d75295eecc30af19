"""Tensor parallelism against one rank in the same run: greedy tokens of each size compared with the first
size's, batch-1 decode tok/s, and the throughput of a batch of (prompt + output) requests. Each size runs
in a process of its own (a 2-way group needs the GPUs the 1-way run held). Prints one JSON line per size
and a summary with the ratios.

    python benchmarks/tp_compare.py --shape llama-3-8b --tp 1,2                  # dummy weights: speed only
    python benchmarks/tp_compare.py --model PATH --tp 1,2 --dtype bfloat16      # real weights: parity too
    python benchmarks/tp_compare.py --shape llama-3-70b --tp 2 --batch 16       # does not fit one GPU
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, model_for_benchmark  # noqa: E402

EXTRA_SHAPES = {
    "llama-3-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
}


def model_args(args) -> tuple[str, str, int]:
    if args.shape in EXTRA_SHAPES:
        folder = Path(tempfile.gettempdir()) / "kvloom-shapes" / args.shape
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(EXTRA_SHAPES[args.shape]))
        return str(folder), "dummy", EXTRA_SHAPES[args.shape]["vocab_size"]
    return model_for_benchmark(args.model, args.shape)


def run_one(args) -> dict:
    """One tensor-parallel size: load, decode one request, then a batch; the figures as a dict."""
    from kvloom import LLM, SamplingParams

    model, load_format, vocab = model_args(args)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.parity_prompts)]
    max_len = max(args.prompt_len + args.new_tokens, args.batch_prompt + args.batch_new) + 16
    t0 = time.perf_counter()
    llm = LLM(model, load_format=load_format, dtype=args.dtype, tensor_parallel_size=args.run_tp,
              max_model_len=max_len, max_num_seqs=max(8, args.batch), **json.loads(args.engine_options))
    load_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    single = llm.generate(prompts[:1], greedy, use_tqdm=False)
    decode_s = time.perf_counter() - t0
    tokens = [single[0].token_ids] + [o.token_ids for o in llm.generate(prompts[1:], greedy, use_tqdm=False)]
    batch = [[rng.randrange(10, vocab - 10) for _ in range(args.batch_prompt)] for _ in range(args.batch)]
    t0 = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=args.batch_new, ignore_eos=True),
                        use_tqdm=False)
    batch_s = time.perf_counter() - t0
    llm.engine.shutdown()
    return dict(tp=args.run_tp, load_s=round(load_s, 1), kv_blocks=llm.engine.kv.num_blocks,
                batch1_decode_tok_s=round(args.new_tokens / decode_s, 2),
                batch_output_tok_s=round(sum(len(o.token_ids) for o in outs) / batch_s, 1), tokens=tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None, choices=sorted({*SHAPES, *EXTRA_SHAPES}))
    p.add_argument("--tp", default="1,2", help="Tensor-parallel sizes, the first one the reference.")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--parity-prompts", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batch-prompt", type=int, default=512)
    p.add_argument("--batch-new", type=int, default=256)
    p.add_argument("--engine-options", default="{}", help="More EngineConfig fields as JSON.")
    p.add_argument("--run-tp", type=int, default=None, help=argparse.SUPPRESS)  # one size, in a child
    args = p.parse_args()
    if args.run_tp is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    results = []
    for tp in [int(x) for x in args.tp.split(",")]:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--run-tp", str(tp)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(json.dumps({"tp": tp, "error": (out.stderr or out.stdout)[-2000:]}))
            continue
        results.append(json.loads(line[7:]))
    ref = results[0] if results else None
    for r in results:
        same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"]))
        r["prompts_identical_to_first_size"] = f"{same}/{len(ref['tokens'])}"
        r["batch1_speedup"] = round(r["batch1_decode_tok_s"] / ref["batch1_decode_tok_s"], 2)
        r["throughput_ratio"] = round(r["batch_output_tok_s"] / ref["batch_output_tok_s"], 2)
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}))


if __name__ == "__main__":
    main()
