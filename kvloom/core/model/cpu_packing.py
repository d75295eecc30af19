"""Dense linear layers packed for the CPU after loading: each weight handed to oneDNN's blocked layout
once (``kvloom.kernels.cpu_linear.PackedLinear``), and the layer's method switched to the packed call."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.core.model.linear import LinearBase, UnquantizedLinearMethod
from kvloom.kernels.cpu_linear import PackedLinear, packing_supported


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
