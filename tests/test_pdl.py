"""Which launches use programmatic dependent launch (kvloom.kernels.pdl): never on the CPU or under the
Triton interpreter, and not when switched off (``kernel_options={"pdl": false}``). (The GPU side is
tests/test_gpu.py's PDL test.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_no_pdl_for_cpu_tensors_or_when_switched_off():
    from kvloom.core.config import EngineConfig
    from kvloom.kernels.pdl import pdl_args, pdl_enabled

    assert pdl_args(torch.empty(1)) == {"PDL": False}
    off = EngineConfig(kernel_options={"pdl": False}).kernels()
    assert not off.pdl and EngineConfig().kernels().pdl
    assert not pdl_enabled(torch.empty(1), off.pdl)
    if torch.cuda.is_available():
        assert pdl_args(torch.empty(1, device="cuda"), off.pdl) == {"PDL": False}
