"""Micro-benchmarks of kvloom's Triton kernels on one CUDA GPU; prints one JSON document.

    python benchmarks/triton_kernels_gpu.py [--out results.json]

* decode attention: Llama-3-8B heads (Hq=32, Hkv=8, D=128), bf16, block size 16, shuffled block tables;
  batch 1 / 64 / 256 at contexts 512..4096. Reports the median time and the achieved bandwidth of the
  K/V read (the bytes a decode step must move), next to torch SDPA over a contiguous, unpaged cache.
* prefill attention: causal, same heads; whole prompts and a chunk over a cached prefix. Reports TFLOP/s
  (causal FLOPs only) next to torch SDPA (``is_causal``) on contiguous tensors.
* fused ops (RMSNorm + residual, rotary, SiLU-and-mul): Triton against the eager PyTorch reference.

Times come from ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, median).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing kvloom

HQ, HKV, D = 32, 8, 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
SCALE = D**-0.5


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (L2 flushed before each run)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph (no host launch overhead, warm L2)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def paged_cache(batch: int, context: int):
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    # Shuffled blocks: a real cache after some churn is not laid out sequence by sequence.
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    return k_cache, v_cache, tables


def contiguous_kv(k_cache, v_cache, tables, context):
    """The paged K/V of each sequence gathered into ``[B, Hkv, context, D]`` (the SDPA baseline's input)."""
    batch = tables.shape[0]

    def gather(cache):
        return cache[tables.long()].reshape(batch, -1, HKV, D)[:, :context].transpose(1, 2).contiguous()

    return gather(k_cache), gather(v_cache)


def bench_decode(triton_attention) -> list[dict]:
    rows = []
    for batch in (1, 64, 256):
        for context in (512, 1024, 2048, 4096):
            k_cache, v_cache, tables = paged_cache(batch, context)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
            kv_bytes = 2 * batch * context * HKV * D * k_cache.element_size()
            row = {"batch": batch, "context": context, "kv_MB": round(kv_bytes / 1e6, 1)}

            def run(num_splits=None):
                return triton_attention.paged_decode_attention(
                    q, k_cache, v_cache, tables, seq_lens, context, SCALE, num_splits=num_splits
                )

            row["splits"] = triton_attention._decode_num_splits(q, batch, HKV, context)
            ms = bench(run)
            row["triton_ms"] = round(ms, 4)
            row["triton_GBps"] = round(kv_bytes / ms / 1e6, 1)
            # As the engine runs decode: replayed from a CUDA graph, so host launch overhead drops out
            # (small cases are launch-bound otherwise); the L2 is not flushed between replays here.
            row["triton_graph_ms"] = round(bench_graph(run), 4)
            if row["splits"] > 1:
                ms1 = bench(lambda: run(1))
                row["no_split_ms"] = round(ms1, 4)
            keys, values = contiguous_kv(k_cache, v_cache, tables, context)
            q4 = q[:, :, None, :]
            ms_sdpa = bench(lambda: F.scaled_dot_product_attention(q4, keys, values, scale=SCALE, enable_gqa=True))
            row["sdpa_contiguous_ms"] = round(ms_sdpa, 4)
            row["sdpa_contiguous_GBps"] = round(kv_bytes / ms_sdpa / 1e6, 1)
            rows.append(row)
            del k_cache, v_cache, keys, values
            torch.cuda.empty_cache()
    return rows


def causal_flops(query_lens, seq_lens) -> float:
    """2 matmuls x 2 FLOPs x D x Hq per (query, visible key) pair."""
    pairs = 0
    for q_len, s_len in zip(query_lens, seq_lens):
        ctx = s_len - q_len
        pairs += q_len * ctx + q_len * (q_len + 1) // 2
    return 4.0 * D * HQ * pairs


def bench_prefill(triton_attention) -> list[dict]:
    cases = [
        ("prompt", [512], [512]),
        ("prompt", [1024], [1024]),
        ("prompt", [2048], [2048]),
        ("prompt", [4096], [4096]),
        ("8 prompts", [1024] * 8, [1024] * 8),
        ("chunk over prefix", [512], [4096]),
    ]
    rows = []
    for name, query_lens, seq_lens_list in cases:
        batch = len(query_lens)
        context = max(seq_lens_list)
        k_cache, v_cache, tables = paged_cache(batch, context)
        q = torch.randn(sum(query_lens), HQ, D, device="cuda", dtype=DTYPE)
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
        flops = causal_flops(query_lens, seq_lens_list)
        ms = bench(
            lambda: triton_attention.paged_prefill_attention(
                q, k_cache, v_cache, tables, starts, seq_lens, max(query_lens), SCALE
            )
        )
        row = {
            "case": name, "query_lens": query_lens[0], "seq_len": seq_lens_list[0], "batch": batch,
            "triton_ms": round(ms, 4), "triton_TFLOPs": round(flops / ms / 1e9, 1),
        }
        if all(q_len == s_len for q_len, s_len in zip(query_lens, seq_lens_list)):
            # Same work on contiguous [B, H, S, D] tensors through SDPA (flash backend for bf16).
            keys, values = contiguous_kv(k_cache, v_cache, tables, context)
            qs = q.view(batch, context, HQ, D).transpose(1, 2).contiguous()
            ms_sdpa = bench(
                lambda: F.scaled_dot_product_attention(qs, keys, values, is_causal=True, scale=SCALE, enable_gqa=True)
            )
            row["sdpa_contiguous_ms"] = round(ms_sdpa, 4)
            row["sdpa_contiguous_TFLOPs"] = round(flops / ms_sdpa / 1e9, 1)
        rows.append(row)
    return rows


def bench_fused(triton_fused) -> list[dict]:
    from kvloom.kernels import reference as ref

    tokens, hidden, inter = 4096, 4096, 14336
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=DTYPE)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device="cuda", dtype=DTYPE)
    q = qkv[:, : HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(tokens, HKV, D)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    inv_freq = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.arange(8192, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
    e = x.element_size()
    cases = [
        # (name, bytes moved at minimum, triton fn, reference fn)
        ("rms_norm+residual", 4 * x.numel() * e,
         lambda: triton_fused.rms_norm(x, weight, 1e-5, residual), lambda: ref.rms_norm(x, weight, 1e-5, residual)),
        ("rotary", 2 * (q.numel() + k.numel()) * e,
         lambda: triton_fused.rotary_embedding(positions, q, k, cos_sin),
         lambda: ref.rotary_embedding(positions, q, k, cos_sin)),
        ("silu_and_mul", 3 * tokens * inter * e,
         lambda: triton_fused.silu_and_mul(gate_up), lambda: ref.silu_and_mul(gate_up)),
    ]
    rows = []
    for name, nbytes, fn, ref_fn in cases:
        ms, ms_ref = bench(fn), bench(ref_fn)
        ms_graph = bench_graph(fn)  # without the Python wrapper's host overhead
        rows.append({
            "op": name, "tokens": tokens, "triton_ms": round(ms, 4), "triton_graph_ms": round(ms_graph, 4),
            "triton_graph_GBps": round(nbytes / ms_graph / 1e6, 1), "eager_ms": round(ms_ref, 4),
            "speedup": round(ms_ref / ms, 2),
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/triton_kernels_gpu.py: no CUDA device, nothing to measure (the Triton kernels only run on CUDA).")
        return 0

    import triton

    from kvloom.kernels import triton_attention, triton_fused

    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "decode": bench_decode(triton_attention),
        "prefill": bench_prefill(triton_attention),
        "fused": bench_fused(triton_fused),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
