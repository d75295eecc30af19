"""Model loading: configs and weights from Hugging Face folders (safetensors, sharded or not), from
GGUF files (dequantized at load), or dummy weights of any config for benchmarks. Every path hands the
tensors to the layers' weight loaders, then runs each layer's ``process_weights_after_loading``
(repacking or dequantizing a quantized format, then packing dense weights for oneDNN on the CPU)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from kvloom.core.model.attention.base import AttentionBackend
from kvloom.core.model.cpu_packing import pack_layer, pack_tied_output
from kvloom.core.model.families import architecture_of, decoder_config, model_class
from kvloom.core.model.families.decoder import DecoderLM
from kvloom.core.model.linear import LinearBase
from kvloom.core.model.moe import FusedMoE
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions

logger = logging.getLogger("kvloom")

# GGUF architecture -> (transformers config class name, HF architecture)
_GGUF_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma's norms on both sides of attention and MLP; llama.cpp stores each norm's 1 + w (taken back at load).
_GGUF_GEMMA_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                           "post_attention_norm": "post_attention_layernorm",
                           "post_ffw_norm": "post_feedforward_layernorm"}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


# --- configs ---------------------------------------------------------------------------------------
def load_hf_config(path: Path, overrides: dict | None = None):
    """The model's transformers config (from config.json or GGUF metadata), with ``overrides`` applied."""
    if is_gguf(path):
        config = _gguf_config(path)
    else:
        from transformers import AutoConfig

        file = path / "config.json"
        listed = json.loads(file.read_text()).get("architectures") if file.is_file() else None
        if listed:  # fails naming it before transformers reads a config whose model type it may not know
            architecture_of(SimpleNamespace(architectures=listed))
        config = decoder_config(AutoConfig.from_pretrained(str(path)))
        _attach_quantize_config(path, config)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    check_architecture(config)
    return config


def _attach_quantize_config(path: Path, config) -> None:
    """AutoGPTQ/AutoAWQ checkpoints may keep their quantization settings in a file of their own."""
    if getattr(config, "quantization_config", None) is not None:
        return
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        file = path / name
        if file.is_file():
            qc = json.loads(file.read_text())
            qc.setdefault("quant_method", method)
            config.quantization_config = qc
            return


def check_architecture(config) -> str:
    """The config's architecture, or ValueError naming it and the supported ones (``families``' registry)."""
    return architecture_of(config)


def _gguf_config(path: Path):
    import transformers

    from kvloom.core.model.gguf_file import GGUFArray, GGUFFile

    reader = GGUFFile(path)
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}
    arch = fields["general.architecture"]
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHS)}")
    cls_name, hf_arch = _GGUF_ARCHS[arch]
    a = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    heads = a("attention.head_count")
    hidden = a("embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = a("vocab_size") or (tokens.count if isinstance(tokens, GGUFArray) else len(tokens))
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"), num_attention_heads=heads,
        num_key_value_heads=a("attention.head_count_kv", heads),
        max_position_embeddings=a("context_length", 4096),
        rms_norm_eps=a("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=a("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in names, architectures=[hf_arch],
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"), eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )
    head_dim = a("attention.key_length")
    if head_dim:
        kwargs["head_dim"] = head_dim
    if a("attention.sliding_window"):  # Gemma: the window of its local layers (the layer pattern is the default)
        kwargs["sliding_window"] = a("attention.sliding_window")
    config = getattr(transformers, cls_name)(**kwargs)
    config.gguf_architecture = arch
    # linear weights' types and [rows, cols]: what ``engine plan`` counts of the ones kept at 4 bits
    config.gguf_tensor_types = {t.name: (t.tensor_type.name, int(t.shape[1]), int(t.shape[0]))
                                for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    # and the output projection's (a Q8_0 one is kept at 8 bits too)
    out = next((t for t in reader.tensors if t.name == ("output.weight" if "output.weight" in names else
                                                         "token_embd.weight")), None)
    if out is not None and len(out.shape) == 2:
        config.gguf_output_type = (out.tensor_type.name, int(out.shape[1]), int(out.shape[0]))
    return config


# --- weights ---------------------------------------------------------------------------------------
def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {str(path)!r}")
    for fname in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _reverse_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in q/k weights (its converter permutes them)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


DEQUANTIZED = "dequantized"  # the key of ``iter_gguf``'s ``int4`` naming what it did not keep at 4 bits
Q8_OUTPUT = "q8 output"  # the key of its output projection's 8-bit codes and scales (a Q8_0 table)


def iter_gguf(path: Path, config, int4: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under Hugging Face names, dequantized to float32. With ``int4`` (a dict), the 4-bit
    codes of its Q4_0/Q4_1/Q4_K linear weights are put there too, by name (``attach_int4`` keeps them packed), and
    a Q8_0 output projection's 8-bit codes under ``Q8_OUTPUT`` where the AMX kernel can take them."""
    from kvloom.core.model.gguf_file import GGUFFile
    from kvloom.kernels import cpu_int4_amx
    from kvloom.kernels.cpu_int4 import GGUF_INT4_TYPES, gguf_int4_codes, gguf_q8_codes

    reader = GGUFFile(path)
    arch = getattr(config, "gguf_architecture", "llama")
    permute = arch in ("llama", "mistral")
    gemma = arch in ("gemma2", "gemma3")
    layer_names = _GGUF_GEMMA_LAYER_NAMES if gemma else _GGUF_LAYER_NAMES
    # the output projection: its 8-bit codes are kept too (``Q8_OUTPUT``), for the AMX kernel
    output = "model.embed_tokens.weight" if getattr(config, "tie_word_embeddings", False) else "lm_head.weight"
    for t in tqdm(reader.tensors, desc="Loading GGUF (dequantizing)", unit="tensor"):
        stem, _, kind = t.name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk":
            if parts[2] not in layer_names:
                raise ValueError(f"GGUF tensor {t.name!r} ({arch}) has no place in the model")
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
        elif stem in _GGUF_GLOBAL_NAMES:
            name = f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        tensor = dequantize_tensor(t)
        if gemma and stem.endswith("norm"):
            tensor -= 1
        heads = (config.num_attention_heads if stem.endswith("attn_q") else config.num_key_value_heads
                 if stem.endswith("attn_k") else None) if permute else None
        if heads is not None:
            tensor = _reverse_llama_permute(tensor, heads)
        qtype = t.tensor_type.name
        if int4 is not None and qtype in GGUF_INT4_TYPES and parts[0] == "blk" and tensor.dim() == 2:
            codes = [torch.from_numpy(a) for a in gguf_int4_codes(t.data, qtype, *tensor.shape)]
            if heads is not None:  # rows move with their codes, scales and zeros
                codes = [_reverse_llama_permute(c, heads) for c in codes]
            int4[name] = (qtype, *codes)
        elif int4 is not None and qtype not in ("F32", "F16", "BF16"):
            int4.setdefault(DEQUANTIZED, set()).add(f"{qtype} ({stem.rpartition('.')[2]})")
        if (int4 is not None and qtype == "Q8_0" and name == output and tensor.dim() == 2
                and cpu_int4_amx.q8_supports(*tensor.shape) and cpu_int4_amx.available()):
            int4[Q8_OUTPUT] = tuple(torch.from_numpy(a) for a in gguf_q8_codes(t.data, *tensor.shape))
        reader.release(t)
        yield name, tensor
        del tensor  # not held while the next one is dequantized


DEQUANTIZE_CHUNK_BYTES = 16 << 20  # float32 output per call of gguf-py's dequantize


def dequantize_tensor(t) -> torch.Tensor:
    """A GGUF tensor (``gguf_file.GGUFTensor``) as a new float32 tensor, dequantized a few rows at a time
    straight into it: gguf-py's ``dequantize`` of a whole tensor holds two float32 copies of it at once
    (1.3 GB for a 262k-token embedding table), here the temporaries are one chunk's. Same values: GGUF
    blocks never span rows."""
    from gguf.quants import dequantize, quant_shape_from_byte_shape

    data = t.data
    shape = quant_shape_from_byte_shape(data.shape, t.tensor_type) if data.dtype == np.uint8 else data.shape
    out = torch.empty(shape, dtype=torch.float32)
    if out.numel() == 0:
        return out
    rows, dst = data.reshape(-1, data.shape[-1]), out.numpy().reshape(-1, shape[-1])
    step = max(1, DEQUANTIZE_CHUNK_BYTES // (4 * shape[-1]))
    for start in range(0, rows.shape[0], step):
        dst[start:start + step] = dequantize(rows[start:start + step], t.tensor_type)
    return out


# --- fp8 KV-cache scales ----------------------------------------------------------------------------
# Where FP8 checkpoints keep the per-tensor scales of the K and V they were calibrated for: vLLM and
# compressed-tensors (llm-compressor's kv_cache_scheme) as ``self_attn.k_scale``/``v_scale``, NVIDIA
# ModelOpt as ``self_attn.k_proj.k_scale``/``v_proj.v_scale``, AutoFP8 as ``k_proj.output_scale``/
# ``v_proj.output_scale``, older vLLM checkpoints as one ``self_attn.kv_scale`` for both.
_KV_SCALE = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:(k_proj|v_proj)\.)?"
                       r"(k_scale|v_scale|kv_scale|output_scale|q_scale|prob_scale)$")
_KV_SCALE_TARGET = {(None, "k_scale"): "k", (None, "v_scale"): "v", (None, "kv_scale"): "kv",
                    ("k_proj", "k_scale"): "k", ("v_proj", "v_scale"): "v",
                    ("k_proj", "output_scale"): "k", ("v_proj", "output_scale"): "v",
                    (None, "q_scale"): None, (None, "prob_scale"): None}  # FP8 attention math: not used


class KVCacheScales:
    """The checkpoint's fp8 KV-cache scales, taken out of the weight stream (they belong to no linear
    layer) and set on each attention layer after loading; an fp8 cache then stores ``x / scale``
    (``kvloom.kernels.reference.quantize_kv``) instead of assuming 1.0. Other caches do not use them."""

    def __init__(self) -> None:
        self.scales: dict[tuple[int, str], float] = {}
        self.unused: list[str] = []

    def split(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` without the KV-cache scales, which are kept here."""
        for name, tensor in weights:
            m = _KV_SCALE.match(name)
            if m is None or (m.group(2), m.group(3)) not in _KV_SCALE_TARGET:
                yield name, tensor
                continue
            target = _KV_SCALE_TARGET[(m.group(2), m.group(3))]
            if target is None:
                self.unused.append(name)
                continue
            if tensor.numel() != 1:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; supported: one "
                                 "per-tensor KV-cache scale (per-head or per-channel KV scales are not supported)")
            value = float(tensor.float().reshape(()))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"checkpoint tensor {name!r} is {value}; a KV-cache scale must be positive and finite")
            for which in ("k", "v") if target == "kv" else (target,):
                self.scales[(int(m.group(1)), which)] = value

    def apply(self, model: DecoderLM) -> None:
        """Set each attention layer's ``k_scale``/``v_scale`` from the checkpoint (1.0 where it has none)."""
        if self.unused:
            logger.info("Checkpoint tensors not used (FP8 attention math; kvloom quantizes only the KV cache): "
                        "%s%s", ", ".join(self.unused[:3]), " ..." if len(self.unused) > 3 else "")
        if not self.scales:
            return
        layers = len(model.layers)
        for (index, which), value in self.scales.items():
            if index >= layers:
                raise ValueError(f"checkpoint has a KV-cache {which}_scale for layer {index}; the model has {layers} layers")
            setattr(model.layers[index].self_attn, f"{which}_scale", value)
        ks = [self.scales[(i, "k")] for i in range(layers) if (i, "k") in self.scales]
        vs = [self.scales[(i, "v")] for i in range(layers) if (i, "v") in self.scales]
        logger.info("KV-cache scales from the checkpoint (used by an fp8 cache): k_scale %s, v_scale %s",
                    _span(ks, layers), _span(vs, layers))


def _span(values: list[float], layers: int) -> str:
    if not values:
        return "none (1.0)"
    return f"{min(values):.4g}..{max(values):.4g} on {len(values)}/{layers} layers"


# --- model -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build parameters in ``dtype`` unless a layer names its own (int32 packed weights, fp16 scales, FP8)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def weight_bytes(hf_config, dtype: torch.dtype, method, device_type: str, tp=None) -> int:
    """The bytes the engine's model holds on ``device_type`` after loading: the same layers, built on the
    meta device, each sized by its format (a format dequantized at load counts as dense). With ``tp`` (a
    ``TensorParallel``), rank ``tp.rank``'s share: its heads, MLP and vocabulary, and the replicated norms."""
    from kvloom.core.model.attention.base import TorchAttentionBackend

    model = make_model(hf_config, TorchAttentionBackend(), dtype, method, tp)
    total = 0
    for module in model.modules():
        if isinstance(module, (LinearBase, FusedMoE)):
            total += module.method.held_bytes(module, device_type)
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def make_model(config, backend: AttentionBackend, dtype: torch.dtype, quantization=None, tp=None,
               kernels: KernelOptions = DEFAULT_KERNELS) -> DecoderLM:
    """The model on the meta device, its layers in the quantization method's format, holding tensor-parallel
    rank ``tp``'s share (``engine plan`` sizes weights from exactly this); ``kernels``: its CUDA kernels' options."""
    with torch.device("meta"), default_dtype(dtype):
        return model_class(config)(config, backend, quantization, tp=tp, kernels=kernels)


def build_model(
    path: Path | None,
    config,
    *,
    load_format: str,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    max_positions: int,
    seed: int = 0,
    quantization=None,
    pack_cpu_weights: bool = True,
    tp=None,
    kernels: KernelOptions = DEFAULT_KERNELS,
    gguf_int4: bool = True,
) -> DecoderLM:
    """Create the model on ``device`` (its linear layers in ``quantization``'s format, or dense), fill its
    weights from ``path`` (or randomly for ``dummy``), then process them once: the format's repacking,
    then on the CPU oneDNN packing of dense weights unless ``pack_cpu_weights`` is false. ``gguf_int4``:
    on the CPU in bfloat16, a GGUF file's (or an AWQ/GPTQ checkpoint's) 4-bit linear weights are also kept packed
    at 4 bits."""
    if hasattr(quantization, "cpu_int4"):  # AWQ/GPTQ: their 4-bit layers' CPU copy follows the same option
        quantization.cpu_int4 = gguf_int4
    model = _materialize(make_model(config, backend, dtype, quantization, tp, kernels), device)
    int4 = None
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        fmt = load_format if load_format != "auto" else ("gguf" if is_gguf(path) else "safetensors")
        int4 = {} if fmt == "gguf" and uses_gguf_int4(device, dtype, quantization, tp, gguf_int4) else None
        weights = iter_gguf(path, config, int4) if fmt == "gguf" else iter_safetensors(path)
        kv_scales = KVCacheScales()
        loaded = model.load_weights(kv_scales.split(weights))
        missing = [_weight_name(n, s) for n, s in model.required_weights() if (n, s) not in loaded]
        if missing:
            raise ValueError(f"checkpoint {str(path)!r} lacks weights for {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")
        kv_scales.apply(model)
        if device.type == "cpu":
            from kvloom.core.worker.cpu_malloc import release_free_memory

            release_free_memory()  # the loader's freed temporaries leave before packing allocates its copies
    model.init_rope(max_positions)
    process_weights_after_loading(model, pack_cpu=pack_cpu_weights)
    if int4 is not None:
        _attach_gguf_int4(model, int4, dtype)
    return model.eval()


def uses_gguf_int4(device: torch.device, dtype: torch.dtype, quantization=None, tp=None, enabled: bool = True) -> bool:
    """Whether a GGUF file's Q4_0/Q4_1/Q4_K weights stay at 4 bits: on the CPU, in bfloat16 (float32 keeps
    transformers' dequantized numerics), one rank, no other format, where torch has the int4 kernel."""
    from kvloom.kernels.cpu_int4 import int4_supported

    return (enabled and device.type == "cpu" and dtype == torch.bfloat16 and quantization is None
            and (tp is None or tp.size == 1) and int4_supported())


def _attach_gguf_int4(model: DecoderLM, int4: dict, dtype: torch.dtype) -> None:
    from kvloom.core.model.cpu_packing import attach_int4, attach_q8_output, q8_max_rows

    others = sorted(int4.pop(DEQUANTIZED, ()))
    output = int4.pop(Q8_OUTPUT, None)
    if output is not None and (held := attach_q8_output(model, *output, dtype)):
        head = model.lm_head if hasattr(model.lm_head, "int8_inputs") else getattr(model.lm_head, "packed", None)
        int8 = bool(getattr(head, "int8_inputs", False))
        logger.info("GGUF Q8_0 output projection kept at 8 bits on the CPU (%.1f MiB, for steps of <= %d sampled "
                    "rows%s) beside its %s copy", held / 2**20, q8_max_rows(int8),
                    ", its inputs rounded to 8 bits a group of 32" if int8 else "", str(dtype).removeprefix("torch."))
    layers, held = attach_int4(model, int4, type(model).stacked, dtype)
    dense = sum(layer.method.dense.held_bytes(layer, "cpu") for layer in model.linear_layers()
                if hasattr(layer.method, "dense"))
    name = str(dtype).removeprefix("torch.")
    int8 = any(getattr(layer.method, "int8_inputs", False) for layer in model.linear_layers())
    logger.info("GGUF %s weights of %d linear layers kept at 4 bits on the CPU (%.1f MiB, for steps of <= %d "
                "rows%s) beside their %s copy (%.1f MiB, for bigger steps); dequantized to %s at load: %s",
                "/".join(sorted({v[0] for v in int4.values()})) or "4-bit", layers, held / 2**20, _int4_max_rows(),
                ", their inputs rounded to 8 bits a group of 32 as llama.cpp does (KVLOOM_CPU_INT8_INPUTS=0: "
                f"{name})" if int8 else "", name, dense / 2**20, name, ", ".join(others) or "none")


def _int4_max_rows() -> int:
    from kvloom.core.model.cpu_packing import int4_max_rows

    return int4_max_rows()


def _materialize(model: DecoderLM, device: torch.device) -> DecoderLM:
    """``to_empty`` makes new Parameter objects off the meta device; keep what the layers set on them
    (``weight_loader``, ``output_dim``, ...)."""
    attrs = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.__dict__.update(attrs[name])
    return model


def _weight_name(name: str, shard) -> str:
    return name if shard is None else f"{name} (shard {shard!r})"


@torch.no_grad()
def process_weights_after_loading(model: DecoderLM, pack_cpu: bool = True) -> None:
    """Each layer's steps after loading: its format's own (repack, dequantize), then oneDNN packing of
    a dense CPU weight; a tied output projection gets a packed copy of the embedding table."""
    model.process_weights_after_loading()
    for layer in model.linear_layers():
        layer.process_weights_after_loading()
        if pack_cpu:
            pack_layer(layer)
    if pack_cpu:
        pack_tied_output(model)


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights with sane scales: norms at one, matrices N(0, 0.02)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        init = getattr(getattr(module, "method", None), "init_dummy", None)
        if init is not None:  # a quantized format knows what random weights look like in it
            init(module, gen)
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.dtype.itemsize == 1 or "scale" in name:
            continue  # set by the format's init_dummy
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
