"""Where the kernel tests run the Triton kernels: compiled on CUDA when there is a GPU, otherwise on the
CPU through the Triton interpreter.

The interpreter has to be chosen before ``import triton``: Triton decides between compiling and
interpreting when ``@triton.jit`` decorates a function, and that includes its own standard library
(``tl.sum``, ``tl.max``, ``tl.cdiv`` are jitted functions), so flipping ``TRITON_INTERPRET`` after triton
is imported leaves kernels that cannot run on CPU tensors. Hence, on a machine without CUDA:

* this file sets ``TRITON_INTERPRET=1``, imports triton and the kvloom Triton modules, then restores the
  variable, so nothing else (subprocesses, later tests) inherits it. Without CUDA no other test can launch
  a compiled Triton kernel anyway, so interpreted kernels cannot slow down or break tests elsewhere;
* if triton was already imported in compiled mode (some module collected earlier imported it), the
  interpreter cannot be switched on in this process: the CPU kernel tests are then skipped with a reason
  saying so, and ``python -m pytest tests/kernels`` (which imports nothing else first) runs them.

With CUDA nothing is changed: the same small tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401

        import kvloom.kernels.triton_attention  # noqa: F401
        import kvloom.kernels.triton_fused  # noqa: F401
        import kvloom.kernels.triton_lora  # noqa: F401
        import kvloom.kernels.moe.triton  # noqa: F401
        import kvloom.kernels.quant.dispatch  # noqa: F401 (and with it every quant kernel family)
    except ImportError:
        pass  # no triton: the fixture below skips
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _interpreter_active() -> bool:
    """Whether triton's own library and our kernels were both decorated in interpreter mode."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from kvloom.kernels import triton_attention

    return isinstance(tl.sum, InterpretedFunction) and isinstance(triton_attention._decode_kernel, InterpretedFunction)


if not HAS_CUDA and "triton" not in sys.modules:
    _import_interpreted()


@pytest.fixture
def tk(monkeypatch):
    """The Triton kernel modules (the quantized-matmul families by their module names) and the device their
    inputs must live on (``cuda``, or ``cpu`` interpreted)."""
    pytest.importorskip("triton")
    from kvloom.kernels import triton_attention, triton_fused, triton_lora
    from kvloom.kernels.moe import triton as triton_moe
    from kvloom.kernels.quant import common, dispatch, fp8_rows, fp8_weight_only, int4_row, int_kpacked

    if HAS_CUDA:
        device = "cuda"
    else:
        if not _interpreter_active():
            pytest.skip(
                "triton was imported (compiled mode) before tests/kernels/conftest.py could enable the "
                "interpreter; run `python -m pytest tests/kernels` on its own, or set TRITON_INTERPRET=1"
            )
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # consulted at run time by a few triton helpers
        device = "cpu"
    return types.SimpleNamespace(attention=triton_attention, fused=triton_fused, lora=triton_lora, common=common,
                                 dispatch=dispatch, fp8_rows=fp8_rows, fp8_weight_only=fp8_weight_only,
                                 int4_row=int4_row, int_kpacked=int_kpacked, moe=triton_moe,
                                 device=device)
