"""The AMX 4-bit matmul (``kvloom.kernels.cpu_int4_amx``) against the bf16 weights the codes stand for, and the
4-bit layer's choice of kernel by rows (``cpu_packing.int4_linear``), eagerly and as one compiled op."""

import os
import subprocess
import sys

import pytest
import torch

from kvloom.kernels import cpu_int4_amx
from kvloom.kernels.cpu_int4 import dequantize_int4, int4_supported, pack_int4

pytestmark = pytest.mark.skipif(not (cpu_int4_amx.available() and int4_supported()),
                                reason="no AMX here (or no C++ compiler builds the kernel)")


def _layer(out_features, in_features, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=g)
    scale = torch.rand(out_features, in_features // group, generator=g) * 0.02
    zero = torch.randn(out_features, in_features // group, generator=g) * 0.01
    packed, sz = pack_int4(q, scale, zero, torch.bfloat16)
    # the bf16 weights: the scales and zeros as packed (bf16), each weight rounded to bf16 as the kernel rounds it
    w = dequantize_int4(q, sz[..., 0].t().float(), sz[..., 1].t().float(), group).bfloat16().float()
    return q, packed, sz, w


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32, 33, 48, 100])
@pytest.mark.parametrize("shape", [(64, 64, 32), (960, 576, 32), (48, 256, 128), (32, 512, 64)])
def test_amx_matmul_equals_the_bf16_weights(shape, rows):
    out_features, in_features, group = shape
    q, _, sz, w = _layer(*shape)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_int4_amx.int4_amx_mm(x, cpu_int4_amx.pack_codes(q), sz, group).float()
    want = x.float() @ w.t()
    # float32 sums in another order, the result rounded to bf16: within a bf16 step of each output
    assert got.shape == (rows, out_features)
    assert ((got - want).abs() <= 2**-8 * want.abs() + 1e-3 * want.abs().max()).all(), (got - want).abs().max()


def test_shapes_it_does_not_take_are_refused_by_name():
    assert not cpu_int4_amx.supports(40, 64, 32)  # outputs not a multiple of 16
    assert not cpu_int4_amx.supports(64, 48, 16)  # a group smaller than a tile's 32 inputs
    q, _, sz, _ = _layer(64, 64, 32)
    with pytest.raises(ValueError, match="group 16"):
        cpu_int4_amx.int4_amx_mm(torch.zeros(2, 64, dtype=torch.bfloat16), cpu_int4_amx.pack_codes(q), sz, 16)
    with pytest.raises(TypeError, match="torch.float32"):
        cpu_int4_amx.int4_amx_mm(torch.zeros(2, 64), cpu_int4_amx.pack_codes(q), sz, 32)


def test_the_layer_takes_each_kernel_by_rows_and_they_agree(monkeypatch):
    from kvloom.core.model import cpu_packing
    from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

    if not packing_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing in this torch")
    q, packed, sz, w = _layer(96, 256, 32)
    codes, dense = cpu_int4_amx.pack_codes(q), PackedLinear(w.bfloat16(), None, 32)
    bias = torch.randn(96).bfloat16()
    for rows, kernel in ((1, "torch"), (4, "torch"), (5, "amx"), (48, "amx"), (49, "dense"), (300, "dense")):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        calls = []
        monkeypatch.setattr(cpu_packing, "int4_mm", lambda *a, f=cpu_packing.int4_mm: (calls.append("torch"), f(*a))[1])
        monkeypatch.setattr(cpu_int4_amx, "int4_amx_mm",
                            lambda *a, f=cpu_int4_amx.int4_amx_mm: (calls.append("amx"), f(*a))[1])
        args = (x, packed, codes, sz, 32, dense.packed_weight, bias, cpu_packing.TORCH_INT4_ROWS,
                cpu_packing.AMX_INT4_MAX_ROWS)
        got = cpu_packing.int4_linear(*args).float()
        monkeypatch.undo()
        assert calls == ([] if kernel == "dense" else [kernel]), (rows, calls)
        want = x.float() @ w.t() + bias.float()
        assert (got - want).abs().max() <= 0.01 * want.abs().max(), (rows, (got - want).abs().max())
        torch.testing.assert_close(cpu_packing.int4_linear_op(*args), cpu_packing.int4_linear(*args))


def test_a_compiled_step_runs_every_row_count_through_one_graph():
    """The kernel choice happens inside the op: a function compiled once (its rows dynamic, as the engine's steps
    are) takes 2, 7, 30 and 100 rows, three kernels, without compiling again."""
    script = """
import torch
from kvloom.core.model import cpu_packing
from kvloom.kernels import cpu_int4_amx
from kvloom.kernels.cpu_int4 import pack_int4
from kvloom.kernels.cpu_linear import PackedLinear
q = torch.randint(0, 16, (64, 128))
packed, sz = pack_int4(q, torch.rand(64, 4) * 0.02, torch.zeros(64, 4), torch.bfloat16)
codes, dense = cpu_int4_amx.pack_codes(q), PackedLinear(torch.randn(64, 128).bfloat16(), None, 32)
compiles = []
def backend(gm, example_inputs):
    compiles.append(1)
    return gm
@torch.compile(backend=backend)
def step(x):
    return torch.relu(cpu_packing.int4_linear_op(x, packed, codes, sz, 32, dense.packed_weight, None, 4, 48))
for rows in (2, 7, 30, 100):
    x = torch.randn(rows, 128).bfloat16()
    torch._dynamo.maybe_mark_dynamic(x, 0)  # as the engine marks a step's rows
    want = torch.relu(cpu_packing.int4_linear(x, packed, codes, sz, 32, dense.packed_weight, None, 4, 48))
    torch.testing.assert_close(step(x), want)
print("compiles", len(compiles))
"""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiles 1" in done.stdout, done.stdout
