"""Tiny quantized checkpoints for tests, packed here from the formats' documented layouts (written
independently of kvloom's unpacking): AutoAWQ GEMM, GPTQ (v1 and gptq_v2) and FP8 (``fp8`` and
compressed-tensors). Each builder also writes the float32 transformers model whose weights are what the
format dequantizes to, the reference kvloom's greedy tokens must equal."""

from __future__ import annotations

import json
from pathlib import Path

import torch

QUANT_COMMON = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=384, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, initializer_range=0.05,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32, rope_theta=10000.0)),
    # q/k/v and gate/up fused in the checkpoint (one quantized tensor each), a sliding window
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, sliding_window=11)),
    # sandwich norms, GeGLU, soft-caps, alternating windows
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
                                                         attn_logit_softcapping=4.0, final_logit_softcapping=5.0)),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: word nibble i holds column AWQ_ORDER_MAP[i] of its 8


def tiny_hf_model(family: str, seed: int = 0):
    import transformers

    cls_name, arch, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**QUANT_COMMON, **extra, architectures=[arch])
    torch.manual_seed(seed)
    return getattr(transformers, arch)(config).eval()


def _linear_items(model):
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            yield name, module


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# --- AWQ -------------------------------------------------------------------------------------------
def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` 4-bit values -> ``[rows, cols // 8]`` int32, AutoAWQ's GEMM order."""
    rows, cols = intweight.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + AWQ_ORDER_MAP[i]].to(torch.int64) << (4 * i)
    return _to_int32(packed)


def awq_quantize(w: torch.Tensor, group: int):
    """Asymmetric 4-bit per group of inputs: (tensors for the checkpoint, the dequantized ``[out, in]`` weight)."""
    out, inp = w.shape
    wt = w.t().reshape(inp // group, group, out)  # [groups, group, out]
    lo, hi = wt.amin(1), wt.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = (-lo / scales.float()).round().clamp(0, 15).long()
    q = (wt / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15).long().reshape(inp, out)
    g = torch.arange(inp) // group
    deq = ((q - zeros[g]).float() * scales.float()[g]).t().contiguous()
    return {"qweight": awq_pack(q), "qzeros": awq_pack(zeros), "scales": scales}, deq


# --- GPTQ ------------------------------------------------------------------------------------------
def gptq_pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, cols]`` -> ``[rows * bits // 32, cols]`` int32: consecutive rows in one word, lowest bits first."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(-1, per, values.shape[1])
    packed = torch.zeros(v.shape[0], values.shape[1], dtype=torch.int64)
    for j in range(per):
        packed |= v[:, j] << (bits * j)
    return _to_int32(packed)


def gptq_pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    return gptq_pack_rows(values.t(), bits).t().contiguous()


def gptq_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, v2: bool, gen,
                  order: torch.Tensor | None = None):
    """GPTQ-style quantization of ``[out, in]``: groups follow ``g_idx`` (under desc_act, the input order
    ``order``, random by default). Returns (checkpoint tensors, the dequantized weight as GPTQ's kernels
    compute it)."""
    out, inp = w.shape
    maxq = 2**bits - 1
    group = inp if group == -1 else group
    if order is None:
        order = torch.randperm(inp, generator=gen) if desc_act else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // group).to(torch.int32)
    groups = -(-inp // group)
    scales = torch.empty(groups, out, dtype=torch.float16)
    zeros = torch.empty(groups, out, dtype=torch.int64)
    for gi in range(groups):
        cols = w[:, g_idx == gi]
        lo, hi = cols.amin(1), cols.amax(1)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo).clamp(min=1e-5) / maxq).half()
        scales[gi] = s
        zeros[gi] = torch.full_like(lo, (maxq + 1) // 2, dtype=torch.int64) if sym else \
            (-lo / s.float()).round().clamp(0, maxq).long()
    q = (w.t() / scales.float()[g_idx.long()] + zeros[g_idx.long()]).round().clamp(0, maxq).long()  # [in, out]
    stored = zeros if v2 else (zeros - 1) & maxq  # v1 stores zero - 1 (in the format's bits)
    effective = stored if v2 else stored + 1  # and its kernels add the one back, without wrapping
    deq = ((q - effective[g_idx.long()]).float() * scales.float()[g_idx.long()]).t().contiguous()
    tensors = {"qweight": gptq_pack_rows(q, bits), "qzeros": gptq_pack_cols(stored, bits), "scales": scales,
               "g_idx": g_idx}
    return tensors, deq


# --- FP8 -------------------------------------------------------------------------------------------
def fp8_quantize(w: torch.Tensor, strategy: str, block: int | None = None):
    """(checkpoint tensors, dequantized weight) for per-tensor, per-channel or ``block`` x ``block`` scales."""
    if strategy == "block":
        out, inp = w.shape
        blocks = w.reshape(out // block, block, inp // block, block)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * full
    scale = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (scale / 448).clamp(min=1e-12)
    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


# --- writing ---------------------------------------------------------------------------------------
def write_checkpoint(path: Path, family: str, fmt: str, *, seed: int = 0, **settings) -> tuple[Path, Path]:
    """(quantized checkpoint folder, float32 reference folder) for ``fmt`` in awq, gptq, fp8, ct-fp8, dense."""
    from safetensors.torch import save_file

    model = tiny_hf_model(family, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {k: v for k, v in state.items() if not any(f".{n}.weight" in k for n in LINEARS)}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    qc: dict | None = None
    skip = settings.get("modules_to_not_convert", ())
    orders: dict[str, torch.Tensor] = {}  # GPTQ orders inputs by its Hessian: shared by q/k/v, by gate/up
    for name, module in _linear_items(model):
        w = module.weight.detach().float()
        if any(m in name for m in skip):
            tensors[f"{name}.weight"] = w
            continue
        if fmt == "awq":
            t, deq = awq_quantize(w, settings["group_size"])
        elif fmt == "gptq":
            parent, leaf = name.rsplit(".", 1)
            same_input = parent if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else name
            order = None
            if settings["desc_act"]:
                if same_input not in orders or not settings.get("shared_order", True):
                    orders[same_input] = torch.randperm(w.shape[1], generator=gen)
                order = orders[same_input]
            t, deq = gptq_quantize(w, settings["bits"], settings["group_size"], settings["sym"], settings["desc_act"],
                                   settings.get("checkpoint_format") == "gptq_v2", gen, order)
            if module.bias is None and settings.get("zero_biases"):
                t["bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # as GPTQ tools often save
        elif fmt in ("fp8", "ct-fp8"):
            t, deq = fp8_quantize(w, settings["strategy"], settings.get("block"))
            if settings.get("static"):
                t["input_scale"] = torch.tensor(settings["static"] * (1 + 0.1 * LINEARS.index(name.rsplit(".", 1)[-1])))
        else:
            raise ValueError(fmt)
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
        module.weight.data.copy_(deq)
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": settings["group_size"], "zero_point": True,
              "version": "gemm", "modules_to_not_convert": list(skip) or None}
    elif fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": settings["bits"], "group_size": settings["group_size"],
              "desc_act": settings["desc_act"], "sym": settings["sym"],
              "checkpoint_format": settings.get("checkpoint_format", "gptq")}
    elif fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static" if settings.get("static") else "dynamic"}
        if settings.get("block"):
            qc["weight_block_size"] = [settings["block"]] * 2
    elif fmt == "ct-fp8":
        acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
                if settings.get("static") else
                {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
                  "num_bits": 8, "type": "float", "strategy": settings["strategy"], "dynamic": False,
                  "symmetric": True}}}}
    quant, ref = path / f"{family}-{fmt}", path / f"{family}-{fmt}-reference"
    quant.mkdir(parents=True)
    config = model.config.to_dict()
    config["quantization_config"] = qc
    (quant / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(quant / "model.safetensors"))
    model.save_pretrained(str(ref), safe_serialization=True)
    return quant, ref
