"""The CPU int4 matmul (``kvloom.kernels.cpu_int4``, torch's ``_weight_int4pack_mm_for_cpu``) against the
oneDNN-packed bf16 one, over every linear layer of a model in turn (so the weights stream from memory, as in
a decode step, rather than sit in cache), at several row counts; the timings alternate and the ratio of
medians is printed. Where the ratio falls below 1 is where ``INT4_MAX_ROWS`` belongs. On a CPU with AMX or
AVX512-BF16 kvloom's 4-bit kernel (``kvloom.kernels.cpu_int4_amx``, its AMX or dot-product loops: ``kernel`` in the
output) on the same codes is timed too (``amx_ms``): where it beats torch's kernel and the bf16 copy is where
``TORCH_INT4_ROWS`` and ``AMX_INT4_MAX_ROWS`` (``DOT_INT4_MAX_ROWS`` without AMX) belong.

With ``--awq-group G`` the layers are AWQ checkpoint layers (random codes, zero points and fp16 scales in
AutoAWQ's packing) made the engine's way: the 4-bit copy from ``awq_codes`` + ``zero_point_codes`` with a scale
and zero per ``G`` inputs, the bf16 copy from ``dequantize_awq`` (what the CPU ran before the 4-bit copy).

    python benchmarks/cpu_int4.py                          # SmolLM2-135M shapes, 2 threads
    python benchmarks/cpu_int4.py --threads 1 --rows 1,2,4,8,32
    python benchmarks/cpu_int4.py --shape qwen2.5-0.5b --awq-group 128 --layers 12

Where the kernel serves, the output projection (``--vocab`` x hidden, as a Q8_0 table) is timed too: its 8-bit loops
(``cpu_int4_amx.q8_amx_mm``, ``head_q8_ms``) against the bf16 copy (``head_bf16_ms``), three copies in turn so that
they come from memory: where the 8-bit one stops winning is ``Q8_MAX_ROWS``. On the dot products (no AMX) the loops
with 8-bit inputs are timed too (``int4_mm_q8_inputs``: ``q8in_ms``, ``head_q8in_ms``), a GGUF file's default there.

``--offline-awq MODEL`` instead times ``kvloom.LLM`` end to end: a ``benchmarks/shapes.py`` config with an AWQ
quantization_config (group ``--awq-group``, default 128) and dummy weights, in bfloat16, with the 4-bit copies
and without (``gguf_int4=False``), alternated over ``--rounds``; greedy 48 tokens after 32-token prompts at batch
1 and 4, each run in its own process so that both start alike.

    python benchmarks/cpu_int4.py --offline-awq qwen3-0.6b --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvloom.kernels import cpu_int4_amx
from kvloom.kernels.cpu_int4 import int4_mm, int4_supported
from kvloom.kernels.cpu_linear import PackedLinear

# (out, in) of one layer's q/k/v, o, gate/up and down projections
VOCAB = {"smollm2-135m": 49152, "gemma3-270m": 262144, "qwen2.5-0.5b": 151936}
SHAPES = {"smollm2-135m": ((960, 576), (576, 576), (3072, 576), (576, 1536), 30),
          "gemma3-270m": ((1536, 640), (640, 1024), (4096, 640), (640, 2048), 18),
          "qwen2.5-0.5b": ((1152, 896), (896, 896), (9728, 896), (896, 4864), 24)}  # its AWQ release's shapes


def awq_layer(n: int, k: int, group: int, gen: torch.Generator):
    """(bf16 weight, packed 4-bit weight, scales-and-zeros, codes) of a random AWQ GEMM layer of ``n`` x ``k``."""
    from kvloom.kernels.cpu_int4 import pack_int4, zero_point_codes
    from kvloom.kernels.quant_reference import awq_codes, dequantize_awq

    qweight, qzeros = (torch.randint(-2**31, 2**31 - 1, (rows, n // 8), generator=gen, dtype=torch.int64)
                       .to(torch.int32) for rows in (k, k // group))
    scales = (torch.rand(k // group, n, generator=gen) * 0.004 + 0.002).half()
    codes = zero_point_codes(*awq_codes(qweight, qzeros), scales, group)
    dense = dequantize_awq(qweight, qzeros, scales, group, torch.bfloat16)
    return dense, *pack_int4(*codes, torch.bfloat16), codes[0]


def offline_awq(model: str, group: int, rounds: int) -> None:
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from benchmarks.shapes import SHAPES as CONFIGS

    folder = Path(tempfile.mkdtemp())
    config = dict(CONFIGS[model], quantization_config={"quant_method": "awq", "bits": 4, "group_size": group,
                                                       "zero_point": True, "version": "gemm"})
    (folder / "config.json").write_text(json.dumps(config))
    runs = []
    for r in range(rounds):
        for on in (True, False):
            out = subprocess.run([sys.executable, __file__, "--offline-run", str(folder), "--int4", str(int(on))],
                                 capture_output=True, text=True, check=True).stdout
            runs.append(dict(json.loads(out.strip().splitlines()[-1]), round=r))
    print(json.dumps({"benchmark": "cpu_int4 offline awq", "model": model, "group": group, "runs": runs,
                      "load": os.getloadavg()}, indent=1))


def offline_run(folder: str, int4: bool) -> None:
    from kvloom import LLM, SamplingParams

    llm = LLM(folder, load_format="dummy", dtype="bfloat16", gguf_int4=int4, max_model_len=512)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate([[5, 6, 7, 8] * 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    result = {"int4": int4, "kernel": llm.engine.quantization.kernel[:60]}
    for batch in (1, 4):
        t = time.perf_counter()
        llm.generate([[5 + i, 6, 7, 8] * 8 for i in range(batch)], sp, use_tqdm=False)
        result[f"batch{batch}_tok_s"] = round(batch * 48 / (time.perf_counter() - t), 1)
    result["threads"] = torch.get_num_threads()  # the engine's governor may drop to one under load
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--awq-group", type=int, default=0, help="AWQ layers with this group size (0: GGUF-style, 32)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    p.add_argument("--vocab", type=int, default=0, help="output projection rows (0: the model's; -1: not timed)")
    p.add_argument("--offline-awq", default=None, help="a benchmarks/shapes.py model: time kvloom.LLM end to end")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--offline-run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--int4", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not int4_supported():
        raise SystemExit("this torch has no CPU int4 matmul")
    if args.offline_run:
        return offline_run(args.offline_run, bool(args.int4))
    if args.offline_awq:
        return offline_awq(args.offline_awq, args.awq_group or 128, args.rounds)
    torch.set_num_threads(args.threads)
    *shapes, layers = SHAPES[args.shape]
    layers = args.layers or layers
    group = args.awq_group or 32
    gen = torch.Generator().manual_seed(0)
    amx = cpu_int4_amx.available()
    q8in = amx and not cpu_int4_amx.on_amx()  # the 8-bit input loops are the dot products' alone
    dense, packed = [], []
    for n, k in shapes * layers:
        if args.awq_group:
            weight, w4, sz, q = awq_layer(n, k, group, gen)
        else:
            weight = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
            q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
            w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.randn(k // 32, n, 2, generator=gen).bfloat16()
        dense.append((k, PackedLinear(weight, None, 32)))
        packed.append((k, w4, sz, (cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz)) if amx else None))
    hidden = shapes[1][0]
    vocab = args.vocab or VOCAB[args.shape]
    heads = []  # (8-bit codes, fp16 scales, bf16 copy) of the output projection, three of them
    if amx and vocab > 0:
        for _ in range(3):
            q8 = torch.randint(-127, 128, (vocab, hidden), generator=gen).to(torch.int8)
            d = (torch.rand(vocab, hidden // 32, generator=gen) * 0.01).half()
            w = (q8.float().view(vocab, -1, 32) * d.float()[..., None]).view(vocab, hidden).bfloat16()
            quads = cpu_int4_amx.pack_q8_quads(q8) if q8in else None
            heads.append((cpu_int4_amx.pack_q8_codes(q8), d.t().contiguous(), PackedLinear(w, None, 32), quads))
            del q8, w
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {"bf16": [], "int4": [], "amx": [], "q8in": [], "head_q8": [], "head_bf16": [],
                                         "head_q8in": []}
        for _ in range(args.repeats):
            t = time.perf_counter()
            for k, layer in dense:
                layer(xs[k])
            times["bf16"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for k, w, sz, _ in packed:
                int4_mm(xs[k], w, sz, group)
            times["int4"].append(time.perf_counter() - t)
            if amx:
                t = time.perf_counter()
                for k, _, _, (codes, sz) in packed:
                    cpu_int4_amx.int4_amx_mm(xs[k], codes, sz, group)
                times["amx"].append(time.perf_counter() - t)
            if q8in:
                t = time.perf_counter()
                for k, _, _, (codes, sz) in packed:
                    cpu_int4_amx.int4_q8_mm(xs[k], codes, sz, group)
                times["q8in"].append(time.perf_counter() - t)
            if heads:
                x = xs[hidden]
                t = time.perf_counter()
                for codes, d, _, _ in heads:
                    cpu_int4_amx.q8_amx_mm(x, codes, d)
                times["head_q8"].append((time.perf_counter() - t) / len(heads))
                t = time.perf_counter()
                for _, _, copy, _ in heads:
                    copy(x)
                times["head_bf16"].append((time.perf_counter() - t) / len(heads))
                if q8in:
                    t = time.perf_counter()
                    for _, d, _, quads in heads:
                        cpu_int4_amx.q8_q8_mm(x, quads, d)
                    times["head_q8in"].append((time.perf_counter() - t) / len(heads))
        bf16, int4 = (statistics.median(times[n]) * 1e3 for n in ("bf16", "int4"))
        row = {"rows": rows, "bf16_ms": round(bf16, 3), "int4_ms": round(int4, 3),
               "bf16_over_int4": round(bf16 / int4, 2)}
        if amx:
            amx_ms = statistics.median(times["amx"]) * 1e3
            row.update(amx_ms=round(amx_ms, 3), bf16_over_amx=round(bf16 / amx_ms, 2),
                       int4_over_amx=round(int4 / amx_ms, 2))
        if q8in:
            q8in_ms = statistics.median(times["q8in"]) * 1e3
            row.update(q8in_ms=round(q8in_ms, 3), bf16_over_q8in=round(bf16 / q8in_ms, 2),
                       amx_over_q8in=round(amx_ms / q8in_ms, 2))
        if heads:
            q8_ms, head_ms = (statistics.median(times[n]) * 1e3 for n in ("head_q8", "head_bf16"))
            row.update(head_q8_ms=round(q8_ms, 3), head_bf16_ms=round(head_ms, 3),
                       head_bf16_over_q8=round(head_ms / q8_ms, 2))
            if q8in:
                q8in_head = statistics.median(times["head_q8in"]) * 1e3
                row.update(head_q8in_ms=round(q8in_head, 3), head_bf16_over_q8in=round(head_ms / q8in_head, 2))
        rows_out.append(row)
    kernel = ("amx" if cpu_int4_amx.on_amx() else "avx512-bf16 dot") if amx else None
    print(json.dumps({"benchmark": "cpu_int4", "shape": args.shape, "threads": args.threads, "kernel": kernel,
                      "weights": f"awq, group {group}" if args.awq_group else "gguf-style, group 32",
                      "linear_layers": len(dense), "output_projection": [vocab, hidden] if heads else None,
                      "load": os.getloadavg(), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
