"""Sliding-window targets (Mistral, Gemma-2/3, gpt-oss) in the decoding engine.

Two things differ from full-attention targets:

* **The cache.** transformers' ``DynamicCache(config=...)`` gives sliding layers a ``DynamicSlidingWindowLayer``
  that keeps only the last ``window`` entries and cannot ``crop`` — but speculative decoding crops rejected drafts
  every round (``commit_kv``, the cost model). ``full_cache`` keeps every entry on every layer instead; the
  window is then applied by the attention mask, exactly as the target's own no-cache forward does. The cost is
  memory on the sliding layers (the full context instead of ``window`` entries), never a different token.
* **Custom 4D masks** (tree verification, batched rows) bypass the model's own mask builder, so the window must
  be written into them: ``apply_window`` hides every key more than ``window - 1`` positions behind its query
  (transformers' ``sliding_window_overlay``: visible iff q - k < window) and hands per-layer-type masks to
  models with ``layer_types`` (``{"full_attention": m, "sliding_attention": m_windowed}``, which Gemma-2/3 and
  gpt-oss accept) or the windowed mask alone to models whose every layer slides (Mistral).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PretrainedConfig

from models.core.hf_compat import sliding_window_of


def full_cache() -> DynamicCache:
    """A cache whose every layer keeps every entry (croppable), whatever the target's attention types."""
    return DynamicCache()


def apply_window(config: PretrainedConfig, mask: Tensor | None, q_pos: Tensor, k_pos: Tensor) -> Tensor | dict | None:
    """The attention mask(s) to pass for a custom additive ``mask`` [B, 1, Q, K] whose queries sit at RoPE
    positions ``q_pos`` [B, Q] and keys at ``k_pos`` [B, K] (positions, not cache indices: tree nodes share
    them). Unchanged for full-attention targets."""
    window = sliding_window_of(config)
    if window is None or mask is None:
        return mask
    far = (q_pos[:, :, None] - k_pos[:, None, :]) >= window  # [B, Q, K]
    windowed = mask.masked_fill(far[:, None].to(mask.device), torch.finfo(mask.dtype).min)
    types = getattr(config, "layer_types", None)
    if types is None:
        return windowed  # every layer slides (Mistral-style config)
    masks = {t: mask for t in set(types)}
    masks["sliding_attention"] = windowed
    return masks


def batch_key_positions(lens: Tensor, start: int, width: int) -> Tensor:
    """[A, start+width] RoPE positions of the batched cache's keys (eval/decode/ladder.py): row a's valid prefix
    entries sit at their index, its ``width`` new entries (written at ``start``) at lens[a] + i. Entries past a
    row's length are padding, hidden by the mask whatever their position."""
    idx = torch.arange(start + width, device=lens.device)[None].expand(lens.shape[0], -1)
    return torch.where(idx >= start, lens[:, None] + idx - start, idx)
