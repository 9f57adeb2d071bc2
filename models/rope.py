"""Rotary position embeddings for drafters (core): the target's RoPE settings, cos/sin tables, rotation.

A drafter must rotate exactly as its target does (same theta / scaling), or its keys and queries disagree
with the positions the engines feed it; a neox-vs-interleaved mismatch fails silently (vLLM's comment in
``qwen3_dflash.py``). HF Llama/Qwen3 use the neox layout (``rotate_half``), as here.
"""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig


def rope_inv_freq(tc: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float, dict]:
    """(inverse frequencies [head_dim/2], attention scaling factor, the rope parameters used) from the target
    config (``rope_parameters`` or the older ``rope_scaling``/``rope_theta``)."""
    params = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", float(getattr(tc, "rope_theta", 10000.0) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return inv, 1.0, params
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"target rope_type {rope_type!r} not supported; known: default, {sorted(ROPE_INIT_FUNCTIONS)}")
    c = copy.deepcopy(tc)
    c.head_dim = head_dim
    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](c, None)
    return inv.float(), float(factor), params


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, factor: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] → cos, sin [..., T, head_dim] (neox layout: the half-table repeated)."""
    f = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([f, f], dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] with cos/sin broadcastable to it ([B, 1, T, d] or [T, d])."""
    return x * cos + rotate_half(x) * sin
