"""The hot CPU ops' C++ dispatch (``kvloom.kernels.cpu_native``): each op's C++ kernel gives its Python body's
results bit for bit, hands the cases it leaves (rows beyond the kernel's, an empty step, sinks, a refused shape) to
that body, serves compiled steps, and stays off where asked or where it cannot be built."""

import os
import subprocess
import sys

import pytest
import torch

from kvloom.core.model import cpu_packing
from kvloom.kernels import cpu_attention, cpu_int4_amx, cpu_native
from kvloom.kernels.cpu_int4 import pack_int4

pytestmark = pytest.mark.skipif(
    not (cpu_native.load() and cpu_int4_amx.available() and cpu_attention.available()),
    reason="no C++ compiler (or torch headers) builds the libraries here")

ops = torch.ops.kvloom


def _layer(out_features=96, in_features=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=g)
    _, sz = pack_int4(q, torch.rand(out_features, in_features // 32, generator=g) * 0.02,
                      torch.randn(out_features, in_features // 32, generator=g) * 0.01, torch.bfloat16)
    return cpu_int4_amx.pack_codes(q), cpu_int4_amx.pack_scale_zeros(sz)


def _dense(out_features=96, in_features=256):
    from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

    if not packing_supported(torch.bfloat16):
        return torch.empty(0)
    return PackedLinear(torch.randn(out_features, in_features).bfloat16() * 0.05, None, 32).packed_weight


def _served(call):
    before = cpu_native.served()
    out = call()
    return out, cpu_native.served() - before


@pytest.mark.parametrize("rows", [1, 3, 5, 32, 100])
def test_the_linear_ops_equal_their_python_bodies(rows):
    codes, scales = _layer()
    dense, bias = _dense(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    int8 = [0, 1] if cpu_int4_amx.q8_inputs() else [0]
    for int8_inputs in int8:
        for b in (None, bias):
            args = (x, codes, scales, 32, dense, b, 128, int8_inputs)
            got, served = _served(lambda: ops.kernel_linear.default(*args))
            assert served == 1
            torch.testing.assert_close(got, ops.kernel_linear_python.default(*args), rtol=0, atol=0)
            torch.testing.assert_close(got, cpu_packing.kernel_linear(*args), rtol=0, atol=0)
    if cpu_int4_amx.q8_inputs():
        args = (x, codes, scales, 32, dense, 128)
        got, served = _served(lambda: ops.kernel_glu.default(*args))
        assert served == 1 and got.shape == (rows, 48)
        torch.testing.assert_close(got, ops.kernel_glu_python.default(*args), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_and_the_rotary_write_equal_their_python_bodies(dtype):
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, 31, 32, 70, 300])
    k_cache, v_cache = (torch.randn(60, 3, 32, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(5, 9, 64, generator=g).to(dtype)
    tables = torch.randperm(60, generator=g)[:50].view(5, 10).int()
    args = (q, k_cache, v_cache, tables, torch.zeros_like(lens), lens, 0.125, 0.0, None)
    got, served = _served(lambda: ops.paged_decode.default(*args))
    assert served == 1
    torch.testing.assert_close(got, ops.paged_decode_python.default(*args), rtol=0, atol=0)
    if dtype != torch.bfloat16:
        return
    # the rotary write: q and k rotated, and the step's K/V rows written into (copies of) the caches
    qkv = torch.randn(7, 15, 64, generator=g).bfloat16()
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    angles = torch.randn(7, 1, 64, generator=g)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    rows = torch.randperm(60 * 3 * 32, generator=g)[:21]
    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("cpp", "python")}
    (q_cpp, k_cpp), served = _served(lambda: ops.cpu_rope_write.default(q, k, v, cos, sin, *caches["cpp"], rows))
    q_py, k_py = ops.cpu_rope_write_python.default(q, k, v, cos, sin, *caches["python"], rows)
    assert served == 1
    for a, b in zip((q_cpp, k_cpp, *caches["cpp"]), (q_py, k_py, *caches["python"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(caches["cpp"][0], k_cache)  # rows were written


def test_the_cases_it_leaves_take_the_python_body():
    codes, scales = _layer()
    dense = _dense()
    x = torch.randn(40, 256).bfloat16()
    if dense.numel() or dense.is_mkldnn:  # rows beyond the kernel's: the dense copy
        got, served = _served(lambda: ops.kernel_linear.default(x, codes, scales, 32, dense, None, 16, 0))
        assert served == 0
        torch.testing.assert_close(got, cpu_packing.kernel_linear(x, codes, scales, 32, dense, None, 16, 0))
    got, served = _served(lambda: ops.kernel_linear.default(x[:0], codes, scales, 32, dense, None, 16, 0))
    assert served == 0 and got.shape == (0, 96)
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(20, 2, 16, 64, generator=g) for _ in range(2))
    q, lens = torch.randn(2, 4, 64, generator=g), torch.tensor([5, 40])
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    sinks = torch.randn(4, generator=g)
    args = (q, k_cache, v_cache, tables, torch.zeros_like(lens), lens, 0.125, 0.0, sinks)
    got, served = _served(lambda: ops.paged_decode.default(*args))
    assert served == 0
    torch.testing.assert_close(got, cpu_attention._paged_decode(*args), rtol=0, atol=0)
    # a shape the kernel refuses: its Python body names it, as before
    with pytest.raises(ValueError, match="head_dim 48"):
        ops.paged_decode.default(torch.randn(1, 4, 48), torch.randn(8, 2, 16, 48), torch.randn(8, 2, 16, 48),
                                 tables[:1], lens[:1] * 0, lens[:1], 1.0, 0.0, None)
    with pytest.raises(ValueError, match="group 16"):
        ops.kernel_linear.default(x, codes, scales, 16, dense, None, 64, 0)


def test_every_op_named_native_has_its_cpp_kernel():
    from kvloom.kernels.cpu_ops import NATIVE_OPS

    for name in NATIVE_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvloom::{name}", "CPU"), name
        assert hasattr(ops, f"{name}_python"), name


def test_a_compiled_step_reaches_the_cpp_kernels():
    codes, scales = _layer()
    dense = _dense()

    def step(x):
        return torch.relu(cpu_packing.kernel_linear_op(x, codes, scales, 32, dense, None, 64, 0)) * 2

    x = torch.randn(6, 256).bfloat16()
    with torch._dynamo.config.patch(disable=False):  # the suite runs eagerly (tests/conftest.py)
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        got, served = _served(lambda: compiled(x))
    assert served >= 1
    torch.testing.assert_close(got, step(x), rtol=0, atol=0)


@pytest.mark.parametrize("setting", ["switch", "compiler"])
def test_off_where_asked_or_unbuildable(setting, tmp_path):
    """``KVLOOM_CPU_NATIVE_OPS=0``, or no C++ compiler: the ops keep their Python bodies (no CPU kernel of their
    own) and still compute; without a compiler one log line says why."""
    script = """
import logging, torch
logging.basicConfig()
from kvloom.core.model import cpu_packing
from kvloom.kernels import cpu_native
print('loaded', cpu_native.load())
print('cpu kernel', torch._C._dispatch_has_kernel_for_dispatch_key('kvloom::kernel_linear', 'CPU'))
"""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    if setting == "switch":
        env["KVLOOM_CPU_NATIVE_OPS"] = "0"
    else:
        env["CXX"] = str(tmp_path / "no-such-compiler")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded False" in done.stdout and "cpu kernel False" in done.stdout, done.stdout
    if setting == "compiler":
        assert "keep their Python dispatch" in done.stderr and "no-such-compiler" in done.stderr, done.stderr
