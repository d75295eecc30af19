"""Rotary tables: a layer type's rope parameters, how many head dims rotate, and the cos/sin cache with each
rope type's scaling (default, linear, llama3, yarn, longrope)."""

from __future__ import annotations

import torch


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope parameters of a layer type (Gemma 3 keeps one set per layer type), with ``rope_theta``."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    if not params:  # transformers 4.x layout
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rotary_dim(config, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading dims of each head rotate (all of them unless the config sets a partial factor)."""
    params = rope_parameters(config, layer_type)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    return int(head_dim * factor)


def rope_cos_sin_cache(config, head_dim: int, max_positions: int, layer_type: str | None = None) -> torch.Tensor:
    """``[max_positions, rotary_dim]`` float32: cos of each frequency, then sin, with the rope type's
    scaling (inverse frequencies come from transformers so they match it exactly). Longrope rotates
    positions below ``original_max_position_embeddings`` with its short factors and the rest with its long
    ones: what transformers does for a prompt within the original length and the tokens generated after it."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = rotary_dim(config, head_dim, layer_type)
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    if rope_type == "default":
        theta = float(params["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        freqs, scaling = positions * inv_freq[None, :], 1.0
    elif rope_type in ("linear", "llama3", "yarn"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
        freqs = positions * inv_freq.float()[None, :]
    elif rope_type == "longrope":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS["longrope"]
        original = int(params.get("original_max_position_embeddings")
                       or getattr(config, "original_max_position_embeddings"))
        short, scaling = init(config, torch.device("cpu"), **kwargs)
        long, _ = init(config, torch.device("cpu"), seq_len=original + 1, **kwargs)
        inv_freq = torch.where(positions < original, short.float()[None, :], long.float()[None, :])
        freqs = positions * inv_freq
    else:
        raise ValueError(f"rope type {rope_type!r} is not supported; "
                         "supported: default, linear, llama3, yarn, longrope")
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
