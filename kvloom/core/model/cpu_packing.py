"""Linear layers packed for the CPU after loading: each dense weight handed to oneDNN's blocked layout
once (``kvloom.kernels.cpu_linear.PackedLinear``), and 4-bit weights (GGUF, AWQ, GPTQ) kept at 4 bits beside it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.core.model.linear import LinearBase, UnquantizedLinearMethod
from kvloom.kernels import cpu_int4_amx, cpu_ops
from kvloom.kernels.cpu_int4 import GROUP, int4_mm, pack_int4
from kvloom.kernels.cpu_linear import PackedLinear, packed_linear, packing_supported


class PackedCPUMethod:
    """The ``LinearMethod`` of a layer whose dense weight was packed (its ``packed`` child holds it)."""

    name = "dense, oneDNN-packed"

    def create_weights(self, layer) -> None:
        raise RuntimeError("a packed layer is made from a loaded one")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return layer.packed(x)

    def process_weights_after_loading(self, layer) -> None:
        pass

    def held_bytes(self, layer, device_type: str) -> int:
        # oneDNN's blocked weight is opaque: sized as the dense weight it holds
        return layer.output_size * layer.input_size * layer.params_dtype.itemsize + param_bytes(layer)


def param_bytes(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


@torch.no_grad()
def pack_layer(layer, batch_hint: int = 32) -> bool:
    """The CPU step after loading of a layer with a dense weight (``kvloom.core.model.linear``): hold it
    in oneDNN's blocked layout (for an ``Int4CPUMethod`` layer, its dense copy). Returns whether it was packed
    (not when unsupported, or not dense)."""
    weight = getattr(layer, "weight", None)
    int4 = layer.method if isinstance(layer.method, Int4CPUMethod) else None
    dense = int4.dense if int4 is not None else layer.method
    if (type(dense) is not UnquantizedLinearMethod or weight is None or weight.device.type != "cpu"
            or not packing_supported(weight.dtype)):
        return False
    layer.packed = PackedLinear(weight, layer.bias, batch_hint)
    del layer.weight
    layer.register_parameter("bias", None)
    if int4 is not None:
        int4.dense = PackedCPUMethod()
    else:
        layer.method = PackedCPUMethod()
    return True


@torch.no_grad()
def pack_tied_output(model: nn.Module, batch_hint: int = 32) -> bool:
    """Give a model with tied embeddings a packed copy of the table as its ``lm_head`` (on the CPU)."""
    if not (getattr(model, "tie_word_embeddings", False) and hasattr(model, "embed_tokens")
            and getattr(model, "lm_head", None) is None):
        return False
    table = model.embed_tokens.weight
    if table.device.type != "cpu" or not packing_supported(table.dtype):
        return False
    # The embedding table stays for the lookup; the packed copy is the output projection.
    model.lm_head = PackedLinear(table, None, batch_hint)
    return True


@torch.no_grad()
def pack_linear_layers(model: nn.Module, batch_hint: int = 32) -> int:
    """Pack every dense linear layer of ``model`` (kvloom's layers and plain ``nn.Linear`` ones) and a tied
    output projection, as the loader does after loading. Returns the number of layers packed; 0 when
    packing is unsupported or everything is packed already."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or not packing_supported(params[0].dtype):
        return 0
    count = 0
    for parent in list(model.modules()):
        if isinstance(parent, LinearBase):
            count += pack_layer(parent, batch_hint)
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child.weight, child.bias, batch_hint))
                count += 1
    return count + pack_tied_output(model, batch_hint)


# Steps of at most this many rows run on the 4-bit weights; bigger ones on the oneDNN bf16 copy, which
# computes faster once a step reads each weight for ~12 rows or more (benchmarks/cpu_int4.py, docs/benchmarks.md).
INT4_MAX_ROWS = 8
# Where the AMX kernel serves (``cpu_int4_amx``): torch's int4 matmul for one row (~10 % faster there), the AMX
# kernel up to AMX_INT4_MAX_ROWS (from 2 rows 1.05-1.5x torch's speed and 1.7-3x the bf16 copy's; at 48 rows even
# with the copy).
TORCH_INT4_ROWS = 1
AMX_INT4_MAX_ROWS = 48
# Without AMX, the kernel on AVX512-BF16's dot products (a 2-core Zen 5, SmolLM2's 120 layers from memory): from one
# row 1.1x torch's int4 matmul, 1.8x the bf16 copy at 16 rows, 1.4x at 32, 1.2x at 64, even with it at 96.
DOT_INT4_MAX_ROWS = 64
# With the inputs at 8 bits (``cpu_int4_amx.q8_inputs``), the kernel outruns the bf16 copy at every row count
# measured (SmolLM2's 120 layers on a 2-core Zen 5: 0.65x the copy's time at 4,096 rows, 0.5x at 32).
DOT_Q8_INPUTS_MAX_ROWS = 1 << 14


def int4_rows(gguf: bool = True) -> tuple[int, int]:
    """(torch's int4 matmul up to, the 4-bit weights up to) this many rows of a step, on this machine, for a GGUF
    file's layers or (``gguf`` False) an AWQ/GPTQ checkpoint's."""
    if not cpu_int4_amx.available():
        return INT4_MAX_ROWS, INT4_MAX_ROWS
    if cpu_int4_amx.on_amx():
        return TORCH_INT4_ROWS, AMX_INT4_MAX_ROWS
    return 0, DOT_Q8_INPUTS_MAX_ROWS if cpu_int4_amx.q8_inputs(gguf) else DOT_INT4_MAX_ROWS


def int4_max_rows(gguf: bool = True) -> int:
    """The most rows a step runs on the 4-bit weights on this machine."""
    return int4_rows(gguf)[1]


def int4_matmul(x: torch.Tensor, weight: torch.Tensor, scale_zeros: torch.Tensor, amx_codes: torch.Tensor | None,
                amx_scale_zeros: torch.Tensor | None, group: int, torch_rows: int,
                int8_inputs: bool = False) -> torch.Tensor:
    """``x @ W.T`` of 2-D bf16 ``x`` on the 4-bit weights: torch's int4 matmul (``weight``, ``scale_zeros``) up to
    ``torch_rows`` rows or where the kernel has no copy, the 4-bit kernel (``amx_codes``, ``amx_scale_zeros``)
    beyond, ``x`` rounded to 8 bits there where ``int8_inputs``."""
    if amx_codes is None or x.shape[0] <= torch_rows:
        return int4_mm(x.contiguous(), weight, scale_zeros, group)
    if int8_inputs:
        return cpu_int4_amx.int4_q8_mm(x, amx_codes, amx_scale_zeros, group)
    return cpu_int4_amx.int4_amx_mm(x, amx_codes, amx_scale_zeros, group)


def int4_linear(x: torch.Tensor, weight: torch.Tensor, scale_zeros: torch.Tensor, amx_codes: torch.Tensor,
                amx_scale_zeros: torch.Tensor, group: int, dense_weight: torch.Tensor, bias: torch.Tensor | None,
                torch_rows: int, max_rows: int, int8_inputs: int = 0) -> torch.Tensor:
    """``x @ W.T + b`` of 2-D bf16 ``x`` on whichever copy of ``W`` its rows run fastest on: torch's int4 matmul
    (``weight``, ``scale_zeros``) up to ``torch_rows`` rows, the kernel's copy up to ``max_rows``, the oneDNN-packed
    bf16 copy (``dense_weight``) beyond (the last two as ``kernel_linear``)."""
    if x.shape[0] > torch_rows or x.shape[0] > max_rows:
        return kernel_linear(x, amx_codes, amx_scale_zeros, group, dense_weight, bias, max_rows, int8_inputs)
    y = int4_mm(x.contiguous(), weight, scale_zeros, group)
    return y if bias is None else y + bias


# The same as one op the compiler keeps whole: the choice by rows happens when it runs, so a compiled step has no
# guard on its row count for it (one variant serves 2 to 48 rows and beyond).
int4_linear_op = cpu_ops.define(
    "int4_linear(Tensor x, Tensor weight, Tensor scale_zeros, Tensor amx_codes, Tensor amx_scale_zeros, int group, "
    "Tensor dense_weight, Tensor? bias, int torch_rows, int max_rows, int int8_inputs=0) -> Tensor", int4_linear,
    lambda x, weight, scale_zeros, amx_codes, *rest: x.new_empty(
        (x.shape[0], amx_codes.shape[0] * cpu_int4_amx.OUTPUTS)))


def kernel_linear(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int,
                  dense_weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
                  int8_inputs: int = 0) -> torch.Tensor:
    """``int4_linear`` of a layer that keeps no copy for torch's int4 matmul (``torch_rows`` 0): the kernel up to
    ``max_rows`` rows, the dense copy beyond. Its own op, for fewer arguments a call: a compiled step gathers and
    passes each layer's tensors every call (SmolLM2's decode step: ~730 through ``int4_linear``, ~490 so)."""
    if x.shape[0] > max_rows:
        return packed_linear(x, dense_weight, bias, codes.shape[0] * cpu_int4_amx.OUTPUTS)
    y = (cpu_int4_amx.int4_q8_mm if int8_inputs else cpu_int4_amx.int4_amx_mm)(x, codes, scale_zeros, group)
    return y if bias is None else y + bias


kernel_linear_op = cpu_ops.define(
    "kernel_linear(Tensor x, Tensor codes, Tensor scale_zeros, int group, Tensor dense_weight, Tensor? bias, "
    "int max_rows, int int8_inputs=0) -> Tensor", kernel_linear,
    lambda x, codes, *rest: x.new_empty((x.shape[0], codes.shape[0] * cpu_int4_amx.OUTPUTS)))


def kernel_glu(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, group: int,
               dense_weight: torch.Tensor, max_rows: int) -> torch.Tensor:
    """``silu(g) * u`` of a merged gate and up projection ``[g, u] = kernel_linear(x, ...)`` (no bias): in the 8-bit
    input loop's epilogue up to ``max_rows`` rows (``cpu_int4_amx.int4_q8_glu``: the gate and up results never
    written out), else after the dense copy's matmul, in float32 rounded once as the compiled step computes it."""
    if x.shape[0] <= max_rows:
        return cpu_int4_amx.int4_q8_glu(x, codes, scale_zeros, group)
    y = packed_linear(x, dense_weight, None, codes.shape[0] * cpu_int4_amx.OUTPUTS)
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


kernel_glu_op = cpu_ops.define(
    "kernel_glu(Tensor x, Tensor codes, Tensor scale_zeros, int group, Tensor dense_weight, int max_rows) -> Tensor",
    kernel_glu, lambda x, codes, *rest: x.new_empty((x.shape[0], codes.shape[0] * cpu_int4_amx.OUTPUTS // 2)))


# The output projection from GGUF's 8-bit codes (Q8_0) on AMX up to this many rows (the sampled positions of a
# step): 2.5-2.9 ms on SmolLM2's 49152 x 576 table from memory against the bf16 copy's 4.0-6.0; beyond, the copy's.
Q8_MAX_ROWS = 32
# On AVX512-BF16's dot products (a 2-core Zen 5, SmolLM2's table): 1.01 / 1.17 / 1.38 ms at 1 / 4 / 8 rows against
# the bf16 copy's 1.75 / 1.73 / 1.81, even with it from 16 (benchmarks/cpu_int4.py).
DOT_Q8_MAX_ROWS = 8
# With the inputs at 8 bits too (``cpu_int4_amx.q8_inputs``) every step up to DOT_Q8_INPUTS_MAX_ROWS: 0.46 / 0.60 /
# 1.79 / 6.25 ms at 1 / 8 / 32 / 128 rows against the bf16 copy's 1.41 / 1.55 / 2.81 / 8.27 (the table in cache).


def q8_max_rows(int8_inputs: bool = False) -> int:
    """The most sampled rows a step takes its logits from the 8-bit codes for, on this machine."""
    if cpu_int4_amx.on_amx():
        return Q8_MAX_ROWS
    return DOT_Q8_INPUTS_MAX_ROWS if int8_inputs else DOT_Q8_MAX_ROWS


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, dense_weight: torch.Tensor,
              bias: torch.Tensor | None, max_rows: int, int8_inputs: int = 0, float_out: int = 0) -> torch.Tensor:
    """``x @ W.T + b`` of 2-D bf16 ``x``: the kernel over the 8-bit codes up to ``max_rows`` rows (its inputs
    rounded to 8 bits where ``int8_inputs``, the codes then laid out by ``pack_q8_quads``), the oneDNN-packed bf16
    copy beyond. ``float_out``: the 8-bit input loop's bf16 results widened to float32 as the kernel stores them
    (logits; the other paths return bf16)."""
    out_features = codes.shape[0] * cpu_int4_amx.OUTPUTS
    if x.shape[0] > max_rows:
        return packed_linear(x, dense_weight, bias, out_features)
    if int8_inputs:
        y = cpu_int4_amx.q8_q8_mm(x, codes, scales, torch.float32 if float_out else torch.bfloat16)
    else:
        y = cpu_int4_amx.q8_amx_mm(x, codes, scales)
    return y if bias is None else y + bias


def _q8_linear_shape(x, codes, scales, dense_weight, bias, max_rows, int8_inputs=0, float_out=0):
    dtype = torch.float32 if float_out and int8_inputs and x.shape[0] <= max_rows else x.dtype
    return x.new_empty((x.shape[0], codes.shape[0] * cpu_int4_amx.OUTPUTS), dtype=dtype)


q8_linear_op = cpu_ops.define(
    "q8_linear(Tensor x, Tensor codes, Tensor scales, Tensor dense_weight, Tensor? bias, int max_rows, "
    "int int8_inputs=0, int float_out=0) -> Tensor",
    q8_linear, _q8_linear_shape)


class Q8Linear(nn.Module):
    """A ``PackedLinear`` (``dense``) with the 8-bit codes its weight was dequantized from (GGUF Q8_0: ``W = d *
    q``, one fp16 ``d`` per 32 inputs), which steps of few rows multiply on AMX: half the bytes, the same bf16
    weights (``d * q`` is exact in float32 and rounds as the copy did). With ``int8_inputs`` (the dot products'
    default for a GGUF file) the codes are laid out for ``q8_q8_mm`` and the inputs rounded to 8 bits; with
    ``float_out`` as well (an output projection: logits) that loop stores its bf16 results as float32."""

    def __init__(self, dense: PackedLinear, q: torch.Tensor, d: torch.Tensor, max_rows: int = Q8_MAX_ROWS,
                 int8_inputs: bool = False, float_out: bool = False) -> None:
        super().__init__()
        self.dense, self.max_rows, self.int8_inputs, self.float_out = dense, max_rows, int8_inputs, float_out
        self.in_features, self.out_features = dense.in_features, dense.out_features
        codes = cpu_int4_amx.pack_q8_quads(q) if int8_inputs else cpu_int4_amx.pack_q8_codes(q)
        self.register_buffer("q8_codes", codes, persistent=False)
        self.register_buffer("q8_scales", d.t().contiguous().half(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.dense(x)
        args = (x, self.q8_codes, self.q8_scales, self.dense.packed_weight, self.dense.bias, self.max_rows,
                int(self.int8_inputs), int(self.float_out))
        return q8_linear_op(*args) if torch.compiler.is_compiling() else q8_linear(*args)

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.q8_codes, self.q8_scales))


@torch.no_grad()
def attach_q8_output(model: nn.Module, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> int:
    """Give the model's packed output projection (a tied table's copy, or an ``lm_head`` layer's) the 8-bit codes
    ``q`` [V, H] (int8) and scales ``d`` [V, H / 32] it came from (``Q8Linear``). Returns the bytes they take; 0
    where the kernel does not serve here or the projection is not packed."""
    if not cpu_int4_amx.q8_serves(*q.shape, dtype):
        return 0
    int8_inputs = cpu_int4_amx.q8_inputs()  # a GGUF file's, as its 4-bit layers'
    head = getattr(model, "lm_head", None)
    if isinstance(head, PackedLinear):
        model.lm_head = Q8Linear(head, q, d, q8_max_rows(int8_inputs), int8_inputs, float_out=True)
        return model.lm_head.held_bytes()
    if isinstance(getattr(head, "packed", None), PackedLinear) and getattr(head, "tp_size", 1) == 1:
        head.packed = Q8Linear(head.packed, q, d, q8_max_rows(int8_inputs), int8_inputs, float_out=True)
        return head.packed.held_bytes()
    return 0


class Int4CPUMethod:
    """A layer holding its weight twice on the CPU: 4-bit packed codes with a scale and zero per ``group``
    inputs (``kvloom.kernels.cpu_int4``) for decode steps of few rows, and the dense (oneDNN-packed) weight
    for bigger steps. ``source``: the format it came from (GGUF types, awq, gptq), for the log."""

    def __init__(self, dense, source: str, max_rows: int = INT4_MAX_ROWS, group: int = GROUP,
                 torch_rows: int | None = None, int8_inputs: bool = False) -> None:
        self.dense, self.source, self.max_rows, self.group = dense, source, max_rows, group
        # with the AMX kernel's copy (``int4_amx_codes``): torch's int4 matmul up to this many rows, AMX's beyond
        self.torch_rows = max_rows if torch_rows is None else torch_rows
        self.int8_inputs = int8_inputs  # the kernel rounds its rows to 8 bits (``cpu_int4_amx.q8_inputs``)

    @property
    def name(self) -> str:
        inputs = ", the kernel's inputs at 8 bits" if self.int8_inputs else ""
        return (f"int4 ({self.source}) for steps of <= {self.max_rows} rows, else "
                f"{getattr(self.dense, 'name', 'dense')}{inputs}")

    def create_weights(self, layer) -> None:
        raise RuntimeError("an int4 CPU layer is made from a loaded one")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != layer.int4_scale_zeros.dtype:
            return self.dense.apply(layer, x)
        # once the dense copy is oneDNN-packed, the bias lives with it
        packed = getattr(layer, "packed", None)
        bias = layer.bias if layer.bias is not None else getattr(packed, "bias", None)
        codes = getattr(layer, "int4_amx_codes", None)
        if codes is not None and packed is not None and self.torch_rows == 0:
            args = (x, codes, layer.int4_amx_scale_zeros, self.group, packed.packed_weight, bias, self.max_rows,
                    int(self.int8_inputs))
            return kernel_linear_op(*args) if torch.compiler.is_compiling() else kernel_linear(*args)
        if codes is not None and packed is not None:
            args = (x, layer.int4_weight, layer.int4_scale_zeros, codes, layer.int4_amx_scale_zeros, self.group,
                    packed.packed_weight, bias, self.torch_rows, self.max_rows, int(self.int8_inputs))
            return int4_linear_op(*args) if torch.compiler.is_compiling() else int4_linear(*args)
        if x.shape[0] > self.max_rows:
            return self.dense.apply(layer, x)
        y = int4_matmul(x, layer.int4_weight, layer.int4_scale_zeros, codes,
                        getattr(layer, "int4_amx_scale_zeros", None), self.group, self.torch_rows, self.int8_inputs)
        return y if bias is None else y + bias

    def apply_silu_and_mul(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this merged layer's output in one op (``kernel_glu``) where the 8-bit input loop
        serves its rows; None (the matmul, then the activation) where it never does or a bias comes between."""
        packed = getattr(layer, "packed", None)
        codes = getattr(layer, "int4_amx_codes", None)
        if (not self.int8_inputs or self.torch_rows or codes is None or packed is None or x.dim() != 2
                or x.dtype != layer.int4_scale_zeros.dtype or packed.bias is not None or codes.shape[0] % 2):
            return None
        args = (x, codes, layer.int4_amx_scale_zeros, self.group, packed.packed_weight, self.max_rows)
        return kernel_glu_op(*args) if torch.compiler.is_compiling() else kernel_glu(*args)

    def process_weights_after_loading(self, layer) -> None:
        pass

    def held_bytes(self, layer, device_type: str) -> int:
        return int4_bytes(layer) + self.dense.held_bytes(layer, device_type)


def int4_bytes(layer) -> int:
    return sum(b.numel() * b.element_size() for n, b in layer.named_buffers(recurse=False) if n.startswith("int4_"))


@torch.no_grad()
def attach_int4(model: nn.Module, codes: dict, stacked: dict, dtype: torch.dtype) -> tuple[int, int]:
    """Give every linear layer whose checkpoint tensors all came as 4-bit codes (``codes``: checkpoint
    weight name -> (type name, q, scale, zero), ``kvloom.kernels.cpu_int4.gguf_int4_codes``) its packed
    4-bit copy and ``Int4CPUMethod``. ``stacked``: the family's checkpoint module -> (fused layer, shard).
    Returns (layers given one, bytes of the 4-bit copies)."""
    count = total = 0
    for layer in [m for m in model.modules() if isinstance(m, LinearBase)]:
        if layer.tp_size != 1 or not hasattr(layer.method, "apply"):
            continue
        head, _, last = layer.prefix.rpartition(".")
        if layer.shard_ids is None:
            names = [f"{layer.prefix}.weight"]
        else:
            by_shard = {shard: name for name, (fused, shard) in stacked.items() if fused == last}
            names = [f"{head}.{by_shard.get(s)}.weight" for s in layer.shard_ids]
        parts = [codes.get(n) for n in names]
        if any(p is None for p in parts):
            continue
        q, scale, zero = (torch.cat([p[i] for p in parts]) for i in (1, 2, 3))
        attach_layer_int4(layer, q, scale, zero, GROUP, "/".join(sorted({p[0] for p in parts})), dtype)
        count += 1
        total += int4_bytes(layer)
    return count, total


@torch.no_grad()
def attach_layer_int4(layer, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, source: str,
                      dtype: torch.dtype, gguf: bool = True) -> None:
    """Give ``layer`` (dense, or its dense copy oneDNN-packed) the 4-bit copy of codes ``q`` [N, K] with
    ``scale``/``zero`` [N, K / group] (``W = (q - 8) * scale + zero``) and ``Int4CPUMethod``; ``gguf``: from a GGUF
    file, not an AWQ/GPTQ checkpoint (``cpu_int4_amx.q8_inputs``)."""
    packed, sz = pack_int4(q, scale, zero, dtype)
    kernel = cpu_int4_amx.serves(*q.shape, group, dtype)
    torch_rows, max_rows = int4_rows(gguf)
    kernel_sz = cpu_int4_amx.pack_scale_zeros(sz) if kernel else None
    if kernel and torch_rows == 0:  # torch's matmul never runs here: its copy is not kept
        packed, sz = packed.new_empty(0), sz.new_empty(0)
    layer.register_buffer("int4_weight", packed, persistent=False)
    layer.register_buffer("int4_scale_zeros", sz, persistent=False)
    if kernel:
        # the same weights in the kernel's layouts, for steps of more than torch's rows up to the 4-bit weights' most
        layer.register_buffer("int4_amx_codes", cpu_int4_amx.pack_codes(q), persistent=False)
        layer.register_buffer("int4_amx_scale_zeros", kernel_sz, persistent=False)
        layer.method = Int4CPUMethod(layer.method, source, max_rows, group, torch_rows=torch_rows,
                                     int8_inputs=cpu_int4_amx.q8_inputs(gguf))
    else:
        layer.method = Int4CPUMethod(layer.method, source, group=group)
