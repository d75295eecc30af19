"""Linear layers that own their weights: replicated, merged column (gate/up), QKV and row layers.

Each parameter carries ``weight_loader(param, tensor, shard_id)``: the model maps a checkpoint name to
(layer, shard) and the layer puts the tensor in place, so a fused ``qkv_proj`` takes ``q_proj``'s packed
``qweight`` as readily as a dense ``weight``. How a layer holds and applies its weight is its
``LinearMethod`` (dense here; packed int4 or FP8 in ``kvloom.core.model.quantization``); the method
declares the parameters, and the loader's missing-weight check covers every one of them.

A parameter's ``output_dim``/``input_dim`` name the checkpoint tensor's dims along the layer's output
and input features (None where it has none). Those are what a tensor-parallel layer narrows by rank
(``tp_rank``/``tp_size``: ``--tensor-parallel-size``), and what a merged layer offsets each
shard along, scaled by how packed the parameter is (an int32 of 8 nibbles holds 8 outputs).

A layer an adapter can target gains a LoRA slot (``lora``, a ``kvloom.core.model.lora.LayerLoRA``) when the
engine serves adapters: its output then gets each token's adapter term added, after the weight format's
matmul, so adapters sit on any format. Such a layer takes its input unfused (no FP8 rows, no fused epilogue).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions


class LinearMethod(Protocol):
    """How one linear layer holds and applies its weight."""

    def create_weights(self, layer: "LinearBase") -> None:
        """Register the layer's parameters (``layer.add_param``) on the meta device, in their dtypes."""
        ...

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` in this format."""
        ...

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Repack, dequantize or transpose, once, after every tensor of the layer is loaded. May replace
        ``layer.method`` (e.g. a CPU run of a packed format dequantizes and becomes dense)."""
        ...

    def held_bytes(self, layer: "LinearBase", device_type: str) -> int:
        """Bytes the layer holds on ``device_type`` after processing (``engine plan`` sizes weights by it;
        ``layer`` may be on the meta device)."""
        ...


class UnquantizedLinearMethod:
    """A dense ``[out, in]`` weight in the model dtype."""

    name = "dense"

    def create_weights(self, layer: "LinearBase") -> None:
        layer.add_param("weight", torch.empty(layer.output_size, layer.input_size, dtype=layer.params_dtype),
                        output_dim=0, input_dim=1)

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        pass

    def held_bytes(self, layer: "LinearBase", device_type: str) -> int:
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


def set_dense_weight(layer: "LinearBase", weight: torch.Tensor) -> None:
    """Replace whatever the layer holds by a dense ``[out, in]`` weight (a format dequantized at load)."""
    for name in list(layer._parameters):
        if name != "bias":
            delattr(layer, name)
    layer.add_param("weight", weight.to(layer.params_dtype).contiguous(), output_dim=0, input_dim=1)
    layer.method = UnquantizedLinearMethod()


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` over ``input_size`` inputs and the concatenated ``output_sizes`` (one per shard)."""

    parallel = "replicated"  # "column": outputs split by rank; "row": inputs split by rank
    lora = None  # the layer's LoRA slot, once the engine serves adapters

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, *, method: LinearMethod,
                 prefix: str, shard_ids: Sequence | None = None, params_dtype: torch.dtype | None = None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        split_out = tp_size if self.parallel == "column" else 1
        split_in = tp_size if self.parallel == "row" else 1
        for size, what in [(input_size, "input size")] * (split_in > 1) + [(s, "output size") for s in output_sizes] * (split_out > 1):
            if size % tp_size:
                raise ValueError(f"{prefix}: {what} {size} does not split into tp_size={tp_size} parts")
        self.prefix = prefix
        self.input_size = input_size // split_in
        self.output_sizes = [s // split_out for s in output_sizes]
        self.output_size = sum(self.output_sizes)
        self.shard_ids = list(shard_ids) if shard_ids is not None else None
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.method = method
        method.create_weights(self)
        if bias:
            self.add_param("bias", torch.empty(self.output_size, dtype=self.params_dtype), output_dim=0)
        else:
            self.register_parameter("bias", None)

    # --- parameters --------------------------------------------------------------------------------
    def add_param(self, name: str, data: torch.Tensor, *, output_dim: int | None = None,
                  input_dim: int | None = None, per_shard: bool = False) -> nn.Parameter:
        """Register ``data`` as parameter ``name`` loaded by ``self.weight_loader``. ``per_shard``: the
        parameter has a leading dim of one entry per shard (a per-tensor scale of each of q, k, v).
        A parameter marked ``scalar_fills`` takes a one-element checkpoint tensor as a fill of its slice."""
        param = nn.Parameter(data, requires_grad=False)
        param.output_dim, param.input_dim, param.per_shard = output_dim, input_dim, per_shard
        param.weight_loader = self.weight_loader
        self.register_parameter(name, param)
        return param

    @property
    def num_shards(self) -> int:
        return len(self.shard_ids) if self.shard_ids is not None else 1

    def shard_index(self, shard_id) -> int:
        if self.shard_ids is None:
            if shard_id is not None:
                raise ValueError(f"{self.prefix} is not a merged layer; it has no shard {shard_id!r}")
            return 0
        if shard_id not in self.shard_ids:
            raise ValueError(f"{self.prefix} has shards {self.shard_ids}, not {shard_id!r}")
        return self.shard_ids.index(shard_id)

    def _name_of(self, param: nn.Parameter) -> str:
        return next((f"{self.prefix}.{n}" for n, p in self._parameters.items() if p is param), self.prefix)

    def _narrow_for_rank(self, param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor: outputs of a column layer, inputs of a row layer."""
        dim = param.output_dim if self.parallel == "column" else param.input_dim if self.parallel == "row" else None
        if self.tp_size == 1 or dim is None or (tensor.numel() == 1 and getattr(param, "scalar_fills", False)):
            return tensor
        if self.parallel == "row" and getattr(getattr(self.method, "method", None), "desc_act", False):
            # desc_act reorders the inputs across the whole matrix: one rank's inputs are no run of groups.
            raise ValueError(f"{self._name_of(param)}: GPTQ with desc_act=True cannot split a row-parallel layer's "
                             f"inputs over tensor_parallel_size={self.tp_size}")
        if dim >= tensor.dim() or tensor.shape[dim] % self.tp_size:
            fmt = getattr(self.method, "name", type(self.method).__name__)
            group = getattr(getattr(self.method, "method", None), "group_size", None)
            what = f" (format {fmt}" + (f", group size {group})" if group is not None else ")")
            raise ValueError(f"{self._name_of(param)}: the checkpoint's {tuple(tensor.shape)} tensor{what} does not "
                             f"split into tensor_parallel_size={self.tp_size} equal parts along dim {dim}")
        size = tensor.shape[dim] // self.tp_size
        return tensor.narrow(dim, self.tp_rank * size, size)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        """Put checkpoint ``tensor`` (of shard ``shard_id``; None for the whole layer) into ``param``."""
        if self.parallel == "row" and self.tp_rank > 0 and param is self.bias:
            tensor = torch.zeros_like(tensor)  # the ranks' partial sums are all-reduced: rank 0 adds the bias
        tensor = self._narrow_for_rank(param, tensor)
        index = self.shard_index(shard_id)
        if param.per_shard:
            dst = param.data[index]
        elif shard_id is None:
            dst = param.data
        elif param.output_dim is None:  # shared by the shards (e.g. the same g_idx for q, k and v)
            dst = param.data
        else:
            dim = param.output_dim
            full = param.shape[dim]
            if (full * self.output_sizes[index]) % self.output_size:
                raise ValueError(f"{self._name_of(param)}: shard {shard_id!r} of {self.output_sizes[index]} outputs "
                                 f"does not align with the parameter's packing ({full} entries for {self.output_size})")
            start = full * sum(self.output_sizes[:index]) // self.output_size
            dst = param.data.narrow(dim, start, full * self.output_sizes[index] // self.output_size)
        if getattr(param, "scalar_fills", False) and tensor.numel() == 1:
            dst.fill_(tensor.reshape(()).to(dst.dtype))  # a per-tensor scale of a per-channel parameter
            return
        if tensor.numel() == dst.numel() and (dst.numel() == 1 or getattr(param, "scalar_fills", False)):
            tensor = tensor.reshape(dst.shape)  # [1] vs [] scalars; [out] vs [out, 1] channel scales
        if tuple(dst.shape) != tuple(tensor.shape):
            where = f" shard {shard_id!r}" if shard_id is not None else ""
            raise ValueError(f"{self._name_of(param)}{where}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(dst.shape)}")
        dst.copy_(tensor)

    # --- running -----------------------------------------------------------------------------------
    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.lora is None else self.lora.apply(x, y)

    def takes_fp8_rows(self, rows: int) -> bool:
        """Whether the weight format runs ``rows`` rows on FP8 activations it would quantize itself, so the
        kernel before may hand it ``quant_reference.FP8Rows`` instead (its ``takes_fp8_rows``)."""
        takes = getattr(self.method, "takes_fp8_rows", None)
        return takes is not None and self.lora is None and takes(self, rows)

    def forward_silu_and_mul(self, x, fp8: bool = False, kernels: KernelOptions = DEFAULT_KERNELS):
        """``silu(gate) * up`` of a merged [gate; up] layer's output: in the matmul's epilogue where the
        weight format has a kernel for it at this row count (``apply_silu_and_mul``; one kernel less a
        decode step), else the matmul and then ``ops.silu_and_mul``; with ``fp8`` (the next layer
        ``takes_fp8_rows``) quantized per row in that kernel, where it can (``FP8Rows``)."""
        fused = getattr(self.method, "apply_silu_and_mul", None)
        out = None
        if (fused is not None and self.bias is None and self.num_shards == 2 and isinstance(x, torch.Tensor)
                and self.lora is None):
            out = fused(self, x)
        if out is not None:
            return out
        from kvloom.kernels import ops

        y = self.forward(x)  # with the adapter term: the activation acts on the adapted gate/up
        out = ops.silu_and_mul_fp8(y, kernels) if fp8 else None
        return ops.silu_and_mul(y, kernels) if out is None else out

    def forward_qkv_rope(self, x: torch.Tensor, rope, kv_cache, slot_mapping: torch.Tensor, num_q_heads: int,
                         num_kv_heads: int, k_scale: float, v_scale: float) -> torch.Tensor | None:
        """A qkv layer's output with q and k rotated (``rope``: ``ops.rotary_tables``' CUDA form) and this
        step's k/v written into ``kv_cache`` at ``slot_mapping``, in the projection's own kernel, where the
        weight format does that at ``x``'s row count (its ``apply_qkv_rope``); None otherwise (nothing
        done)."""
        fused = getattr(self.method, "apply_qkv_rope", None)
        if fused is None or self.tp_size != 1 or self.lora is not None:
            return None
        return fused(self, x, rope, kv_cache, slot_mapping, num_q_heads, num_kv_heads, k_scale, v_scale)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, "
                f"method={getattr(self.method, 'name', type(self.method).__name__)}")


class ReplicatedLinear(LinearBase):
    """A whole projection on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool, **kw) -> None:
        super().__init__(input_size, [output_size], bias, **kw)


class ColumnLinear(LinearBase):
    """Outputs split by rank (``lm_head``: each rank's share of the vocabulary)."""

    parallel = "column"

    def __init__(self, input_size: int, output_size: int, bias: bool, **kw) -> None:
        super().__init__(input_size, [output_size], bias, **kw)


class MergedColumnLinear(LinearBase):
    """Several column projections of one input in one matmul (gate/up: shards 0 and 1)."""

    parallel = "column"

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, **kw) -> None:
        super().__init__(input_size, output_sizes, bias, shard_ids=list(range(len(output_sizes))), **kw)


class QKVLinear(LinearBase):
    """q, k and v of one attention in one matmul (shards ``"q"``, ``"k"``, ``"v"``)."""

    parallel = "column"

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, **kw) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_ids=["q", "k", "v"], **kw)


class RowLinear(LinearBase):
    """Inputs split by rank (``o_proj``, ``down_proj``); ranks' partial sums are reduced by the caller."""

    parallel = "row"

    def __init__(self, input_size: int, output_size: int, bias: bool, **kw) -> None:
        super().__init__(input_size, [output_size], bias, **kw)
