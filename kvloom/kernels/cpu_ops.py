"""kvloom's CPU ops as the compiler sees them: functions registered by schema under ``kvloom::``, which a compiled
step calls whole (opaque to inductor; a fake function gives their outputs' shapes while tracing).

Registered with ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter wraps every call in
Python checks of its own (one 8-row 4-bit linear on this project's 2-core Xeon: 41-48 us through ``custom_op``,
28-37 through the schema, 28 the function itself; docs/benchmarks.md, "CPU: ops by schema"); a SmolLM2 decode step
makes ~150 such calls. The kernels are
registered for every backend (``CompositeExplicitAutograd``): oneDNN's packed weights are tensors of another
backend than the CPU's dense ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("kvloom", "FRAGMENT")

# the ops ``kvloom.kernels.cpu_native`` gives C++ kernels: each also registered as ``<op>_python``
NATIVE_OPS = ("kernel_linear", "kernel_glu", "paged_decode", "cpu_rope_write")


def define(schema: str, fn: Callable, fake: Callable) -> Callable:
    """Register ``fn`` as the op ``kvloom::<schema>`` (``"name(Tensor x, ...) -> Tensor"``), ``fake`` its
    shape function; returns the op to call where a step is compiled. An op with a C++ kernel
    (``NATIVE_OPS``) also gets ``fn`` as ``<name>_python``, which that kernel hands the cases it leaves."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvloom::{name}", fake, lib=_LIB)
    if name in NATIVE_OPS:
        _LIB.define(f"{name}_python{schema[len(name):]}")
        _LIB.impl(f"{name}_python", fn, "CompositeExplicitAutograd")
    return getattr(torch.ops.kvloom, name).default
