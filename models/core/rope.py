"""Rotary position embeddings for drafters that run their own attention (core: a method imports this, not
another method's file).

HF's half-split convention (``rotate_half``), so a drafter's q/k projections stay weight-compatible with the
engines that load its export. A drafter keeps ``inv_freq`` and ``factor`` from ``rope_inv_freq`` (the target's
RoPE settings) and asks ``rope_cos_sin`` for the positions it needs.
"""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig


def rope_inv_freq(tc: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float, dict]:
    """(inverse frequencies [head_dim / 2], attention scaling factor, the RoPE parameters used) for
    ``head_dim`` from the target config (rope_parameters / rope_scaling, else rope_theta)."""
    params = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    params = dict(params)
    if isinstance(params.get("full_attention"), dict):
        # per-layer-type parameters (Gemma-3: {"full_attention": {...}, "sliding_attention": {...}}): a draft
        # layer attends over the whole context, so it takes the full-attention layers' RoPE
        params = dict(params["full_attention"])
        tc = copy.deepcopy(tc)
        tc.rope_parameters = dict(params)
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


def rope_cos_sin(inv_freq: torch.Tensor, factor: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [M, head_dim] in ``dtype`` for float32 positions [M] (on ``positions``' device)."""
    freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d] rotated by cos/sin [T, d] (broadcast over the leading dims)."""
    return x * cos + rotate_half(x) * sin
