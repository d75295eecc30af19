"""Pre-packed linear layers for the CPU.

``F.linear`` on the CPU hands a plain row-major weight to the BLAS on every call, which re-blocks it
for its micro-kernel each time; for the small-M matmuls of decoding that re-blocking costs as much as
the product. oneDNN can take the weight already laid out in its blocked format, once, after loading
(the pass PyTorch's own inductor runs under ``freezing``, and vLLM's CPU backend runs too). Measured on
this project's 2-core AVX-512 CPU, SmolLM2 shapes, malloc tuned as the engine runs: decode (M=32)
1.2-1.5x faster in both dtypes and 2.7x for float32's output projection; prefill-sized calls (M=2048)
mostly 1.05-1.5x (``python benchmarks/cpu_linear.py``).
Numerics stay those of the dtype (float32 accumulates in float32, in another order than MKL).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("kvloom")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bfloat16 matmuls at twice float32's rate (elsewhere oneDNN emulates them)."""
    get = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if get is None:
        return False
    caps = get()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build and CPU can run oneDNN packed linears in ``dtype``."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not ops._is_mkldnn_bf16_supported():
        return False
    return True


class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (an opaque tensor: CPU only, not
    a parameter; the plain weight is dropped)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedCPUMethod:
    """The ``LinearMethod`` of a layer whose dense weight was packed (its ``packed`` child holds it)."""

    name = "dense, oneDNN-packed"

    def create_weights(self, layer) -> None:
        raise RuntimeError("a packed layer is made from a loaded one")

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return layer.packed(x)

    def process_weights_after_loading(self, layer) -> None:
        pass


@torch.no_grad()
def pack_layer(layer, batch_hint: int = 32) -> bool:
    """The CPU step after loading of a layer with a dense weight (``kvloom.core.model.linear``): hold it
    in oneDNN's blocked layout. Returns whether it was packed (not when unsupported, or not dense)."""
    from kvloom.core.model.linear import UnquantizedLinearMethod

    weight = getattr(layer, "weight", None)
    if (type(layer.method) is not UnquantizedLinearMethod or weight is None or weight.device.type != "cpu"
            or not packing_supported(weight.dtype)):
        return False
    layer.packed = PackedLinear(weight, layer.bias, batch_hint)
    del layer.weight
    layer.register_parameter("bias", None)
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
    from kvloom.core.model.linear import LinearBase

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
