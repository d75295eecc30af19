"""GPTQ checkpoints (``quant_method: "gptq"``): 4- or 8-bit weights packed along the inputs, a zero
point and fp16 scale per group (``group_size`` 32/64/128, or -1 for one group), symmetric or not,
``desc_act`` with each input's group in ``g_idx``, zero points stored minus one (v1) or as is
(``checkpoint_format: "gptq_v2"``). Layout details: ``kvloom.kernels.quant_reference``."""

from __future__ import annotations

import torch

from kvloom.core.config import ConfigError
from kvloom.core.model.linear import LinearBase, set_dense_weight
from kvloom.core.model.quantization.base import QuantizationMethod, check_choice, dense_bytes, param_bytes
from kvloom.core.model.quantization.packed_int import (INT_KERNELS, cpu_int4_bytes, cpu_int4_refusal, keep_packed,
                                                      set_cpu_weights, set_packed_weight, tinygemm_bytes)
from kvloom.kernels.quant_reference import dequantize_gptq, gptq_codes, repack_gptq

GPTQ_BITS = (4, 8)
GPTQ_GROUP_SIZES = (-1, 32, 64, 128)
GPTQ_FORMATS = ("gptq", "gptq_v2")


class GPTQMethod(QuantizationMethod):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str = "gptq",
                 modules_to_not_convert=()) -> None:
        super().__init__(modules_to_not_convert)
        self.keep_packed: bool | None = None  # None: packed on CUDA, dequantized at load on the CPU
        self.dense_layers: list[str] = []  # packed-path layers that had to be dequantized instead
        self.cpu_int4 = True  # on the CPU in bfloat16 4-bit layers also keep a 4-bit copy (the gguf_int4 option)
        self.cpu_tally: dict = {"int4": 0, "int4_bytes": 0, "dense": {}}
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_config(cls, qc: dict) -> "GPTQMethod":
        bits = check_choice(qc, "bits", GPTQ_BITS, "gptq")
        group = check_choice(qc, "group_size", GPTQ_GROUP_SIZES, "gptq")
        desc_act = check_choice(qc, "desc_act", (False, True), "gptq", default=False)
        sym = check_choice(qc, "sym", (True, False), "gptq", default=True)
        fmt = check_choice(qc, "checkpoint_format", GPTQ_FORMATS, "gptq", default="gptq")
        # transformers writes modules_to_not_convert; GPTQModel the dynamic "-:" exclusions (not supported)
        if qc.get("dynamic"):
            raise ConfigError(f"quantization_config.dynamic={qc['dynamic']!r} is not supported by gptq; supported: "
                              "[None, {}] (per-module bits and group sizes)")
        return cls(bits, group, desc_act, sym, fmt, qc.get("modules_to_not_convert") or ())

    def quantized_linear_method(self, prefix: str) -> "GPTQLinearMethod":
        return GPTQLinearMethod(self)

    def describe(self) -> str:
        group = "one group per column" if self.group_size == -1 else f"group size {self.group_size}"
        return (f"Quantization: gptq ({self.checkpoint_format}), {self.bits} bits, {group}, "
                f"{'symmetric' if self.sym else 'asymmetric'}, desc_act={self.desc_act}; kernel: {self.kernel}"
                + (f" ({len(self.dense_layers)} fused layers with per-shard input orders dequantized at load)"
                   if self.dense_layers else ""))


class GPTQLinearMethod:
    name = "gptq"

    def __init__(self, method: GPTQMethod) -> None:
        self.method = method
        # Without desc_act, g_idx is i // group_size; GPTQ checkpoints save it anyway.
        self.ignored = () if method.desc_act else ("g_idx",)

    def groups(self, layer: LinearBase) -> int:
        g = self.method.group_size
        return 1 if g == -1 else -(-layer.input_size // g)

    def create_weights(self, layer: LinearBase) -> None:
        bits, g = self.method.bits, self.method.group_size
        per_word = 32 // bits
        if g != -1 and not self.method.desc_act and layer.input_size % g:
            raise ConfigError(f"{layer.prefix}: {layer.input_size} inputs do not split into GPTQ groups of "
                              f"quantization_config.group_size={g}")
        if layer.input_size % per_word or any(s % per_word for s in layer.output_sizes):
            raise ConfigError(f"{layer.prefix}: {layer.input_size} inputs and outputs {layer.output_sizes} must be "
                              f"multiples of {per_word} for {bits}-bit GPTQ packing")
        out, groups = layer.output_size, self.groups(layer)
        layer.add_param("qweight", torch.empty(layer.input_size // per_word, out, dtype=torch.int32),
                        output_dim=1, input_dim=0)
        layer.add_param("qzeros", torch.empty(groups, out // per_word, dtype=torch.int32), output_dim=1, input_dim=0)
        layer.add_param("scales", torch.empty(groups, out, dtype=torch.float16), output_dim=1, input_dim=0)
        if self.method.desc_act:  # one per shard: q, k and v may each have their own order
            layer.add_param("g_idx", torch.empty(layer.num_shards, layer.input_size, dtype=torch.int32),
                            input_dim=0, per_shard=True)

    def dequantize(self, layer: LinearBase, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[out, in]`` weight, shard by shard (each may have its own ``g_idx``)."""
        m = self.method
        v1 = m.checkpoint_format == "gptq"
        per_word = 32 // m.bits
        parts, start = [], 0
        for index, size in enumerate(layer.output_sizes):
            cols = slice(start, start + size)
            zcols = slice(start // per_word, (start + size) // per_word)
            g_idx = layer.g_idx[index] if m.desc_act else None
            parts.append(dequantize_gptq(layer.qweight[:, cols], layer.qzeros[:, zcols], layer.scales[:, cols],
                                         g_idx, m.bits, m.group_size, v1, dtype))
            start += size
        return torch.cat(parts, 0)

    def _input_order(self, layer: LinearBase):
        """(permutation, group size) that makes the groups contiguous runs of inputs, or None where the
        shards' g_idx differ or the groups are ragged (those layers are dequantized at load)."""
        m = self.method
        g = m.group_size if m.group_size > 0 else layer.input_size
        if not m.desc_act:
            return None, g
        g_idx = layer.g_idx.data
        if not bool((g_idx == g_idx[0]).all()):
            return False, g
        perm = torch.argsort(g_idx[0].long(), stable=True)
        if not torch.equal(g_idx[0].long()[perm], torch.arange(layer.input_size, device=perm.device) // g):
            return False, g
        return perm, g

    def cpu_int4_group(self, layer: LinearBase) -> tuple[int, str | None]:
        """(group size, None) of the CPU's 4-bit copy of this layer, or (0, why it keeps none). One group per
        column runs as groups of the largest size the int4 matmul takes; under desc_act the inputs must be
        in group order already (``g_idx`` ``i // group_size`` in every shard; unknown on the meta device,
        where ``engine plan`` counts no copy)."""
        m = self.method
        if m.bits != 4:
            return 0, f"{m.bits}-bit"
        k = layer.input_size
        g = m.group_size if m.group_size > 0 else next((s for s in (256, 128, 64, 32) if k % s == 0), None)
        if g is None:
            return 0, f"one group of {k} inputs: no group size of the int4 matmul divides it"
        if m.desc_act:
            g_idx = layer.g_idx.data
            own = m.group_size if m.group_size > 0 else k
            if g_idx.is_meta or k % g or not torch.equal(
                    g_idx.long(), (torch.arange(k, device=g_idx.device) // own).expand_as(g_idx)):
                return 0, "act-order: g_idx not in group order"
        refusal = cpu_int4_refusal(layer, g, m.cpu_int4 and m.keep_packed is None)
        return (0, refusal) if refusal is not None else (g, None)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        m = self.method
        packed = keep_packed(layer.qweight.device, m.keep_packed)
        perm, g = self._input_order(layer) if packed else (False, 0)
        if perm is False and not packed:  # the CPU: dense matmuls beat unpacking, a 4-bit copy for decode steps
            g, refusal = self.cpu_int4_group(layer)
            codes = None
            if refusal is None:
                from kvloom.kernels.cpu_int4 import zero_point_codes

                q, z = gptq_codes(layer.qweight.data, layer.qzeros.data, 4, m.checkpoint_format == "gptq")
                codes = zero_point_codes(q, z, layer.scales.data, g)
            set_cpu_weights(layer, m, self.dequantize(layer), codes, g, refusal)
            return
        if perm is False:  # q, k and v with their own input orders cannot share one sorted matmul
            weight = self.dequantize(layer)
            m.dense_layers.append(layer.prefix)
            set_dense_weight(layer, weight)
            return
        qweight, zeros = repack_gptq(layer.qweight.data, layer.qzeros.data, m.bits, m.checkpoint_format == "gptq", perm)
        set_packed_weight(layer, qweight, zeros, layer.scales.data, g, m.bits, perm, kernels=m.kernels)
        m.kernel = (INT_KERNELS[m.bits, layer.method.layout]
                    + (", inputs sorted by group (desc_act)" if perm is not None else ""))

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: GPTQ weights are used before process_weights_after_loading")

    def held_bytes(self, layer: LinearBase, device_type: str) -> int:
        if device_type == "cpu":
            g, refusal = self.cpu_int4_group(layer)
            return dense_bytes(layer) + (cpu_int4_bytes(layer, g) if refusal is None else 0)
        per_word = 32 // self.method.bits
        group = self.method.group_size if self.method.group_size > 0 else layer.input_size
        return (param_bytes(layer) - layer.qzeros.numel() * 4 + layer.qzeros.numel() * per_word
                + tinygemm_bytes(layer, self.method.bits, group, device_type, self.method.kernels))

    @torch.no_grad()
    def init_dummy(self, layer: LinearBase, gen: torch.Generator) -> None:
        """Random packed values and zero points, scales that give weights of about N(0, 0.02), and under
        desc_act a random order of the inputs' groups."""
        q = layer.qweight
        q.copy_(torch.randint(-2**31, 2**31 - 1, q.shape, generator=gen, device=q.device, dtype=torch.int64))
        bits = self.method.bits
        zero = 2 ** (bits - 1) - (self.method.checkpoint_format == "gptq")  # the middle; v1 stores it minus one
        word = sum(zero << (bits * i) for i in range(32 // bits))
        layer.qzeros.fill_(word - 2**32 if word >= 2**31 else word)
        levels = 2 ** bits
        layer.scales.uniform_(0.05 / levels, 0.09 / levels, generator=gen)  # std of the weights about 0.02
        if self.method.desc_act:
            g = self.method.group_size if self.method.group_size > 0 else layer.input_size
            groups = torch.arange(layer.input_size, device=layer.g_idx.device) // g
            for s in range(layer.num_shards):
                perm = torch.randperm(layer.input_size, generator=gen, device=layer.g_idx.device)
                layer.g_idx[s].copy_(groups[perm])
