"""The fused MoE (``kvloom.kernels.moe``): its expert-sorted row order, the Triton kernel against the PyTorch
reference through the ``tk`` fixture (interpreted on the CPU, compiled on a GPU), the quantized expert formats
packed here from their documented layouts, and every kernel variant's sm90 build on any machine."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels.moe import FP8Experts, IntExperts, MXFP4Experts, fused_experts
from kvloom.kernels.moe.align import moe_align
from kvloom.kernels.moe.reference import fused_experts_reference
from kvloom.kernels.moe.weights import deinterleave_gate_up
from tests.quant_checkpoints import awq_quantize, gptq_quantize
from tests.quant_checkpoints import fp8_quantize as fp8_checkpoint

HIDDEN, INTER = 64, 48


def moe_inputs(num_tokens, num_experts, top_k, inter=INTER, seed=0, dtype=torch.float32):
    """x, w13, w2, biases and a softmax top-k routing (normalised, as Mixtral's router does)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, HIDDEN, generator=gen) * 0.1
    w2 = torch.randn(num_experts, HIDDEN, inter, generator=gen) * 0.1
    b13 = torch.randn(num_experts, 2 * inter, generator=gen) * 0.5
    b2 = torch.randn(num_experts, HIDDEN, generator=gen) * 0.5
    weights, ids = torch.randn(num_tokens, num_experts, generator=gen).softmax(-1).topk(top_k)
    weights = weights / weights.sum(-1, keepdim=True)
    return [t.to(dtype) for t in (x, w13, w2, b13, b2)] + [weights, ids]


def test_rows_sorted_by_expert_and_padded_to_blocks():
    ids = torch.tensor([[3, 0], [0, 5], [3, 3], [5, 0]])
    blocks = moe_align(ids, num_experts=6, block_m=4)
    sentinel = ids.numel()
    rows, experts = blocks.sorted_rows.tolist(), blocks.block_expert.tolist()
    assert experts[:3] == [0, 3, 5] and set(experts[3:]) == {-1}  # idle experts 1, 2, 4 get no block
    assert rows[:4] == [1, 2, 7, sentinel] and rows[4:8] == [0, 4, 5, sentinel] and rows[8:12] == [3, 6, sentinel,
                                                                                                   sentinel]
    assert set(rows[12:]) == {sentinel}
    # the capacity depends on the shapes only: a CUDA graph of a token count serves any routing
    other = moe_align(torch.tensor([[1, 2], [1, 2], [1, 2], [1, 2]]), 6, 4)
    assert other.sorted_rows.shape == blocks.sorted_rows.shape


def _runs(blocks):
    """(expert, row) of every padded slot, sorted: the order's content, whatever the order within a run."""
    experts = blocks.block_expert.long().repeat_interleave(blocks.block_m)
    return sorted(zip(experts.tolist(), blocks.sorted_rows.tolist()))


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 8, 128, 16), (17, 4, 10, 16), (256, 8, 128, 16),
                                                          (64, 2, 6, 64), (3, 2, 300, 32)])
def test_align_kernel_builds_the_same_order(tk, tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    want = moe_align(ids, experts, block_m)
    got = tk.moe.moe_align_triton(ids.to(tk.device), experts, block_m)
    assert torch.equal(got.block_expert.cpu(), want.block_expert)
    assert _runs(got._replace(sorted_rows=got.sorted_rows.cpu(), block_expert=got.block_expert.cpu())) == _runs(want)


def test_reference_matches_a_loop_over_tokens():
    """The oracle itself: each token's weighted sum over its experts, one token at a time."""
    x, w13, w2, b13, b2, weights, ids = moe_inputs(7, 6, 2)
    got = fused_experts_reference(x, w13, w2, weights, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    for t in range(7):
        want = torch.zeros(HIDDEN)
        for k in range(2):
            e = int(ids[t, k])
            gate, up = (w13[e] @ x[t] + b13[e]).chunk(2)
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            want += weights[t, k] * (w2[e] @ (gate * torch.sigmoid(1.702 * gate) * (up + 1)) + b2[e])
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_experts,top_k,num_tokens,activation,bias", [
    (6, 2, 1, "silu", False),  # a decode step
    (10, 4, 3, "swiglu_oai", True),  # gpt-oss's activation and biases
    (6, 4, 17, "silu", True),  # more rows than a block for some experts
    (10, 2, 17, "swiglu_oai", False),
])
def test_triton_matches_the_reference(tk, num_experts, top_k, num_tokens, activation, bias):
    x, w13, w2, b13, b2, weights, ids = moe_inputs(num_tokens, num_experts, top_k, seed=num_tokens)
    kw = dict(activation=activation, w13_bias=b13 if bias else None, w2_bias=b2 if bias else None)
    want = fused_experts_reference(x, w13, w2, weights, ids, **kw)
    dev = tk.device
    on = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    args = [t.to(dev) for t in (x, w13, w2, weights, ids)]
    got = tk.moe.fused_experts_triton(*args, **on)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    # a taller block (several experts' runs padded differently) gives the same output
    tile = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    torch.testing.assert_close(tk.moe.fused_experts_triton(*args, **on, tiles=tile).cpu(), want, atol=2e-5, rtol=2e-5)


def _half_dtypes():
    return [torch.float16, torch.bfloat16] if torch.cuda.is_available() else [torch.float16]  # interpreter: no bf16


@pytest.mark.parametrize("dtype", _half_dtypes())
def test_triton_in_half_precision_rounds_as_the_reference(tk, dtype):
    x, w13, w2, b13, b2, weights, ids = moe_inputs(9, 6, 2, dtype=dtype)
    want = fused_experts_reference(x, w13, w2, weights, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    dev = tk.device
    got = tk.moe.fused_experts_triton(x.to(dev), w13.to(dev), w2.to(dev), weights.to(dev), ids.to(dev),
                                      activation="swiglu_oai", w13_bias=b13.to(dev), w2_bias=b2.to(dev))
    assert got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


# --- quantized experts, packed from the formats' documented layouts --------------------------------
def _per_expert(w, quantize, pair):
    """Each expert's checkpoint tensors (``(gate, up)`` pairs of dicts for w13) and the dequantized stack."""
    items, deq = [], []
    for e in range(w.shape[0]):
        if pair:
            half = w.shape[1] // 2
            (g, dg), (u, du) = quantize(w[e, :half]), quantize(w[e, half:])
            items.append((g, u))
            deq.append(torch.cat([dg, du]))
        else:
            t, d = quantize(w[e])
            items.append(t)
            deq.append(d)
    return items, torch.stack(deq)


def _field(items, name):
    return [tuple(p[name] for p in it) if isinstance(it, tuple) else it[name] for it in items]


def _fp8(kind):
    def make(w, pair):
        strategy = {"tensor": "tensor", "channel": "channel", "block": "block"}[kind]
        quantize = (lambda m: fp8_checkpoint(m, "block", 16)) if kind == "block" else \
            (lambda m: fp8_checkpoint(m, strategy))
        items, deq = _per_expert(w, quantize, pair)
        scale = "weight_scale_inv" if kind == "block" else "weight_scale"
        return FP8Experts.from_experts(_field(items, "weight"), _field(items, scale),
                                       block=(16, 16) if kind == "block" else None), deq
    return make


def _awq(w, pair):
    items, deq = _per_expert(w, lambda m: awq_quantize(m, 32), pair)
    return IntExperts.from_awq(_field(items, "qweight"), _field(items, "qzeros"), _field(items, "scales"), 32), deq


def _gptq(bits, desc_act):
    def make(w, pair):
        gen = torch.Generator().manual_seed(5)
        items, deq = _per_expert(w, lambda m: gptq_quantize(m, bits, 16, False, desc_act, False, gen), pair)
        return IntExperts.from_gptq(_field(items, "qweight"), _field(items, "qzeros"), _field(items, "scales"), bits,
                                    16, g_idx=_field(items, "g_idx")), deq
    return make


def _fp8_online(w, pair):
    q = FP8Experts.quantize(w)
    return q, q.dequantize()


FORMATS = {
    "fp8_tensor": _fp8("tensor"),  # Mixtral FP8: one scale per expert and projection
    "fp8_channel": _fp8("channel"),
    "fp8_block": _fp8("block"),  # 48 gate rows: 3 blocks of 16 each half
    "fp8_online": _fp8_online,  # --quantization fp8 of float experts
    "awq": _awq,
    "gptq4": _gptq(4, False),
    "gptq4_desc_act": _gptq(4, True),  # gate and up with their own input order
    "gptq8": _gptq(8, False),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantized_experts_match_the_reference_on_their_dequantized_weights(tk, fmt):
    num_experts, top_k, tokens = (10, 2, 3) if "gptq" in fmt else (6, 4, 5)
    inter = 64 if fmt != "fp8_block" else INTER
    x, w13, w2, b13, b2, weights, ids = moe_inputs(tokens, num_experts, top_k, inter=inter, seed=3)
    q13, d13 = FORMATS[fmt](w13, True)
    q2, d2 = FORMATS[fmt](w2, False)
    # the packed tensors hold the weights the format's own dequantization gives
    torch.testing.assert_close(q13.dequantize(), d13, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q2.dequantize(), d2, atol=1e-6, rtol=1e-6)
    assert (d13 - w13).abs().max() < 0.1  # and a quantization of the float weights, not noise
    kw = dict(activation="silu", w13_bias=b13, w2_bias=b2)
    want = fused_experts_reference(x, d13, d2, weights, ids, **kw)
    # the CPU path dequantizes and runs the reference
    torch.testing.assert_close(fused_experts(x, q13, q2, weights, ids, **kw), want, atol=1e-6, rtol=1e-6)
    dev = tk.device
    q13d, q2d = q13.to(dev), q2.to(dev)
    got = tk.moe.fused_experts_triton(x.to(dev), q13d, q2d, weights.to(dev), ids.to(dev), activation="silu",
                                      w13_bias=b13.to(dev), w2_bias=b2.to(dev))
    torch.testing.assert_close(got.cpu(), want, atol=5e-5, rtol=5e-5)


def _mxfp4_checkpoint(n, k, num_experts, gen):
    """gpt-oss's tensors: ``blocks [E, n, k / 32, 16]`` of random e2m1 pairs, e8m0 ``scales`` near 2 ** -5."""
    blocks = torch.randint(0, 256, (num_experts, n, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(119, 125, (num_experts, n, k // 32), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0] = 0  # e8m0's smallest, 2 ** -127
    return blocks, scales


def _mxfp4_by_hand(blocks, scales):
    """The documented dequantization, one value at a time: byte ``k // 2`` of input ``k``'s 32-block, low nibble
    for even ``k``, e2m1 (sign, 2 exponent bits biased by 1, 1 mantissa bit) times ``2 ** (scale - 127)``."""
    e, n, groups, _ = blocks.shape
    out = torch.empty(e, n, groups * 32, dtype=torch.float64)
    b = blocks.reshape(e, n, -1).long()
    for k in range(groups * 32):
        nib = (b[..., k // 2] >> (4 * (k % 2))) & 15
        exp, man = (nib >> 1) & 3, (nib & 1).double()
        mag = torch.where(exp == 0, man * 0.5, (1 + man / 2) * 2.0 ** (exp.double() - 1))
        out[..., k] = torch.where(nib >= 8, -mag, mag) * 2.0 ** (scales[..., k // 32].double() - 127)
    return out.float()


def test_gptq_desc_act_down_projection_split_over_ranks():
    """Tensor parallelism splits w2's inputs: a rank's slice of desc_act inputs (packed rows and g_idx narrowed,
    every group's zeros and scales kept) is that slice of the whole expert's weight."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, HIDDEN, 64, generator=gen) * 0.1
    items, deq = _per_expert(w, lambda m: gptq_quantize(m, 4, 16, False, True, False, gen), False)
    for rank in range(2):
        rows, cols = slice(rank * 4, rank * 4 + 4), slice(rank * 32, rank * 32 + 32)  # 8 inputs a packed row
        part = IntExperts.from_gptq([t["qweight"][rows] for t in items], _field(items, "qzeros"),
                                    _field(items, "scales"), 4, 16, g_idx=[t["g_idx"][cols] for t in items])
        assert part.shape == (3, HIDDEN, 32)
        torch.testing.assert_close(part.dequantize(), deq[:, :, cols], atol=1e-6, rtol=1e-6)


def test_mxfp4_dequantizes_as_documented_and_as_transformers_does():
    gen = torch.Generator().manual_seed(0)
    blocks, scales = _mxfp4_checkpoint(2 * INTER, HIDDEN, 3, gen)
    experts = MXFP4Experts.from_checkpoint(blocks, scales, interleaved_gate_up=True)
    by_hand = _mxfp4_by_hand(blocks, scales)
    assert torch.equal(experts.dequantize(), deinterleave_gate_up(by_hand, 1))
    assert torch.equal(experts.dequantize()[:, :INTER], by_hand[:, 0::2])  # gate rows were the even ones
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N], gate/up interleaved
    assert torch.equal(deinterleave_gate_up(theirs.transpose(1, 2), 1), experts.dequantize())


@pytest.mark.parametrize("num_experts,top_k,num_tokens", [(6, 4, 3), (10, 2, 17)])
def test_mxfp4_experts_match_the_reference(tk, num_experts, top_k, num_tokens):
    """gpt-oss: MXFP4 experts, biases, the clamped SwiGLU."""
    gen = torch.Generator().manual_seed(num_tokens)
    x, _, _, b13, b2, weights, ids = moe_inputs(num_tokens, num_experts, top_k, inter=64, seed=1)
    q13 = MXFP4Experts.from_checkpoint(*_mxfp4_checkpoint(128, HIDDEN, num_experts, gen), interleaved_gate_up=True)
    q2 = MXFP4Experts.from_checkpoint(*_mxfp4_checkpoint(HIDDEN, 64, num_experts, gen))
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    want = fused_experts_reference(x, q13.dequantize(), q2.dequantize(), weights, ids, **kw)
    assert want.abs().max() > 0.5  # weights of a useful size: the check below is not vacuous
    dev = tk.device
    got = tk.moe.fused_experts_triton(x.to(dev), q13.to(dev), q2.to(dev), weights.to(dev), ids.to(dev),
                                      activation="swiglu_oai", w13_bias=b13.to(dev), w2_bias=b2.to(dev))
    torch.testing.assert_close(got.cpu(), want, atol=5e-5, rtol=5e-5)


def test_bad_shapes_are_named():
    w = torch.zeros(4, 32, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale shape \(4, 16\).*expected \(4, 32\)"):
        FP8Experts(w, torch.ones(4, 16))
    with pytest.raises(ValueError, match="MXFP4 scales shape"):
        MXFP4Experts(torch.zeros(4, 32, 32, dtype=torch.uint8), torch.zeros(4, 32, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="int experts of 3 bits"):
        IntExperts(torch.zeros(4, 8, 32, dtype=torch.int32), torch.zeros(4, 2, 32), torch.zeros(4, 2, 32), 32, 3)


def test_tiles_by_rows_per_expert_and_overridable():
    from kvloom.kernels.moe.triton import moe_tiles
    from kvloom.kernels.options import KernelOptions

    assert moe_tiles(1, 8, 128)["BLOCK_M"] == 16  # decode
    assert moe_tiles(256, 8, 128)["BLOCK_M"] == 16  # Qwen3-30B-A3B: 16 rows an expert
    assert moe_tiles(256, 2, 8)["BLOCK_M"] == 64  # Mixtral: 64 rows an expert
    mine = KernelOptions.from_mapping({"moe_tiles": [[None, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64)]]})
    assert moe_tiles(1, 8, 128, mine) == dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64)


# --- sm90 builds ------------------------------------------------------------------------------------
def test_moe_kernel_variants_compile_for_sm90():
    """Every weight format of both GEMMs (dense, FP8 per channel and per block, MXFP4, int4 with and without g_idx,
    int8; gpt-oss's activation and biases; each tile of the table) compiles for an H100/H200 (sm90) on this
    machine, GPU or not, onto tensor cores, and so does the align kernel. The interpreter runs the kernels as Python and does not catch what
    only the compiler rejects. In a fresh interpreter: this module's kernels are interpreted."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    done = json.loads(run.stdout.strip().splitlines()[-1])
    gemms = {k: v for k, v in done.items() if not k.startswith("align/")}
    assert len(gemms) == 22 and set(gemms.values()) == {"mma"}, done
    assert [v for k, v in done.items() if k.startswith("align/")] == ["built", "built"], done


_COMPILE_SM90 = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvloom.kernels.moe import triton as moe

def build(fn, types, const, launch):
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in const else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch)
    ptx = k.asm["ptx"]
    if ".target sm_90" not in ptx or not k.asm["cubin"]:
        return "no"
    return "mma" if "mma.sync" in ptx or "wgmma" in ptx else "built"

# format: (FORMAT, weight, scale, zeros, g_idx, BITS, GIDX_HALVES)
formats = {"dense": (0, "*bf16", "*bf16", "*bf16", "*bf16", 4, 0), "fp8": (1, "*fp8e4nv", "*fp32", "*fp8e4nv", "*fp8e4nv", 4, 0),
           "fp8_block": (2, "*fp8e4nv", "*fp32", "*fp8e4nv", "*fp8e4nv", 4, 0), "mxfp4": (3, "*u8", "*u8", "*u8", "*u8", 4, 0),
           "int4": (4, "*i32", "*fp16", "*u8", "*i32", 4, 0), "int4_g_idx": (4, "*i32", "*fp16", "*u8", "*i32", 4, 2),
           "int8": (4, "*i32", "*fp16", "*u8", "*i32", 8, 0)}
scalars = dict(s_se="i32", s_sr="i32", group_size="i32", scale_bn="i32", scale_bk="i32", num_rows="i32", K="i32")
done = {}
for name, (fmt, w, s, z, g, bits, halves) in formats.items():
    weights = dict(w_ptr=w, s_ptr=s, z_ptr=z, g_ptr=g, sorted_ptr="*i32", expert_ptr="*i32", **scalars)
    tiles = [t for _, t in moe.MOE_TILES] if name == "dense" else [moe.MOE_TILES[0][1]]
    for i, tile in enumerate(tiles):
        tile = dict(tile)
        launch = dict(num_warps=tile.pop("num_warps"), num_stages=tile.pop("num_stages"))
        for act, bias in ((0, False), (1, True)) if name in ("dense", "mxfp4") and i == 0 else ((0, False),):
            const = dict(FORMAT=fmt, BITS=bits, GIDX_HALVES=halves, HAS_BIAS=bias, DOT_PRECISION="tf32", **tile)
            types = dict(weights, x_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", I="i32", stride_xm="i32",
                         up_srow="i32", alpha="fp32", limit="fp32")
            done[f"gate_up/{name}/{i}/{act}"] = build(moe._moe_gate_up_kernel, types,
                                                      dict(const, TOP_K=8, ACTIVATION=act), launch)
            types = dict(weights, a_ptr="*bf16", bias_ptr="*bf16", tw_ptr="*fp32", out_ptr="*fp32", N="i32")
            done[f"down/{name}/{i}/{int(bias)}"] = build(moe._moe_down_kernel, types, const, launch)
types = dict(ids_ptr="*i64", offsets_ptr="*i32", rank_ptr="*i32", sorted_ptr="*i32", expert_ptr="*i32",
             num_rows="i32", num_experts="i32", num_blocks="i32")
for block_m, experts in ((16, 128), (64, 512)):
    const = dict(BLOCK_M=block_m, ROWS=1024, EXPERTS=experts, BLOCKS=max(16, min(64, 8192 // experts)))
    done[f"align/{block_m}/{experts}"] = build(moe._moe_align_kernel, types, const, dict(num_warps=8))
print(json.dumps(done))
"""
