"""FP8 (e4m3) linear layers: ``quant_method: "fp8"`` checkpoints (per-tensor or per-channel
``weight_scale``, static ``input_scale`` or dynamic activations, block-wise ``weight_block_size``),
compressed-tensors FP8 checkpoints (channel or tensor weights, dynamic per-token or static activations),
and online quantization of a dense checkpoint (per-channel weight scales, dynamic per-token activations).

Where the GPU has FP8 matmuls (Ada, Hopper and later) the layer runs W8A8 through ``torch._scaled_mm``
with row-wise scales (fast accumulation), and decode-sized batches (up to 16 rows) W8A8 or one of two
weight-only Triton FP8 GEMVs (bf16 activations: reading the FP8 weight is the whole cost there), by the
rule ``kvloom.kernels.quant.dispatch.fp8_linear_path``; elsewhere (the CPU, older GPUs) and for block-wise
scales, weight-only: the FP8 weight is dequantized at load, so its rounding is kept and the matmul is dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.core.config import ConfigError
from kvloom.core.model.linear import LinearBase, set_dense_weight
from kvloom.core.model.quantization.base import QuantizationMethod, dense_bytes
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.quant_reference import (FP8_DTYPE, FP8Rows, fp8_dequantize_blocks, fp8_quantize,
                                            fp8_scale_per_row)

FP8_ACTIVATION_SCHEMES = ("dynamic", "static")
CT_WEIGHT_STRATEGIES = ("channel", "tensor")


def _gemv_rows() -> int:
    from kvloom.kernels.quant.dispatch import FP8_GEMV_MAX_ROWS

    return FP8_GEMV_MAX_ROWS


def fp8_matmul_supported(device: torch.device) -> bool:
    """cuBLASLt FP8 GEMMs: compute capability 8.9 (Ada) and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_w8a8_linear(x: torch.Tensor | FP8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with ``x`` quantized to FP8 per token (or by the static ``input_scale``; or already,
    ``FP8Rows`` from the kernel before) and ``W`` FP8 ``[out, in]`` with ``weight_scale [out, 1]``, through
    ``torch._scaled_mm``."""
    if isinstance(x, FP8Rows):  # [rows, K], padded and quantized by the kernel before
        xq, scale, rows, dtype, lead = x.data, x.scale, x.rows, x.dtype, (x.rows,)
    else:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if input_scale is None and x2.is_cuda:  # one fused kernel: amax, scale, quantize, pad
            from kvloom.kernels.quant.dispatch import fp8_quantize_rows

            xq, scale = fp8_quantize_rows(x2)
        else:
            scale = fp8_scale_per_row(x2) if input_scale is None else input_scale.float().reshape(1, 1).expand(rows, 1)
            xq = fp8_quantize(x2, scale)
            pad = -rows % 16  # cuBLASLt's FP8 kernels want 16-aligned dims
            if pad:
                xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(FP8_DTYPE)
                scale = F.pad(scale, (0, 0, 0, pad), value=1.0)
    # Hopper's fast accumulation: faster (docs/benchmarks.md) and within the tolerance of tests/kernels' W8A8 test.
    out = torch._scaled_mm(xq, weight.t(), scale_a=scale.contiguous(), scale_b=weight_scale.reshape(1, -1),
                           out_dtype=dtype, use_fast_accum=xq.is_cuda)[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None, bias: torch.Tensor | None,
               kernels: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """An FP8 layer on CUDA: the path ``dispatch.fp8_linear_path`` picks for the row count and shape
    (a weight-only GEMV for decode-sized batches, W8A8 beyond)."""
    from kvloom.kernels.quant import dispatch

    if isinstance(x, FP8Rows):  # quantized by the kernel before, for this W8A8 layer (takes_fp8_rows)
        return fp8_w8a8_linear(x, weight, weight_scale, input_scale, bias)
    path = dispatch.fp8_linear_path(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1])
    if path == "gemv":
        return dispatch.fp8_gemv(x, weight, weight_scale, bias, options=kernels)
    if path == "gemv_dot":
        return dispatch.fp8_weight_only_linear(x, weight, weight_scale, bias)
    return fp8_w8a8_linear(x, weight, weight_scale, input_scale, bias)


class FP8Method(QuantizationMethod):
    name = "fp8"
    bits = 8

    def __init__(self, source: str, activation: str = "dynamic", block: tuple[int, int] | None = None,
                 weight_strategy: str = "tensor", modules_to_not_convert=()) -> None:
        super().__init__(modules_to_not_convert)
        self.source = source  # "fp8", "compressed-tensors" or "online"
        self.activation, self.block, self.weight_strategy = activation, block, weight_strategy

    @classmethod
    def from_config(cls, qc: dict | None) -> "FP8Method":
        if qc is None:
            return cls("online", "dynamic", weight_strategy="channel")
        if qc.get("quant_method") == "compressed-tensors":
            return cls._from_compressed_tensors(qc)
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in FP8_ACTIVATION_SCHEMES:
            raise ConfigError(f"quantization_config.activation_scheme={scheme!r} is not supported by fp8; supported: "
                              f"{list(FP8_ACTIVATION_SCHEMES)}")
        block = qc.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ConfigError(f"quantization_config.weight_block_size={block!r} is not supported by fp8; "
                                  "supported: [rows, columns] of positive ints, e.g. [128, 128]")
            if scheme != "dynamic":
                raise ConfigError("quantization_config.activation_scheme='static' is not supported by fp8 with "
                                  "weight_block_size; supported: ['dynamic']")
            block = tuple(block)
        skip = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
        return cls("fp8", scheme, block, "tensor", skip)

    @classmethod
    def _from_compressed_tensors(cls, qc: dict) -> "FP8Method":
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise ConfigError(f"quantization_config.config_groups has {len(groups)} groups; supported: exactly one "
                              "(FP8 weights of every Linear)")
        group = next(iter(groups.values()))
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ConfigError(f"quantization_config.config_groups.*.weights type={w.get('type')!r} num_bits="
                              f"{w.get('num_bits')!r} is not supported; supported: type 'float', num_bits 8 (FP8)")
        strategy = w.get("strategy")
        if strategy not in CT_WEIGHT_STRATEGIES:
            raise ConfigError(f"quantization_config.config_groups.*.weights.strategy={strategy!r} is not supported; "
                              f"supported: {list(CT_WEIGHT_STRATEGIES)}")
        a = group.get("input_activations")
        if a is None:
            raise ConfigError("quantization_config.config_groups.*.input_activations=None (weight-only FP8) is not "
                              "supported; supported: FP8 activations, dynamic per token or static per tensor")
        if a.get("dynamic"):
            if a.get("strategy") != "token":
                raise ConfigError(f"quantization_config.config_groups.*.input_activations.strategy="
                                  f"{a.get('strategy')!r} is not supported for dynamic activations; supported: ['token']")
            activation = "dynamic"
        elif a.get("strategy") == "tensor":
            activation = "static"
        else:
            raise ConfigError(f"quantization_config.config_groups.*.input_activations.strategy={a.get('strategy')!r} "
                              "is not supported for static activations; supported: ['tensor']")
        return cls("compressed-tensors", activation, None, strategy, qc.get("ignore") or ())

    def quantized_linear_method(self, prefix: str) -> "FP8LinearMethod":
        return FP8LinearMethod(self)

    def describe(self) -> str:
        weights = (f"block scales {self.block[0]}x{self.block[1]}" if self.block else
                   f"per-{'channel' if self.weight_strategy == 'channel' else 'tensor'} weight scales")
        source = {"online": "quantized at load", "fp8": "fp8 checkpoint",
                  "compressed-tensors": "compressed-tensors checkpoint"}[self.source]
        acts = "dynamic per-token" if self.activation == "dynamic" else "static per-tensor"
        return f"Quantization: fp8 e4m3 ({source}), 8 bits, {weights}, {acts} activations; kernel: {self.kernel}"


class FP8LinearMethod:
    name = "fp8"

    def __init__(self, method: FP8Method) -> None:
        self.method = method
        self.w8a8 = False

    def create_weights(self, layer: LinearBase) -> None:
        m = self.method
        out, inp = layer.output_size, layer.input_size
        if m.source == "online":
            layer.add_param("weight", torch.empty(out, inp, dtype=layer.params_dtype), output_dim=0, input_dim=1)
            return
        layer.add_param("weight", torch.empty(out, inp, dtype=FP8_DTYPE), output_dim=0, input_dim=1)
        if m.block:
            bo, bi = m.block
            if any(s % bo for s in layer.output_sizes) and layer.num_shards > 1:
                raise ConfigError(f"{layer.prefix}: output sizes {layer.output_sizes} are not multiples of "
                                  f"quantization_config.weight_block_size[0]={bo}, which a fused layer needs")
            layer.add_param("weight_scale_inv", torch.empty(-(-out // bo), -(-inp // bi), dtype=torch.float32),
                            output_dim=0, input_dim=1)
        else:
            # Per-tensor scales are held per channel (every row of a shard gets its shard's scale), so
            # fused shards keep their own scales and the matmul is always row-wise.
            p = layer.add_param("weight_scale", torch.empty(out, 1, dtype=torch.float32), output_dim=0)
            p.scalar_fills = True
        if m.activation == "static":
            layer.add_param("input_scale", torch.empty(layer.num_shards, dtype=torch.float32), per_shard=True)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        m = self.method
        if m.source == "online":
            scale = fp8_scale_per_row(layer.weight.data)
            weight = fp8_quantize(layer.weight.data, scale)
        elif m.block:
            set_dense_weight(layer, fp8_dequantize_blocks(layer.weight.data, layer.weight_scale_inv.data, m.block))
            m.kernel = f"weight-only, dequantized at load to {str(layer.params_dtype).removeprefix('torch.')}"
            return
        else:
            weight, scale = layer.weight.data, layer.weight_scale.data
        if not fp8_matmul_supported(weight.device):
            set_dense_weight(layer, weight.float() * scale)
            m.kernel = (f"weight-only, dequantized at load to {str(layer.params_dtype).removeprefix('torch.')} "
                        f"({weight.device.type}: no FP8 matmul)")
            return
        input_scale = layer.input_scale.data.max().reshape(1) if m.activation == "static" else None
        for name in ("weight", "weight_scale", "input_scale"):
            if name in layer._parameters:
                delattr(layer, name)
        layer.add_param("weight", weight.contiguous(), output_dim=0, input_dim=1)
        layer.add_param("weight_scale", scale.float().reshape(-1, 1).contiguous(), output_dim=0)
        if input_scale is not None:  # one scale for the fused input: the largest shard's, as vLLM does
            layer.add_param("input_scale", input_scale)
        self.w8a8 = True
        m.kernel = ("W8A8 torch._scaled_mm, row-wise scales, fast accumulation; up to "
                    f"{_gemv_rows()} rows by shape that or a weight-only FP8 GEMV (Triton)")

    def takes_fp8_rows(self, layer: LinearBase, rows: int) -> bool:
        """Whether ``rows`` rows run W8A8 with dynamic per-token scales, so that the kernel before the layer
        may hand it ``FP8Rows`` (``KernelOptions.fp8_fused_quant``)."""
        from kvloom.kernels.quant import dispatch

        return (self.w8a8 and self.method.kernels.fp8_fused_quant and layer.weight.is_cuda
                and getattr(layer, "input_scale", None) is None
                and dispatch.fp8_linear_path(rows, *layer.weight.shape) == "w8a8")

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None), layer.bias,
                          self.method.kernels)

    def apply_qkv_rope(self, layer: LinearBase, x: torch.Tensor, rope, kv_cache, slot_mapping, num_q_heads: int,
                       num_kv_heads: int, k_scale: float, v_scale: float) -> torch.Tensor | None:
        """One row of a qkv layer on the FP8 GEMV with rotary and the cache write in its epilogue
        (``KernelOptions.fp8_qkv_rope``; None: not fused here)."""
        from kvloom.kernels.quant import dispatch

        kernels = self.method.kernels
        rows = x.numel() // x.shape[-1]
        if not (kernels.fp8_qkv_rope and self.w8a8 and x.is_cuda and rows == 1):
            return None
        tiles = dispatch.fp8_qkv_rope_tiles(*layer.weight.shape, options=kernels)
        if tiles is None:
            return None
        positions, cos_sin = rope
        return dispatch.fp8_qkv_rope_gemv(x, layer.weight, layer.weight_scale, layer.bias, positions, cos_sin,
                                              kv_cache[0], kv_cache[1], slot_mapping, num_q_heads, num_kv_heads,
                                              k_scale, v_scale, config=tiles, options=kernels)

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        """One row of a merged [gate; up] layer: the FP8 GEMV with SiLU-and-mul in its epilogue (None:
        not fused at this row count)."""
        from kvloom.kernels.quant import dispatch

        if not (self.w8a8 and x.is_cuda and x.numel() == x.shape[-1]):
            return None
        return dispatch.fp8_gemv(x, layer.weight, layer.weight_scale, silu_mul=True, options=self.method.kernels)

    def held_bytes(self, layer: LinearBase, device_type: str) -> int:
        if device_type == "cpu" or self.method.block:  # weight-only: dequantized at load
            return dense_bytes(layer)
        bias = layer.output_size * torch.empty(0, dtype=layer.params_dtype).element_size() if layer.bias is not None else 0
        return layer.output_size * layer.input_size + 4 * layer.output_size + bias  # FP8 weight, a scale per channel

    @torch.no_grad()
    def init_dummy(self, layer: LinearBase, gen: torch.Generator) -> None:
        """Weights of about N(0, 0.02): FP8 values of N(0, 1) times a scale of 0.02."""
        if self.method.source == "online":
            return  # a dense weight: the loader's own random init
        w = torch.randn(layer.weight.shape, generator=gen, device=layer.weight.device)
        layer.weight.copy_(w.clamp(-448, 448).to(FP8_DTYPE))
        for name in ("weight_scale", "weight_scale_inv"):
            if name in layer._parameters:
                getattr(layer, name).fill_(0.02)
        if "input_scale" in layer._parameters:
            layer.input_scale.fill_(0.05)
