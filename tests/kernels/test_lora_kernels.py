"""The LoRA shrink/expand kernels (``kvloom.kernels.triton_lora``) against the PyTorch reference, through the
``tk`` fixture (interpreted on the CPU, compiled on a GPU), and their sm90 build on any machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvloom.kernels import lora_reference as ref


def _weights(slots, slices, rank, k, ranks, dtype, seed=0):
    """Slot weights as the model keeps them: each slot's rank ``ranks[slot]`` padded with zeros to ``rank``."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(size for _, size in slices)
    a = torch.zeros(slots, len(slices), rank, k)
    b = torch.zeros(slots, n, rank)
    for slot, r in enumerate(ranks):
        a[slot, :, :r] = torch.randn(len(slices), r, k, generator=gen) * 0.1
        b[slot, :, :r] = torch.randn(n, r, generator=gen) * 0.1
    scale = torch.rand(slots, len(slices), generator=gen) + 0.5
    return a.to(dtype), b.to(dtype), scale


def _slices(sizes):
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    return list(zip(starts, sizes))


@pytest.mark.parametrize("sizes,k,num_tokens,token_slots", [
    ([64, 32, 32], 64, 21, None),  # a qkv layer: three slices, a tile of outputs across two of them
    ([48, 48], 96, 9, None),  # gate/up
    ([40], 1024, 5, [2, -1, 0, 2, 2]),  # one slice, few tokens and a long K: the split-K path
    ([40], 64, 3, [-1, -1, -1]),  # no adapter token at all
    ([64, 32, 32], 64, 6, [1, 1, 1, 1, 1, 1]),  # one adapter for the whole batch
])
def test_shrink_and_expand_match_the_reference(tk, sizes, k, num_tokens, token_slots):
    slices = _slices(sizes)
    rank, num_slots, max_loras = 8, 3, 3
    a, b, scale = _weights(num_slots, slices, rank, k, ranks=[8, 4, 2], dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, k, generator=gen)
    y = torch.randn(num_tokens, sum(sizes), generator=gen)
    if token_slots is None:  # every slot and the base, interleaved
        token_slots = [(i % (num_slots + 1)) - 1 for i in range(num_tokens)]
    slots = np.array(token_slots, dtype=np.int64)
    groups = ref.groups_of(torch.from_numpy(slots))
    expected = ref.lora_add(y.clone(), x, a, b, scale, slices, groups)
    # The CPU path (no gather for a whole batch, untargeted slices skipped) is the shrink/expand oracle's sum.
    oracle = ref.lora_expand(y.clone(), ref.lora_shrink(x, a, groups), b, scale, slices, groups)
    torch.testing.assert_close(expected, oracle, rtol=1e-6, atol=1e-6)
    sorted_tokens, seg_start, seg_slot = (torch.from_numpy(t).to(tk.device) for t in ref.segments(slots, max_loras))
    dev = [t.to(tk.device) for t in (x, a, b, scale, y)]
    buf = tk.lora.lora_shrink(dev[0], dev[1], sorted_tokens, seg_start, seg_slot)
    torch.testing.assert_close(buf.cpu(), ref.lora_shrink(x, a, groups), rtol=1e-5, atol=1e-5)
    got = tk.lora.lora_expand(dev[4], buf, dev[2], dev[3], slices, sorted_tokens, seg_start, seg_slot)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    base = slots < 0
    assert torch.equal(got.cpu()[torch.from_numpy(base)], y[torch.from_numpy(base)])  # base rows untouched


def test_segments_group_tokens_by_slot_and_leave_base_tokens_out():
    sorted_tokens, seg_start, seg_slot = ref.segments(np.array([3, -1, 0, 3, -1, 0, 0]), 4)
    assert seg_slot.tolist() == [0, 3, -1, -1]
    assert seg_start.tolist() == [0, 3, 5, 5, 5]
    assert sorted_tokens[:5].tolist() == [2, 5, 6, 0, 3]
    with pytest.raises(ValueError, match="max_loras=1"):
        ref.segments(np.array([0, 1]), 1)


def test_lora_kernels_compile_for_hopper():
    """Compiled for an H100/H200 (sm90) on this machine, GPU or not, at bf16: both kernels build and multiply
    on tensor cores (an MMA instruction in the PTX, not a loop of FMAs)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    found = run.stdout.strip().splitlines()[-1].split()
    assert len(found) == 4 and all(f == "mma" for f in found), found


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvloom.kernels import triton_lora as tl_

def build(fn, types, const):
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in const else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    return "mma" if ("mma.sync" in ptx or "wgmma" in ptx) else "fma"

found = []
shrink = dict(x_ptr="*bf16", a_ptr="*bf16", out_ptr="*fp32", sorted_ptr="*i32", seg_start_ptr="*i32",
              seg_slot_ptr="*i32", K="i32", N="i32", stride_xm="i32", stride_a_slot="i32", stride_om="i32")
for tokens in (4, 256):
    found.append(build(tl_._lora_shrink_kernel, shrink, tl_.shrink_tiles(tokens, 3 * 16, 4096)))
expand = dict(buf_ptr="*fp32", b_ptr="*bf16", scale_ptr="*fp32", y_ptr="*bf16", sorted_ptr="*i32",
              seg_start_ptr="*i32", seg_slot_ptr="*i32", N="i32", RANK="i32", off1="i32", off2="i32",
              stride_bufm="i32", stride_b_slot="i32", stride_ym="i32")
for slices in (1, 3):
    found.append(build(tl_._lora_expand_kernel, expand, dict(NUM_SLICES=slices, BLOCK_M=16, BLOCK_N=64, BLOCK_R=16)))
print(" ".join(found))
"""
