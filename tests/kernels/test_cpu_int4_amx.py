"""The AMX 4-bit and 8-bit matmuls (``kvloom.kernels.cpu_int4_amx``) against the bf16 weights the codes stand for,
and the layers' choice of kernel by rows (``cpu_packing.int4_linear``, ``cpu_packing.q8_linear``), eagerly and as
one compiled op."""

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
@pytest.mark.parametrize("shape", [(64, 64, 32), (960, 576, 32), (48, 256, 128), (32, 512, 64), (64, 96, 32)])
def test_amx_matmul_equals_the_weights_it_multiplies(shape, rows):
    """Up to ``grouped_rows()`` rows the kernel multiplies the codes and scales each group's sums (the weights in
    float32, unrounded); beyond, the weights rounded to bf16 as a bf16 matmul by them would. Shapes with an odd
    number of groups (96 inputs: 3) and groups of several chunks (64, 128) cover the kernel's pairing of groups."""
    out_features, in_features, group = shape
    q, _, sz, w = _layer(*shape)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_int4_amx.int4_amx_mm(x, cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz), group).double()
    if rows <= cpu_int4_amx.grouped_rows():
        w = dequantize_int4(q, sz[..., 0].t().double(), sz[..., 1].t().double(), group)
    want = x.double() @ w.double().t()
    # float32 sums in another order, the result rounded to bf16: within a bf16 step of each output
    assert got.shape == (rows, out_features)
    assert ((got - want).abs() <= 2**-8 * want.abs() + 1e-4 * want.abs().max()).all(), (got - want).abs().max()
    if rows <= cpu_int4_amx.grouped_rows():  # and not the rounded weights' product: the other path is not taken
        rounded = x.double() @ _layer(*shape)[3].double().t()
        assert (got - rounded).abs().mean() > (got - want).abs().mean()  # the mean: the max is one output's rounding


def _rounded_inputs(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``int4_q8_mm`` rounds it: each row's 32 inputs of a chunk to int8 by 127 / max |x| (float32, ties to
    even), times max |x| / 127."""
    chunks = x.float().unflatten(1, (-1, 32))
    m = chunks.abs().amax(-1, keepdim=True)
    q = (chunks * torch.where(m > 0, torch.full_like(m, 127.0) / m, 0)).round()  # not 127 / m: a reciprocal's product
    return (q.double() * (m / 127).double()).flatten(1)


needs_q8_inputs = pytest.mark.skipif(cpu_int4_amx.on_amx(), reason="AMX's build has no 8-bit input loop")


@needs_q8_inputs
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 24, 100, 300])
@pytest.mark.parametrize("shape", [(64, 64, 32), (960, 576, 32), (48, 256, 128), (32, 512, 64), (64, 96, 32)])
def test_int8_inputs_matmul_equals_the_weights_times_the_rounded_inputs(shape, rows):
    """Rows of 1 to 3 (two chains a row), blocks of up to 12, spans of 192 rows; groups of one and several chunks."""
    out_features, in_features, group = shape
    q, _, sz, _ = _layer(*shape)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, in_features, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()
    x[0, :32] = 0  # an all-zero chunk: scale 0
    got = cpu_int4_amx.int4_q8_mm(x, cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz), group).double()
    w = dequantize_int4(q, sz[..., 0].t().double(), sz[..., 1].t().double(), group)
    want = _rounded_inputs(x) @ w.t()
    assert got.shape == (rows, out_features)
    assert ((got - want).abs() <= 2**-8 * want.abs() + 1e-4 * want.abs().max()).all(), (got - want).abs().max()
    exact = x.double() @ w.t()  # and not the unrounded inputs' product
    assert (got - want).abs().mean() < (got - exact).abs().mean()


@needs_q8_inputs
@pytest.mark.parametrize("rows", [4, 7, 12, 13, 24, 200])
@pytest.mark.parametrize("shape", [(64, 64, 32), (960, 576, 32), (48, 256, 128), (64, 96, 32)])
def test_int8_inputs_of_a_block_round_as_each_row_alone(shape, rows):
    """Blocks of 4 or more rows are quantized side by side (lanes a row), a row alone one at a time: each row's
    result is the same to the bit either way (its codes, scales and sums; the integer sums do not depend on the
    block), zero chunks, an outlier and exact ties of the rounding among them."""
    out_features, in_features, group = shape
    q, _, sz, _ = _layer(*shape)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, in_features, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()
    x[0, :32] = 0
    x[rows // 2, 5] = 1000.0
    x[-1, 32:64] = torch.tensor([127.0, 0.5, -0.5, 1.5, 2.5] * 6 + [3.5, -127.0]).bfloat16()  # halves at scale 1
    codes, scales = cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz)
    together = cpu_int4_amx.int4_q8_mm(x, codes, scales, group)
    alone = torch.cat([cpu_int4_amx.int4_q8_mm(x[i:i + 1], codes, scales, group) for i in range(rows)])
    torch.testing.assert_close(together, alone, rtol=0, atol=0)


def test_int8_inputs_are_gguf_files_default_on_the_dot_products_and_a_setting(monkeypatch):
    from kvloom.core.model import cpu_packing

    bf16_rows = cpu_packing.AMX_INT4_MAX_ROWS if cpu_int4_amx.on_amx() else cpu_packing.DOT_INT4_MAX_ROWS
    dots = not cpu_int4_amx.on_amx()
    monkeypatch.delenv("KVLOOM_CPU_INT8_INPUTS", raising=False)
    assert (cpu_int4_amx.q8_inputs(), cpu_int4_amx.q8_inputs(gguf=False)) == (dots, False)
    assert cpu_packing.int4_rows(gguf=False)[1] == bf16_rows
    if dots:
        assert cpu_packing.int4_rows()[1] == cpu_packing.DOT_Q8_INPUTS_MAX_ROWS
    monkeypatch.setenv("KVLOOM_CPU_INT8_INPUTS", "1")
    assert (cpu_int4_amx.q8_inputs(), cpu_int4_amx.q8_inputs(gguf=False)) == (dots, dots)
    monkeypatch.setenv("KVLOOM_CPU_INT8_INPUTS", "0")
    assert (cpu_int4_amx.q8_inputs(), cpu_int4_amx.q8_inputs(gguf=False)) == (False, False)
    assert cpu_packing.int4_rows()[1] == bf16_rows
    monkeypatch.setenv("KVLOOM_CPU_INT8_INPUTS", "yes")
    with pytest.raises(ValueError, match="KVLOOM_CPU_INT8_INPUTS='yes'"):
        cpu_int4_amx.q8_inputs()


def test_shapes_it_does_not_take_are_refused_by_name():
    assert not cpu_int4_amx.supports(40, 64, 32)  # outputs not a multiple of 16
    assert not cpu_int4_amx.supports(64, 48, 16)  # a group smaller than a tile's 32 inputs
    q, _, sz, _ = _layer(64, 64, 32)
    with pytest.raises(ValueError, match="group 16"):
        cpu_int4_amx.int4_amx_mm(torch.zeros(2, 64, dtype=torch.bfloat16), cpu_int4_amx.pack_codes(q), sz, 16)
    with pytest.raises(TypeError, match="torch.float32"):
        cpu_int4_amx.int4_amx_mm(torch.zeros(2, 64), cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz), 32)


def _dispatched_layer():
    """A 96 x 256 layer's copies as ``cpu_packing.int4_linear`` takes them: torch's packed codes and scales, the
    kernel's codes and scales, the oneDNN bf16 copy, a bias; and its bf16 weights."""
    from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

    if not packing_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing in this torch")
    q, packed, sz, w = _layer(96, 256, 32)
    codes, amx_sz = cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz)
    return packed, sz, codes, amx_sz, PackedLinear(w.bfloat16(), None, 32), torch.randn(96).bfloat16(), w


def test_the_layer_takes_each_kernel_by_rows_and_they_agree(monkeypatch):
    from kvloom.core.model import cpu_packing

    packed, sz, codes, amx_sz, dense, bias, w = _dispatched_layer()
    for rows, kernel in ((1, "torch"), (2, "amx"), (16, "amx"), (17, "amx"), (48, "amx"), (49, "dense"),
                         (300, "dense")):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        calls = []
        monkeypatch.setattr(cpu_packing, "int4_mm", lambda *a, f=cpu_packing.int4_mm: (calls.append("torch"), f(*a))[1])
        monkeypatch.setattr(cpu_int4_amx, "int4_amx_mm",
                            lambda *a, f=cpu_int4_amx.int4_amx_mm: (calls.append("amx"), f(*a))[1])
        args = (x, packed, sz, codes, amx_sz, 32, dense.packed_weight, bias, cpu_packing.TORCH_INT4_ROWS,
                cpu_packing.AMX_INT4_MAX_ROWS)
        got = cpu_packing.int4_linear(*args).float()
        monkeypatch.undo()
        assert calls == ([] if kernel == "dense" else [kernel]), (rows, calls)
        want = x.float() @ w.t() + bias.float()
        assert (got - want).abs().max() <= 0.01 * want.abs().max(), (rows, (got - want).abs().max())
        torch.testing.assert_close(cpu_packing.int4_linear_op(*args), cpu_packing.int4_linear(*args))


@needs_q8_inputs
def test_the_layer_takes_the_int8_input_loop_where_asked():
    from kvloom.core.model import cpu_packing

    packed, sz, codes, amx_sz, dense, bias, _ = _dispatched_layer()
    for rows in (1, 2, 40, 500):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        args = (x, packed, sz, codes, amx_sz, 32, dense.packed_weight, bias, 0, 1 << 14, 1)
        got = cpu_packing.int4_linear(*args)
        want = cpu_int4_amx.int4_q8_mm(x, codes, amx_sz, 32) + bias
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(cpu_packing.int4_linear_op(*args), got, rtol=0, atol=0)
        # a layer keeping no copy for torch's matmul takes the op of fewer arguments: the same results
        slim = (x, codes, amx_sz, 32, dense.packed_weight, bias, 1 << 14, 1)
        torch.testing.assert_close(cpu_packing.kernel_linear(*slim), got, rtol=0, atol=0)
        torch.testing.assert_close(cpu_packing.kernel_linear_op(*slim), got, rtol=0, atol=0)


def test_the_slim_op_takes_the_kernel_up_to_its_rows_and_the_dense_copy_beyond(monkeypatch):
    from kvloom.core.model import cpu_packing

    _, _, codes, amx_sz, dense, bias, w = _dispatched_layer()
    for rows, kernel in ((1, True), (48, True), (49, False), (300, False)):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        calls = []
        monkeypatch.setattr(cpu_int4_amx, "int4_amx_mm",
                            lambda *a, f=cpu_int4_amx.int4_amx_mm: (calls.append("amx"), f(*a))[1])
        args = (x, codes, amx_sz, 32, dense.packed_weight, bias, 48, 0)
        got = cpu_packing.kernel_linear(*args).float()
        monkeypatch.undo()
        assert calls == (["amx"] if kernel else []), (rows, calls)
        want = x.float() @ w.t() + bias.float()
        assert (got - want).abs().max() <= 0.01 * want.abs().max(), (rows, (got - want).abs().max())
        torch.testing.assert_close(cpu_packing.kernel_linear_op(*args).float(), got, rtol=0, atol=0)


@needs_q8_inputs
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 100, 300])
@pytest.mark.parametrize("shape", [(64, 64, 32), (960, 576, 32), (96, 256, 128)])
def test_the_glu_epilogue_equals_silu_of_the_gate_times_the_up_results(shape, rows):
    """``int4_q8_glu``: the gate half's results and the up half's, each rounded to bf16, silu(g) * u in float32
    rounded once; the epilogue's exp against torch's may round a product the other way: at most one bf16 step, in
    under 0.1 % of the outputs."""
    out_features, in_features, group = shape
    q, _, sz, _ = _layer(*shape)
    codes, amx_sz = cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16() * 8
    gate, up = cpu_int4_amx.int4_q8_mm(x, codes, amx_sz, group).float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).bfloat16()
    got = cpu_int4_amx.int4_q8_glu(x, codes, amx_sz, group)
    assert got.shape == (rows, out_features // 2) and got.dtype == torch.bfloat16
    differ = got != want
    assert differ.float().mean() < 1e-3, differ.sum()
    step = want.float().abs() * 2**-7  # one bf16 step (or less) at the value
    assert ((got.float() - want.float()).abs() <= step + 1e-30).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_int4_amx.int4_q8_glu(x, codes[:3], amx_sz, group)  # 48 outputs: no even split into 16s


@needs_q8_inputs
def test_the_glu_op_takes_the_epilogue_for_the_rows_it_serves_and_the_matmul_beyond(monkeypatch):
    from kvloom.core.model import cpu_packing

    packed, sz, codes, amx_sz, dense, _, _ = _dispatched_layer()
    for rows, fused in ((1, True), (40, True), (64, True), (65, False), (200, False)):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        calls = []
        monkeypatch.setattr(cpu_int4_amx, "int4_q8_glu",
                            lambda *a, f=cpu_int4_amx.int4_q8_glu: (calls.append("glu"), f(*a))[1])
        args = (x, codes, amx_sz, 32, dense.packed_weight, 64)
        got = cpu_packing.kernel_glu(*args)
        monkeypatch.undo()
        assert calls == (["glu"] if fused else []), (rows, calls)
        y = cpu_packing.int4_linear(x, packed, sz, codes, amx_sz, 32, dense.packed_weight, None, 0, 64, 1)
        gate, up = y.float().chunk(2, dim=-1)
        want = (torch.nn.functional.silu(gate) * up).bfloat16()
        assert got.shape == (rows, 48) and (got != want).float().mean() < 1e-2, rows
        torch.testing.assert_close(cpu_packing.kernel_glu_op(*args), got, rtol=0, atol=0)


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
codes, amx_sz = cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz)
dense = PackedLinear(torch.randn(64, 128).bfloat16(), None, 32)
compiles = []
def backend(gm, example_inputs):
    compiles.append(1)
    return gm
@torch.compile(backend=backend)
def step(x):
    return torch.relu(cpu_packing.int4_linear_op(x, packed, sz, codes, amx_sz, 32, dense.packed_weight, None, 4, 48))
for rows in (2, 7, 30, 100):
    x = torch.randn(rows, 128).bfloat16()
    torch._dynamo.maybe_mark_dynamic(x, 0)  # as the engine marks a step's rows
    want = torch.relu(cpu_packing.int4_linear(x, packed, sz, codes, amx_sz, 32, dense.packed_weight, None, 4, 48))
    torch.testing.assert_close(step(x), want)
print("compiles", len(compiles))
"""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiles 1" in done.stdout, done.stdout


def _q8_layer(out_features, in_features, seed=0):
    """Q8_0-style codes and fp16 scales per 32 inputs, and the bf16 weights they stand for (``d * q`` rounded)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), generator=g).to(torch.int8)
    d = (torch.rand(out_features, in_features // 32, generator=g) * 0.01).half()
    w = (q.float().view(out_features, -1, 32) * d.float()[..., None]).view(out_features, in_features)
    return q, d, w.bfloat16().float()


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("shape", [(64, 64), (960, 576), (48, 256)])
def test_q8_matmul_equals_the_bf16_weights(shape, rows):
    q, d, w = _q8_layer(*shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_int4_amx.q8_amx_mm(x, cpu_int4_amx.pack_q8_codes(q), d.t().contiguous()).float()
    want = x.float() @ w.t()
    assert got.shape == (rows, shape[0])
    assert ((got - want).abs() <= 2**-8 * want.abs() + 1e-3 * want.abs().max()).all(), (got - want).abs().max()


def test_q8_refuses_shapes_and_dtypes_by_name():
    assert not cpu_int4_amx.q8_supports(40, 64) and not cpu_int4_amx.q8_supports(64, 48)
    assert cpu_int4_amx.q8_copy_bytes(64, 64, torch.float32) == 0  # float32 keeps the dequantized weights only
    assert cpu_int4_amx.q8_copy_bytes(64, 64, torch.bfloat16) == 64 * 64 + 64 * 2 * 2
    q, d, _ = _q8_layer(64, 64)
    with pytest.raises(ValueError, match="2 x 48 by 64"):
        cpu_int4_amx.q8_amx_mm(torch.zeros(2, 48, dtype=torch.bfloat16), cpu_int4_amx.pack_q8_codes(q), d.t()[:1])
    with pytest.raises(TypeError, match="torch.float32"):
        cpu_int4_amx.q8_amx_mm(torch.zeros(2, 64), cpu_int4_amx.pack_q8_codes(q), d.t().contiguous())


def test_gguf_q8_codes_reproduce_gguf_dequantization():
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvloom.kernels.cpu_int4 import gguf_q8_codes

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(24 * 8, 34), dtype=np.uint8)
    raw[:, :2] = rng.uniform(-0.05, 0.05, size=(24 * 8, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(24, 8 * 34)
    q, d = (torch.from_numpy(a) for a in gguf_q8_codes(raw, 24, 256))
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (24, 8)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))
    assert torch.equal((q.float().view(24, 8, 32) * d.float()[..., None]).view(24, 256), ref)


def test_the_q8_projection_takes_amx_for_few_rows_and_its_bf16_copy_beyond(monkeypatch):
    from kvloom.core.model import cpu_packing
    from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

    if not packing_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing in this torch")
    q, d, w = _q8_layer(96, 128)
    layer = cpu_packing.Q8Linear(PackedLinear(w.bfloat16(), None, 32), q, d)
    assert layer.held_bytes() == 96 * 128 + 96 * 4 * 2
    for rows, kernel in ((1, "amx"), (cpu_packing.Q8_MAX_ROWS, "amx"), (cpu_packing.Q8_MAX_ROWS + 1, "dense")):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        calls = []
        monkeypatch.setattr(cpu_int4_amx, "q8_amx_mm",
                            lambda *a, f=cpu_int4_amx.q8_amx_mm: (calls.append("amx"), f(*a))[1])
        got = layer(x).float()
        monkeypatch.undo()
        assert calls == ([] if kernel == "dense" else ["amx"]), (rows, calls)
        want = layer.dense(x).float()  # the same bf16 weights: equal up to the order of the float32 sums
        assert ((got - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all(), rows
        args = (x, layer.q8_codes, layer.q8_scales, layer.dense.packed_weight, None, layer.max_rows)
        torch.testing.assert_close(cpu_packing.q8_linear_op(*args), cpu_packing.q8_linear(*args))


@needs_q8_inputs
def test_the_q8_projection_with_8_bit_inputs_takes_them_for_every_step_it_serves(monkeypatch):
    from kvloom.core.model import cpu_packing
    from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

    if not packing_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing in this torch")
    q, d, w = _q8_layer(96, 128)
    layer = cpu_packing.Q8Linear(PackedLinear(w.bfloat16(), None, 32), q, d, cpu_packing.q8_max_rows(True), True)
    assert layer.held_bytes() == 96 * 128 + 96 * 4 * 2
    for rows in (1, 9, 40, 300):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = layer(x)
        torch.testing.assert_close(got, cpu_int4_amx.q8_q8_mm(x, layer.q8_codes, layer.q8_scales), rtol=0, atol=0)
        args = (x, layer.q8_codes, layer.q8_scales, layer.dense.packed_weight, None, layer.max_rows, 1)
        torch.testing.assert_close(cpu_packing.q8_linear_op(*args), got, rtol=0, atol=0)
    head = cpu_packing.Q8Linear(layer.dense, q, d, layer.max_rows, True, float_out=True)  # an output projection's
    for rows in (1, 40, layer.max_rows + 1):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = head(x)
        args = (x, head.q8_codes, head.q8_scales, head.dense.packed_weight, None, head.max_rows, 1, 1)
        if rows > head.max_rows:  # beyond the kernel's rows: the dense bf16 copy, as before
            assert got.dtype == torch.bfloat16
            continue
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, cpu_int4_amx.q8_q8_mm(x, head.q8_codes, head.q8_scales, torch.float32),
                                   rtol=0, atol=0)
        torch.testing.assert_close(got, layer(x).float(), rtol=0, atol=0)
        torch.testing.assert_close(cpu_packing.q8_linear_op(*args), got, rtol=0, atol=0)


def test_the_codes_attach_to_a_tied_or_an_own_output_projection():
    from torch import nn

    from kvloom.core.model import cpu_packing
    from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

    if not packing_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing in this torch")
    q, d, w = _q8_layer(64, 128)
    tied = nn.Module()
    tied.lm_head = PackedLinear(w.bfloat16(), None, 32)  # a tied table's packed copy
    own = nn.Module()
    own.lm_head = nn.Module()
    own.lm_head.packed, own.lm_head.tp_size = PackedLinear(w.bfloat16(), None, 32), 1  # a packed lm_head layer
    for model, get in ((tied, lambda m: m.lm_head), (own, lambda m: m.lm_head.packed)):
        dense = get(model)
        assert cpu_packing.attach_q8_output(model, q, d, torch.bfloat16) == 64 * 128 + 64 * 4 * 2
        assert isinstance(get(model), cpu_packing.Q8Linear) and get(model).dense is dense
        # 32 on AMX; on the dot products 8, or every step's (the inputs at 8 bits, a GGUF file's default)
        assert get(model).int8_inputs == cpu_int4_amx.q8_inputs()
        assert get(model).max_rows == cpu_packing.q8_max_rows(get(model).int8_inputs)
        assert get(model).float_out  # logits: the kernel widens them to float32 as it stores them
    assert cpu_packing.attach_q8_output(nn.Module(), q, d, torch.bfloat16) == 0  # nothing packed to attach to
    assert cpu_packing.attach_q8_output(tied, q, d, torch.float32) == 0  # float32 keeps the dequantized weights


def test_an_unpacked_layer_takes_the_kernel_for_its_rows_too():
    """A layer whose dense copy is not oneDNN-packed (packing off) still runs the rows the kernel serves on it:
    torch's copy of the codes may not be kept (on the dot products ``int4_rows`` gives it no rows)."""
    from kvloom.core.model import cpu_packing
    from kvloom.core.model.linear import ReplicatedLinear, UnquantizedLinearMethod

    q, _, sz, w = _layer(64, 128, 32)
    layer = ReplicatedLinear(128, 64, False, method=UnquantizedLinearMethod(), prefix="p", params_dtype=torch.bfloat16)
    layer.weight.data.copy_(w.bfloat16())
    cpu_packing.attach_layer_int4(layer, q, sz[..., 0].t().float(), sz[..., 1].t().float(), 32, "Q4_1",
                                  torch.bfloat16)
    torch_rows, max_rows = cpu_packing.int4_rows()
    assert (layer.int4_weight.numel() == 0) == (torch_rows == 0)
    for rows in sorted({1, 2, max_rows, max_rows + 1}):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = layer.method.apply(layer, x).float()
        want = x.float() @ w.t()
        assert (got - want).abs().max() <= 0.01 * want.abs().max(), rows


@needs_q8_inputs
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 100])
def test_int8_inputs_times_8_bit_codes_equal_the_weights_times_the_rounded_inputs(rows):
    """GGUF's Q8_0 output projection with its inputs rounded to 8 bits (``q8_q8_mm``, codes by ``pack_q8_quads``)."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (64, 128), generator=g).to(torch.int8)
    d = (torch.rand(64, 4, generator=g) * 0.01).half()
    x = (torch.randn(rows, 128, generator=g) * 3).bfloat16()
    got = cpu_int4_amx.q8_q8_mm(x, cpu_int4_amx.pack_q8_quads(q), d.t().contiguous()).double()
    w = q.double() * d.double().repeat_interleave(32, 1)
    want = _rounded_inputs(x) @ w.t()
    assert ((got - want).abs() <= 2**-8 * want.abs() + 1e-4 * want.abs().max()).all(), (got - want).abs().max()
    assert (got - want).abs().mean() < (got - x.double() @ w.t()).abs().mean()
    # float32 results (an output projection's logits): the bf16 results themselves, widened
    wide = cpu_int4_amx.q8_q8_mm(x, cpu_int4_amx.pack_q8_quads(q), d.t().contiguous(), torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.double(), got)
    with pytest.raises(TypeError, match="float16"):
        cpu_int4_amx.q8_q8_mm(x, cpu_int4_amx.pack_q8_quads(q), d.t().contiguous(), torch.float16)
