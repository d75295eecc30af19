"""The kernel choices a benchmark or a test may vary (``EngineConfig.kernel_options``), handed to the kernels as
an argument; the defaults are what the engine runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class KernelOptions:
    # Launch a decode step's Triton kernels with programmatic dependent launch where the GPU has it
    # (kvloom/kernels/pdl.py); off, each waits for its predecessor the usual way (an A/B switch).
    pdl: bool = True
    # Whether the one-row GEMVs' split-K programs (the int4 row GEMV's, the FP8 GEMV's) combine their partials
    # themselves (the last split of an output tile, kvloom/kernels/arrivals.py) instead of atomically adding into
    # a zeroed float32 output that a cast kernel then rounds: two PyTorch kernels fewer a layer, which also broke
    # the chain of PDL launches, and a deterministic sum.
    split_combine: bool = True
    # Whether RMSNorm and SiLU-and-mul quantize their output per row for a W8A8 layer after them
    # (``quant.fp8_rows``).
    fp8_fused_quant: bool = True
    # Whether a one-row decode step's qkv projection on the FP8 GEMV rotates q/k and writes the KV cache in
    # its epilogue (``fp8_qkv_rope_gemv``): one kernel less a layer, a shorter step (docs/benchmarks.md).
    fp8_qkv_rope: bool = True
    # Whether the fixed-tile FP8 GEMV reads x in its weights' layout (``_fp8_gemv_kernel``'s X_TILE: more
    # instructions, no barriers): faster only for the fused gate/up GEMV (docs/benchmarks.md).
    fp8_gemv_x_tile: bool = False
    fp8_silu_mul_x_tile: bool = True
    # The FP8 FMA GEMV's one-row tiles, ``[[max weight size, tile dict], ...]``; None: the built-in table
    # (``quant.fp8_weight_only.FP8_ROW_TILES``).
    fp8_row_tiles: Any = None
    # Fixed tiles for the fused gate/up FP8 GEMV (a benchmark's override); None: derived from the one-row tiles.
    fp8_silu_mul_tiles: Any = None
    # Whether a merged gate/up 4-bit layer's one-row GEMV stores silu(gate) * up itself (``int4_row_gemv``'s
    # ``silu_mul``), saving the SiLU-and-mul kernel. Off: slower than the two kernels (docs/benchmarks.md).
    int4_fused_silu_mul: bool = False
    # Whether the row-layout dequantization (dequantize, then cuBLAS) builds each value with the row GEMV's bit
    # pattern and one FMA: the same bits in fewer instructions, but no faster, the pass not being bound by its
    # instructions (docs/benchmarks.md); off.
    int4_dequant_fma: bool = False
    # 4-bit weights of at least this many values run one row on the row GEMV even where tinygemm's copy is held
    # (``quant.dispatch.int4_one_row_path``).
    int4_row_min_weight: int = 4096 * 4096 + 1
    # Whether 4-bit layers on Hopper hold their weight in the MMA row layout (one copy, which the row GEMV and the
    # dequantize pass read too) and run 2-256 rows on the Gluon GEMM, faster than the Triton paths
    # (docs/benchmarks.md).
    int4_mma_layout: bool = True
    # The many-row 4-bit GEMM's tiles by weight shape, ``{(n, k): ((max rows, tile or None), ...)}`` (keys may be
    # written "NxK"); None: the built-in table (``quant.int4_row.INT4_GEMM_TILES``).
    int4_gemm_tiles: Any = None
    # The fused MoE's tiles by the rows an expert gets on average, ``[[max rows or None, tile dict], ...]``; None: the
    # built-in table (``moe.triton.MOE_TILES``).
    moe_tiles: Any = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "KernelOptions":
        """Options from ``{name: value}`` (a config file's table, ``--kernel-options`` JSON); ValueError naming
        an unknown name or a value of the wrong type."""
        values = dict(values or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown kernel option{'s' if len(unknown) > 1 else ''} {unknown}; known: "
                             f"{sorted(fields)}")
        for name, value in values.items():
            default = fields[name].default
            if default is not None and type(value) is not type(default):
                raise ValueError(f"kernel option {name}={value!r} must be a {type(default).__name__}")
        tiles = values.get("int4_gemm_tiles")
        if isinstance(tiles, Mapping):  # JSON has no tuple keys: "NxK"
            values["int4_gemm_tiles"] = {_shape(key): rows for key, rows in tiles.items()}
        return cls(**values)


def _shape(key: Any) -> tuple[int, int]:
    if isinstance(key, str):
        n, _, k = key.partition("x")
        if n.isdigit() and k.isdigit():
            return int(n), int(k)
        raise ValueError(f"kernel option int4_gemm_tiles: key {key!r} is not a weight shape NxK, e.g. '6144x4096'")
    return tuple(key)


DEFAULT_KERNELS = KernelOptions()
