"""CPU decode attention: the in-place paged kernel (``kvloom.kernels.cpu_attention``, its AVX512-BF16 path and its
portable loops) against the gather the backend runs without it (each row's blocks copied into ``[B, Hkv, L, D]``,
then torch's fused kernel up to ``SDPA_DECODE_ROWS`` rows and two batched matmuls beyond). Every layer has its
own cache, as in a decode step (the cached rows come from memory, not from a cache the previous layer warmed); the
three alternate and the ratios of medians are printed.

    python benchmarks/cpu_decode_attention.py                    # SmolLM2-135M: 9 heads, 3 KV heads, dim 64
    python benchmarks/cpu_decode_attention.py --rows 1,32 --context 160,1000 --heads 32,8,128 --layers 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvloom.core.model.attention.cpu import SDPA_DECODE_ROWS, CPUAttentionBackend, _block_rows, _DecodeIndex
from kvloom.kernels import cpu_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32", help="decode rows a step (comma-separated)")
    parser.add_argument("--context", default="160,400", help="cached positions a row (comma-separated)")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        raise SystemExit("the paged kernel did not build here (see the warning above)")
    heads, kv_heads, dim = (int(v) for v in args.heads.split(","))
    rows_list = [int(v) for v in args.rows.split(",")]
    contexts = [int(v) for v in args.context.split(",")]
    bs, dtype = args.block_size, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    blocks_needed = max(rows_list) * -(-max(contexts) // bs)
    num_blocks = max(2 * blocks_needed, 256)
    caches = [(torch.randn(num_blocks, kv_heads, bs, dim, generator=gen).to(dtype),
               torch.randn(num_blocks, kv_heads, bs, dim, generator=gen).to(dtype)) for _ in range(args.layers)]
    print(f"{heads} heads, {kv_heads} KV heads, dim {dim}, block {bs}, {args.layers} layers, "
          f"{torch.get_num_threads()} threads; ms a step (all layers), median of {args.rounds} alternated rounds")
    results = []
    for rows in rows_list:
        for context in contexts:
            q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
            nblk = -(-context // bs)
            tables = torch.randperm(num_blocks, generator=gen)[: rows * nblk].view(rows, nblk).int()
            ends = torch.full((rows,), context, dtype=torch.long)
            starts = torch.zeros_like(ends)
            mask = torch.arange(nblk * bs)[None, :] < ends[:, None]
            bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))[:, None, None, :]
            index = _DecodeIndex(_block_rows(tables, kv_heads), nblk, bias, None)

            def gather():
                for k, v in caches:
                    CPUAttentionBackend._decode(q, k, v, index, dim**-0.5, sdpa=rows <= SDPA_DECODE_ROWS)

            def kernel(vectorized):
                cpu_attention.VECTORIZED = vectorized
                for k, v in caches:
                    cpu_attention.paged_decode(q, k, v, tables, starts, ends, dim**-0.5, 0.0, None)

            ways = {"gather": gather, "portable": lambda: kernel(False), "vectorized": lambda: kernel(True)}
            times = {name: [] for name in ways}
            for fn in ways.values():
                fn()
            for r in range(args.rounds):
                for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                    t = time.perf_counter()
                    ways[name]()
                    times[name].append((time.perf_counter() - t) * 1e3)
            med = {name: statistics.median(v) for name, v in times.items()}
            row = {"rows": rows, "context": context, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                   "gather_over_vectorized": round(med["gather"] / med["vectorized"], 2),
                   "gather_over_portable": round(med["gather"] / med["portable"], 2)}
            results.append(row)
            print(f"rows {rows:3d} context {context:5d}: gather {med['gather']:7.2f}  portable {med['portable']:7.2f}"
                  f"  vectorized {med['vectorized']:7.2f}   gather/portable {row['gather_over_portable']:.2f}"
                  f"  gather/vectorized {row['gather_over_vectorized']:.2f}", flush=True)
    cpu_attention.VECTORIZED = True
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"heads": [heads, kv_heads, dim], "block_size": bs, "layers": args.layers,
                       "threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
