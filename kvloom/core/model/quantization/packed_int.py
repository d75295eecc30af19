"""The run-time layouts of AWQ and GPTQ layers on the GPU, dequantized inside the kernels
(``kvloom.kernels.quant``), with uint8 zero points and fp16 scales per group: 4-bit
weights in one ``[N, K / 8]`` int32 layout that every 4-bit kernel of the GPU reads (on Hopper the Gluon GEMM's
MMA row layout, ``quant.gluon_int4.int4_mma_pack``; elsewhere the row layout, ``quant.int4_row.int4_row_pack``),
plus PyTorch's int4 copy (tinygemm) for 1-4 rows where it takes the shape (on Hopper only for weights of
4096 x 4096 and less, whose one row it runs); 8-bit weights packed along the inputs. On the CPU
the formats are dequantized at load instead (dense oneDNN matmuls beat unpacking nibbles in Python), and in
bfloat16 4-bit layers also keep their codes for torch's CPU int4 matmul, which serves decode steps of few rows
(``set_cpu_weights``)."""

from __future__ import annotations

import torch

from kvloom.core.model.linear import LinearBase, set_dense_weight
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions


# The start-up log's kernel: what ``quant.dispatch.int4_linear`` / ``int_linear`` pick from by row count.
# Keyed by (bits, layout).
INT_KERNELS = {
    (4, "mma"): ("W4A16 on CUDA, the Gluon GEMM's 4-bit MMA row layout (Hopper): one row a Triton GEMV (nibbles to "
                 "floats by bit patterns; PyTorch's int4 GEMM, tinygemm, on weights of 4096 x 4096 and less, a "
                 "second copy of those), 2-256 rows a Gluon wgmma GEMM dequantizing pairs of values into its "
                 "register operand (2-4 rows tinygemm where it is held), dequantize + cuBLAS beyond"),
    (4, "row"): ("W4A16 on CUDA, row-major 4-bit layout: one row a Triton GEMV (nibbles to floats by bit patterns; "
                 "PyTorch's int4 GEMM, tinygemm, on weights of 4096 x 4096 and less), 2-4 rows tinygemm (a second "
                 "copy of the weight), up to 16 rows a Triton tensor-core GEMM dequantizing in the kernel, up to 256 "
                 "rows a Triton wgmma GEMM dequantizing tiles in registers (or dequantize + cuBLAS where that is "
                 "faster), dequantize + cuBLAS beyond"),
    (4, "k"): ("W4A16 on CUDA, packed along the inputs: up to 4 rows PyTorch's int4 GEMM (tinygemm, where it takes "
                 "the group size), up to 63 rows a Triton tensor-core GEMM dequantizing in the kernel, dequantize + "
                 "cuBLAS beyond"),
    (8, "k"): ("W8A16 on CUDA: up to 63 rows a Triton tensor-core GEMM dequantizing in the kernel, dequantize + "
                 "cuBLAS beyond"),
}


def keep_packed(device: torch.device, forced: bool | None) -> bool:
    """Run packed (the in-kernel dequantizing GEMM) or dequantize at load: packed on CUDA."""
    return forced if forced is not None else device.type == "cuda"


def int4_cuda_layout(device: torch.device, k: int, group_size: int, dtype: torch.dtype,
                     kernels: KernelOptions = DEFAULT_KERNELS) -> str:
    """The layout a 4-bit layer of ``k`` inputs holds on a CUDA ``device``: ``"mma"`` (the Gluon GEMM's, on
    Hopper: ``quant.dispatch.mma_layout_wanted``), ``"row"`` for the other groups the row kernels take
    (``quant.dispatch.int4_row_layout_ok``), else ``"k"`` (packed along the inputs)."""
    from kvloom.kernels.quant import dispatch as qd

    if not qd.int4_row_layout_ok(k, group_size):
        return "k"
    return "mma" if qd.mma_layout_wanted(device, k, group_size, dtype, kernels) else "row"


def set_packed_weight(layer: LinearBase, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int, bits: int, perm: torch.Tensor | None = None,
                      kernels: KernelOptions = DEFAULT_KERNELS) -> None:
    """Replace the checkpoint's tensors by the run-time layout, from the K-packed ``qweight``
    (``[K * bits / 32, N]``); ``perm`` reorders the inputs (desc_act). 4-bit on CUDA, for the groups the
    kernels take (``quant.dispatch.int4_row_layout_ok``): ``qweight`` becomes ``[N, K / 8]``, in the MMA row
    layout where the Gluon GEMM runs (``quant.dispatch.mma_layout_wanted``), else in the row layout; and
    tinygemm's copy where it takes the shape (with the MMA layout, only where it runs one row). ``kernels``: the
    options the layer's kernels run with."""
    for name in list(layer._parameters):
        if name != "bias":
            delattr(layer, name)
    cuda4 = bits == 4 and qweight.is_cuda
    if cuda4:  # (Triton only where the kernels run)
        from kvloom.kernels.quant import dispatch as qd
    n, k = qweight.shape[1], qweight.shape[0] * 8
    layout = int4_cuda_layout(qweight.device, k, group_size, layer.params_dtype, kernels) if cuda4 else "k"
    mma = layout == "mma"
    if mma:
        layer.add_param("qweight", qd.int4_mma_pack_qweight(qweight), input_dim=1, output_dim=0)
    elif layout == "row":
        layer.add_param("qweight", qd.int4_row_pack(qweight), input_dim=1, output_dim=0)
    else:
        layer.add_param("qweight", qweight, input_dim=0, output_dim=1)
    layer.add_param("zeros", zeros, input_dim=0, output_dim=1)
    layer.add_param("scales", scales.contiguous(), input_dim=0, output_dim=1)
    if perm is not None:
        layer.register_buffer("perm", perm, persistent=False)
    else:
        layer.perm = None
    layer.tinygemm = None
    # tinygemm's copy: with the MMA layout, only for the weights whose one row it runs (4096 x 4096 and less)
    if cuda4 and layer.params_dtype == torch.bfloat16 and (not mma or n * k < kernels.int4_row_min_weight):
        pack = qd.tinygemm_pack(qweight, zeros, scales, group_size)
        if pack is not None:  # a second copy of the weight (half a byte per value): a decode path
            layer.register_buffer("tinygemm_weight", pack[0], persistent=False)
            layer.register_buffer("tinygemm_scales_zeros", pack[1], persistent=False)
            layer.tinygemm = (layer.tinygemm_weight, layer.tinygemm_scales_zeros)
    layer.method = PackedIntLinearMethod(group_size, bits, layout, kernels)


class PackedIntLinearMethod:
    """W4A16/W8A16: on the row or MMA row layout through ``ops.int4_row_matmul`` (4-bit on CUDA), else K-packed
    (``layout`` ``"k"``) through ``ops.int_matmul`` (Triton on CUDA, the PyTorch reference elsewhere)."""

    def __init__(self, group_size: int, bits: int, layout: str = "k", kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        if layout not in ("k", "row", "mma"):
            raise ValueError(f"layout {layout!r}: one of 'k', 'row', 'mma'")
        self.group_size, self.bits, self.layout = group_size, bits, layout
        self.kernels = kernels
        self.name = f"int{bits} packed" + {"k": "", "row": " (row layout)", "mma": " (MMA row layout)"}[layout]

    @property
    def row(self) -> bool:
        """``[N, K / 8]`` words (the row or MMA row layout), read by the row kernels."""
        return self.layout != "k"

    def create_weights(self, layer: LinearBase) -> None:
        raise RuntimeError("a packed-int layer is made from a loaded AWQ or GPTQ one")

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        pass

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        from kvloom.kernels import ops

        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        if self.row:
            return ops.int4_row_matmul(x, layer.qweight, layer.zeros, layer.scales, self.group_size, layer.bias,
                                       layer.tinygemm, self.layout == "mma", self.kernels)
        return ops.int_matmul(x, layer.qweight, layer.zeros, layer.scales, self.group_size, self.bits, layer.bias,
                              layer.tinygemm)

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        """One row of a merged [gate; up] 4-bit layer on the row layout, where the row GEMV is the one-row
        path: that GEMV with SiLU-and-mul in its epilogue (None: not fused here)."""
        from kvloom.kernels.quant import dispatch as qd

        if not (self.kernels.int4_fused_silu_mul and self.row and x.is_cuda and x.numel() == x.shape[-1]):
            return None
        n, k = layer.qweight.shape[0], layer.qweight.shape[1] * 8
        if qd.int4_one_row_path(n, k, x.dtype, layer.tinygemm, self.kernels) != "row" \
                or qd.int4_row_tiles(n, k)["SPLIT_K"] != 1:
            return None
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return qd.int4_row_gemv(x, layer.qweight, layer.zeros, layer.scales, self.group_size,
                                config=qd.int4_row_tiles(n, k), silu_mul=True, mma_layout=self.layout == "mma",
                                options=self.kernels)

    def held_bytes(self, layer: LinearBase, device_type: str) -> int:
        copies = layer.tinygemm or ()
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False)) + \
            sum(t.numel() * t.element_size() for t in copies)


def tinygemm_bytes(layer: LinearBase, bits: int, group_size: int, device_type: str,
                   kernels: KernelOptions = DEFAULT_KERNELS) -> int:
    """What tinygemm's copy of a 4-bit layer adds on CUDA (``engine plan``), in bf16 where it takes the shape,
    and with the MMA layout (Hopper) only for weights of 4096 x 4096 and less, as ``set_packed_weight``
    makes it."""
    if bits != 4 or device_type != "cuda":
        return 0
    k, n = layer.input_size, layer.output_size
    if torch.cuda.is_available() and n * k >= kernels.int4_row_min_weight \
            and int4_cuda_layout(torch.device("cuda"), k, group_size, layer.params_dtype, kernels) == "mma":
        return 0
    if layer.params_dtype != torch.bfloat16 or group_size not in (32, 64, 128, 256) or k % 1024:
        return 0
    return k * n // 2 + (k // group_size) * n * 4


# --- the CPU: dense weights, and for 4-bit layers in bfloat16 a 4-bit copy beside them -------------------
def cpu_int4_refusal(layer: LinearBase, group_size: int | None, enabled: bool) -> str | None:
    """Why a 4-bit AWQ/GPTQ layer on the CPU holds no 4-bit copy for torch's int4 matmul (None: it holds
    one); ``group_size`` None: the format's groups cannot be run in order (the reason is the caller's)."""
    from kvloom.kernels.cpu_int4 import INT4_GROUPS, INT4_N_MULTIPLE, int4_supported

    if not enabled:
        return "off"
    if layer.params_dtype != torch.bfloat16:
        return "not bfloat16"
    if layer.tp_size != 1:
        return "tensor parallel"
    if group_size not in INT4_GROUPS or layer.input_size % group_size:
        return f"group size {group_size}: the int4 matmul takes {list(INT4_GROUPS)}"
    if layer.output_size % INT4_N_MULTIPLE:
        return f"outputs not a multiple of {INT4_N_MULTIPLE}"
    if not int4_supported():
        return "no CPU int4 matmul in this torch"
    return None


def cpu_int4_bytes(layer: LinearBase, group_size: int) -> int:
    """The 4-bit copy's bytes (``cpu_int4.int4_copy_bytes``; the copy is made for bf16 only)."""
    from kvloom.kernels.cpu_int4 import int4_copy_bytes

    return int4_copy_bytes(layer.output_size, layer.input_size, group_size, torch.bfloat16)


QUIET = ("off", "not bfloat16")  # reasons that need no word in the start-up line


@torch.no_grad()
def set_cpu_weights(layer: LinearBase, method, weight: torch.Tensor, codes, group_size: int,
                    refusal: str | None) -> None:
    """The CPU's layer: the dense ``weight`` (oneDNN-packed later by the loader), plus, where ``codes`` (q, scale,
    zero from ``cpu_int4.zero_point_codes``) are given, their 4-bit copy for decode steps (``Int4CPUMethod``).
    Tallies both on ``method`` (an AWQ/GPTQ ``QuantizationMethod``) for its start-up line."""
    from kvloom.core.model.cpu_packing import attach_layer_int4, int4_bytes, int4_max_rows

    set_dense_weight(layer, weight)
    tally = method.cpu_tally
    if codes is None:
        tally["dense"][refusal] = tally["dense"].get(refusal, 0) + 1
    else:
        attach_layer_int4(layer, *codes, group_size, method.name, layer.params_dtype, gguf=False)
        tally["int4"] += 1
        tally["int4_bytes"] += int4_bytes(layer)
    dtype = str(layer.params_dtype).removeprefix("torch.")
    dense = [f"{n} layers ({why})" for why, n in sorted(tally["dense"].items()) if why not in QUIET]
    line = f"dequantized at load to {dtype} (cpu: dense matmuls)"
    if tally["int4"]:
        line = (f"{tally['int4']} layers kept at 4 bits on the CPU ({tally['int4_bytes'] / 2**20:.1f} MiB, 4-bit "
                f"matmuls for steps of <= {int4_max_rows(gguf=False)} rows) beside their {dtype} copy, {line}, "
                "for bigger steps")
    method.kernel = line + (f"; dense only (no 4-bit copy): {', '.join(dense)}" if dense else "")
