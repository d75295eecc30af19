"""Quantized MoE experts: each format's ``moe_method`` (FP8 checkpoints and ``--quantization fp8``, gpt-oss
MXFP4, AWQ and GPTQ int4). The checkpoint's per-expert tensors are loaded into stacked parameters in the
checkpoint's own layout, then turned once into ``kvloom.kernels.moe`` expert weights: kept packed for the
Triton kernel on CUDA, dequantized at load on the CPU (dense matmuls beat unpacking there)."""

from __future__ import annotations

import torch

from kvloom.core.config import ConfigError
from kvloom.kernels import moe as moe_kernels
from kvloom.kernels.moe.weights import FP8Experts, IntExperts, MXFP4Experts
from kvloom.kernels.quant_reference import FP8_DTYPE


class QuantizedMoEMethod:
    """Stacked parameters ``w13_<leaf>`` / ``w2_<leaf>`` per checkpoint tensor kind (``layout``), each filled
    per expert: gate and up halves side by side along ``out_dim`` of each expert's tensor (``None``: the
    whole stacked tensor, gate and up already together). Under tensor parallelism a rank keeps its slice of
    the intermediate dim, ``tp_dim`` of each expert's tensor (``None``: replicated). ``ignored``: checkpoint
    leaves not needed."""

    name = "?"
    ignored: tuple[str, ...] = ()

    def __init__(self, method, prefix: str) -> None:
        self.method, self.prefix = method, prefix
        self.w13 = self.w2 = None  # the kernels' expert weights, on CUDA

    # --- what a format states ----------------------------------------------------------------------
    def layout(self, layer) -> list[tuple[str, tuple[int, ...], torch.dtype, int | None, int | None]]:
        """``(leaf, this rank's per-expert shape, dtype, out_dim, tp_dim)`` for every parameter (leaf with its
        w13_/w2_ prefix)."""
        raise NotImplementedError

    def experts(self, layer, prefix: str):
        """The ``ExpertWeights`` of projection ``prefix`` (``w13`` or ``w2``) from the loaded parameters."""
        raise NotImplementedError

    # --- the MoE method ----------------------------------------------------------------------------
    def create_weights(self, layer) -> None:
        e = layer.num_experts
        for leaf, shape, dtype, out_dim, tp_dim in self.layout(layer):
            param = layer.add_param(leaf, torch.empty(e, *shape, dtype=dtype))
            param.weight_loader = self._loader(layer, leaf, out_dim, tp_dim)
        if layer.has_bias:  # loaded (and split over ranks) by the layer's own loader
            layer.add_param("w13_bias", torch.empty(e, 2 * layer.local_intermediate, dtype=layer.params_dtype))
            layer.add_param("w2_bias", torch.empty(e, layer.hidden_size, dtype=layer.params_dtype))

    def _loader(self, layer, leaf: str, out_dim: int | None, tp_dim: int | None):
        @torch.no_grad()
        def load(param, tensor: torch.Tensor, shard_id) -> None:
            expert, projection = shard_id
            if tp_dim is not None and layer.tp.size > 1:  # this rank's slice of the intermediate dim
                dim, tp = tp_dim + (1 if expert is None else 0), layer.tp
                if tensor.dim() <= dim or tensor.shape[dim] % tp.size:
                    raise ValueError(f"{layer.prefix}.{leaf} shard {shard_id!r}: checkpoint shape "
                                     f"{tuple(tensor.shape)} does not split {tp.size} ways along dim {dim}")
                n = tensor.shape[dim] // tp.size
                tensor = tensor.narrow(dim, tp.rank * n, n)
            if out_dim is None:  # the whole stacked tensor: set once, with the gate shard
                if projection != "up":
                    self._copy(layer, leaf, param.data if expert is None else param.data[expert], tensor, shard_id)
                return
            dst = param.data if expert is None else param.data[expert]
            if projection in ("gate", "up"):
                dim = out_dim + (1 if expert is None else 0)
                half = dst.shape[dim] // 2
                dst = dst.narrow(dim, 0 if projection == "gate" else half, half)
            self._copy(layer, leaf, dst, tensor, shard_id)
        return load

    @staticmethod
    def _copy(layer, leaf: str, dst: torch.Tensor, tensor: torch.Tensor, shard_id) -> None:
        if tensor.numel() != dst.numel():
            raise ValueError(f"{layer.prefix}.{leaf} shard {shard_id!r}: checkpoint shape {tuple(tensor.shape)} does "
                             f"not fit model shape {tuple(dst.shape)}")
        dst.copy_(tensor.reshape(dst.shape))

    def process_weights_after_loading(self, layer) -> None:
        w13, w2 = self.experts(layer, "w13"), self.experts(layer, "w2")
        for leaf, *_ in self.layout(layer):
            delattr(layer, leaf)
        if self.keep_packed(w13.device):
            self._keep_packed(layer, w13, w2)
            return
        layer.add_param("w13_weight", w13.dequantize(layer.params_dtype))
        layer.add_param("w2_weight", w2.dequantize(layer.params_dtype))
        self.method.kernel = (f"dequantized at load to {str(layer.params_dtype).removeprefix('torch.')} "
                              f"({w13.device.type}: dense matmuls)")

    def keep_packed(self, device: torch.device) -> bool:
        """Packed for the Triton kernel on CUDA; dequantized once at load elsewhere (the format's
        ``keep_packed``, where set, overrides: tests run the packed path on the CPU)."""
        forced = getattr(self.method, "keep_packed", None)
        return device.type == "cuda" if forced is None else forced

    def _keep_packed(self, layer, w13, w2) -> None:
        """The kernel's expert weights, their tensors also the layer's buffers (its device, its memory)."""
        self.w13, self.w2 = w13, w2
        for prefix, weights in (("w13", w13), ("w2", w2)):
            for name, t in weights.tensors().items():
                layer.register_buffer(f"{prefix}_packed_{name}", t, persistent=False)
        self.method.kernel = moe_kernels.kernel_name(w13.device)

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w13 = self.w13 if self.w13 is not None else layer.w13_weight
        w2 = self.w2 if self.w2 is not None else layer.w2_weight
        return moe_kernels.fused_experts(
            x, w13, w2, topk_weights, topk_ids, activation=layer.activation,
            w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
            swiglu_alpha=layer.swiglu_alpha, swiglu_limit=layer.swiglu_limit)

    def held_bytes(self, layer, device_type: str) -> int:
        """Dense experts on the CPU (dequantized at load); elsewhere the packed tensors the kernel reads."""
        biases = sum(p.numel() * p.element_size() for n, p in layer._parameters.items() if n.endswith("_bias"))
        if device_type == "cpu":
            size = torch.empty(0, dtype=layer.params_dtype).element_size()
            e, i, h = layer.num_experts, layer.local_intermediate, layer.hidden_size
            return 3 * e * i * h * size + biases
        return self.packed_bytes(layer) + biases

    def packed_bytes(self, layer) -> int:
        return sum(p.numel() * p.element_size() for n, p in layer._parameters.items() if not n.endswith("_bias"))

    @torch.no_grad()
    def init_dummy(self, layer, gen: torch.Generator) -> None:
        """Random packed words and zero points; fp16 scales that give weights of about N(0, 0.02) (the loader
        fills float weights and biases itself)."""
        for leaf, *_ in self.layout(layer):
            p = getattr(layer, leaf)
            if p.dtype == torch.int32 and leaf.endswith("g_idx"):
                k = p.shape[-1]
                groups = self.method.group_size if self.method.group_size > 0 else k
                order = torch.randperm(k, generator=gen, device=p.device)
                p.copy_((order // groups).to(torch.int32).expand_as(p))
            elif p.dtype == torch.int32:
                p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, device=p.device, dtype=torch.int64))
            elif p.dtype == torch.float16:
                p.uniform_(0.002, 0.006, generator=gen)


def _pair(t: torch.Tensor, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's ``(gate, up)`` halves of a stacked ``[E, ...]`` w13 tensor split along ``dim`` (per expert)."""
    return [tuple(t[e].chunk(2, dim)) for e in range(t.shape[0])]


# --- FP8 ------------------------------------------------------------------------------------------
class FP8MoEMethod(QuantizedMoEMethod):
    """FP8 checkpoints' experts (per-tensor or per-channel ``weight_scale``, or block ``weight_scale_inv``), or
    ``--quantization fp8`` of dense experts (per output channel, quantized at load)."""

    name = "fp8"
    ignored = ("w13_input_scale", "w2_input_scale")  # weight-only on the CPU; the kernel quantizes rows itself

    def create_weights(self, layer) -> None:
        if self.method.source == "compressed-tensors":
            raise ConfigError(f"{layer.prefix}: compressed-tensors FP8 experts are not supported yet; supported: "
                              "quant_method 'fp8' checkpoints and quantization='fp8' of a dense checkpoint")
        if self.method.source == "online":  # dense weights loaded as the dense method loads them
            from kvloom.core.model.moe import UnquantizedMoEMethod

            UnquantizedMoEMethod().create_weights(layer)
            return
        super().create_weights(layer)

    def layout(self, layer):
        i, h, block = layer.local_intermediate, layer.hidden_size, self.method.block
        out = [("w13_weight", (2 * i, h), FP8_DTYPE, 0, 0), ("w2_weight", (h, i), FP8_DTYPE, 0, 1)]
        if block:
            bo, bi = block
            if layer.tp.size > 1 and (i % bo or i % bi):
                raise ConfigError(f"{layer.prefix}: each rank's {i} of the experts' intermediate size does not "
                                  f"split into whole quantization_config.weight_block_size={list(block)} blocks "
                                  f"(tensor_parallel_size={layer.tp.size})")
            out += [("w13_weight_scale_inv", (2 * -(-i // bo), -(-h // bi)), torch.float32, 0, 0),
                    ("w2_weight_scale_inv", (-(-h // bo), -(-i // bi)), torch.float32, 0, 1)]
        else:  # one value per expert's tensor, or one per output channel: held per channel
            out += [("w13_weight_scale", (2 * i,), torch.float32, 0, 0), ("w2_weight_scale", (h,), torch.float32, 0, None)]
        return out

    def _loader(self, layer, leaf, out_dim, tp_dim):
        load = super()._loader(layer, leaf, out_dim, tp_dim)
        if not leaf.endswith("_weight_scale"):
            return load

        def load_scale(param, tensor, shard_id):  # a per-tensor scale fills each of its rows
            rows = layer.intermediate_size if shard_id[1] in ("gate", "up") else layer.hidden_size
            load(param, tensor.float().reshape(-1).expand(rows) if tensor.numel() == 1 else tensor, shard_id)
        return load_scale

    def experts(self, layer, prefix):
        if self.method.block:
            return FP8Experts(getattr(layer, f"{prefix}_weight").data, getattr(layer, f"{prefix}_weight_scale_inv").data,
                              self.method.block, 2 if prefix == "w13" else 1)
        return FP8Experts(getattr(layer, f"{prefix}_weight").data, getattr(layer, f"{prefix}_weight_scale").data)

    @torch.no_grad()
    def init_dummy(self, layer, gen: torch.Generator) -> None:
        """FP8 values of N(0, 1) times scales of 0.02."""
        if self.method.source == "online":
            return  # dense weights: the loader's own random init
        for prefix in ("w13", "w2"):
            w = getattr(layer, f"{prefix}_weight")
            w.copy_(torch.randn(w.shape, generator=gen, device=w.device).clamp(-448, 448).to(FP8_DTYPE))
            scale = getattr(layer, f"{prefix}_weight_scale_inv", None)
            (scale if scale is not None else getattr(layer, f"{prefix}_weight_scale")).fill_(0.02)

    def process_weights_after_loading(self, layer) -> None:
        if self.method.source != "online":
            return super().process_weights_after_loading(layer)
        w13, w2 = FP8Experts.quantize(layer.w13_weight.data), FP8Experts.quantize(layer.w2_weight.data)
        if self.keep_packed(w13.device):
            delattr(layer, "w13_weight")
            delattr(layer, "w2_weight")
            self._keep_packed(layer, w13, w2)
            return
        layer.w13_weight.data.copy_(w13.dequantize(layer.params_dtype))  # weight-only: the FP8 rounding kept
        layer.w2_weight.data.copy_(w2.dequantize(layer.params_dtype))

    def packed_bytes(self, layer) -> int:
        if self.method.source != "online":
            return super().packed_bytes(layer)
        e, i, h = layer.num_experts, layer.local_intermediate, layer.hidden_size
        return 3 * e * i * h + 4 * e * (2 * i + h)  # e4m3 weights, a float32 scale per output channel

    def held_bytes(self, layer, device_type: str) -> int:
        if self.method.source == "online" and device_type == "cpu":
            return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))
        return super().held_bytes(layer, device_type)


# --- MXFP4 ----------------------------------------------------------------------------------------
class MXFP4MoEMethod(QuantizedMoEMethod):
    """gpt-oss's MXFP4 experts: the stacked ``gate_up_proj_blocks/_scales`` (gate and up rows interleaved)
    and ``down_proj_blocks/_scales``; biases dense (``gate_up_proj_bias`` de-interleaved by the family)."""

    name = "mxfp4"

    def layout(self, layer):
        i, h = layer.local_intermediate, layer.hidden_size
        for size in (i, h):
            if size % 32:
                raise ConfigError(f"{layer.prefix}: {size} inputs do not split into MXFP4 blocks of 32"
                                  + (f" (tensor_parallel_size={layer.tp.size})" if layer.tp.size > 1 else ""))
        # a rank's gate/up rows are a contiguous run of the interleaved rows
        return [("w13_blocks", (2 * i, h // 32, 16), torch.uint8, None, 0),
                ("w13_scales", (2 * i, h // 32), torch.uint8, None, 0),
                ("w2_blocks", (h, i // 32, 16), torch.uint8, None, 1), ("w2_scales", (h, i // 32), torch.uint8, None, 1)]

    def experts(self, layer, prefix):
        return MXFP4Experts.from_checkpoint(getattr(layer, f"{prefix}_blocks").data,
                                            getattr(layer, f"{prefix}_scales").data,
                                            interleaved_gate_up=prefix == "w13")

    @torch.no_grad()
    def init_dummy(self, layer, gen: torch.Generator) -> None:
        """Random e2m1 nibbles and scales of 2 ** -6: weights of about N(0, 0.03)."""
        for prefix in ("w13", "w2"):
            b = getattr(layer, f"{prefix}_blocks")
            b.copy_(torch.randint(0, 256, b.shape, generator=gen, device=b.device, dtype=torch.int32))
            getattr(layer, f"{prefix}_scales").fill_(121)


# --- AWQ / GPTQ -----------------------------------------------------------------------------------
class AWQMoEMethod(QuantizedMoEMethod):
    """AutoAWQ GEMM experts: each expert's ``qweight [K, N / 8]``, ``qzeros [K / group, N / 8]``, ``scales``."""

    name = "awq"

    def layout(self, layer):
        g, i, h = self.method.group_size, layer.local_intermediate, layer.hidden_size
        shapes = []
        for prefix, k, n, tp_dim in (("w13", h, 2 * i, 1), ("w2", i, h, 0)):
            if k % g or n % 16:
                raise ConfigError(f"{layer.prefix}: {prefix} of {k} inputs and {n} outputs (a rank's, of "
                                  f"tensor_parallel_size={layer.tp.size}) does not fit AWQ groups of "
                                  f"quantization_config.group_size={g} and its packing of 8 outputs a word")
            shapes += [(f"{prefix}_qweight", (k, n // 8), torch.int32, 1, tp_dim),
                       (f"{prefix}_qzeros", (k // g, n // 8), torch.int32, 1, tp_dim),
                       (f"{prefix}_scales", (k // g, n), torch.float16, 1, tp_dim)]
        return shapes

    def experts(self, layer, prefix):
        q, z, s = (getattr(layer, f"{prefix}_{n}").data for n in ("qweight", "qzeros", "scales"))
        if prefix == "w13":
            return IntExperts.from_awq(_pair(q, 1), _pair(z, 1), _pair(s, 1), self.method.group_size)
        return IntExperts.from_awq(list(q), list(z), list(s), self.method.group_size)

    def packed_bytes(self, layer) -> int:
        zeros = sum(p.numel() for n, p in layer._parameters.items() if n.endswith("qzeros"))
        return super().packed_bytes(layer) + zeros * 4  # zero points unpacked to a uint8 each (8 a word)


class GPTQMoEMethod(QuantizedMoEMethod):
    """GPTQ experts: each expert's ``qweight [K * bits / 32, N]``, ``qzeros``, ``scales`` and, under desc_act,
    ``g_idx [K]`` (gate and up may each have their own)."""

    name = "gptq"

    def __init__(self, method, prefix: str) -> None:
        super().__init__(method, prefix)
        self.ignored = () if method.desc_act else ("w13_g_idx", "w2_g_idx")

    def layout(self, layer):
        m, i, h = self.method, layer.local_intermediate, layer.hidden_size
        bits, g, tp = m.bits, m.group_size, layer.tp.size
        per_word = 32 // bits
        shapes = []
        for prefix, k, n in (("w13", h, 2 * i), ("w2", i, h)):
            if k % per_word or n % (2 * per_word) or (g != -1 and not m.desc_act and k % g):
                raise ConfigError(f"{layer.prefix}: {prefix} of {k} inputs and {n} outputs (a rank's, of "
                                  f"tensor_parallel_size={tp}) does not fit {bits}-bit GPTQ packing in groups of "
                                  f"quantization_config.group_size={g}")
            # w2's groups: a rank's run of inputs, except under desc_act (every group's row kept; g_idx picks)
            whole = k * (tp if prefix == "w2" and m.desc_act else 1)
            groups = 1 if g == -1 else -(-whole // g)
            # w13 splits its outputs; w2 its packed input rows, and its groups' rows unless they are shared
            weight_dim, group_dim = (1, 1) if prefix == "w13" else (0, None if m.desc_act or g == -1 else 0)
            shapes += [(f"{prefix}_qweight", (k // per_word, n), torch.int32, 1, weight_dim),
                       (f"{prefix}_qzeros", (groups, n // per_word), torch.int32, 1, group_dim),
                       (f"{prefix}_scales", (groups, n), torch.float16, 1, group_dim)]
            if m.desc_act:  # each expert's g_idx [K]: w13's inputs whole, w2's a rank's slice
                shapes.append((f"{prefix}_g_idx", (2 if prefix == "w13" else 1, k), torch.int32, 0,
                               None if prefix == "w13" else 0))
        return shapes

    def experts(self, layer, prefix):
        m = self.method
        q, z, s = (getattr(layer, f"{prefix}_{n}").data for n in ("qweight", "qzeros", "scales"))
        g_idx = getattr(layer, f"{prefix}_g_idx").data if m.desc_act else None
        if prefix == "w13":
            q, z, s = _pair(q, 1), _pair(z, 1), _pair(s, 1)
            g_idx = None if g_idx is None else [tuple(g_idx[e]) for e in range(g_idx.shape[0])]
        else:
            q, z, s = list(q), list(z), list(s)
            g_idx = None if g_idx is None else [g_idx[e, 0] for e in range(g_idx.shape[0])]
        return IntExperts.from_gptq(q, z, s, m.bits, m.group_size, g_idx, m.checkpoint_format == "gptq")

    def packed_bytes(self, layer) -> int:
        per_word = 32 // self.method.bits
        zeros = sum(p.numel() for n, p in layer._parameters.items() if n.endswith("qzeros"))
        return super().packed_bytes(layer) + zeros * (per_word - 4)


def moe_method(method, prefix: str):
    """The experts' method of quantization ``method`` (dense where ``modules_to_not_convert`` names them)."""
    from kvloom.core.model.moe import UnquantizedMoEMethod

    if method._not_converted(prefix):
        return UnquantizedMoEMethod()
    return {"fp8": FP8MoEMethod, "mxfp4": MXFP4MoEMethod, "awq": AWQMoEMethod, "gptq": GPTQMoEMethod}[method.name](
        method, prefix)


__all__ = ["AWQMoEMethod", "FP8MoEMethod", "GPTQMoEMethod", "MXFP4MoEMethod", "QuantizedMoEMethod", "moe_method"]
