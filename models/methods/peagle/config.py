"""P-EAGLE's configuration (``draft.config``; the method: the package docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.core.config_checks import int_at_least


@dataclass
class PEagleConfig:
    layer_ids: list[int] | None = None  # 3 ids (HF output_hidden_states index); None → 2, L//2, L−3
    num_layers: int = 1  # draft decoder layers (SpecForge's Qwen3-8B P-EAGLE and AWS's gpt-oss head: 4)
    num_depths: int = 4  # K: tokens drafted per forward (speculators para_depths / speculative_tokens)
    mask_token_id: int | None = None  # None → an embedding row the training data never uses
    draft_vocab_size: int | None = None  # None → the target's whole vocabulary
    intermediate_size: int | None = None
    down_sample_ratio: float = 0.7  # COD r (speculators 0.7, SpecForge 0.8)
    down_sample_ratio_min: float = 0.2
    max_anchors: int = 512  # chains per row at depth 1
    label_path: str = "greedy"  # as DFlash: "greedy" scores depth d only on the target's own greedy path; "data"
    norm_before_residual: bool = False  # layer 0's residual: g (EAGLE-3) or hidden_norm(g)


def default_layer_ids(L: int) -> list[int]:
    return [2, L // 2, L - 3]


def check_config(cfg: Mapping[str, Any], max_len: int | None = None) -> None:
    """Every target-free check of a P-EAGLE ``draft.config`` (SPEC.check_config: train/checks.py runs it on the
    yaml before any model loads; the drafter runs it on its dataclass): one ValueError naming the bad key."""
    for field in ("num_layers", "num_depths", "max_anchors"):  # num_depths: the depth check
        int_at_least(cfg, field, 1)
    hi, lo = cfg.get("down_sample_ratio", 1.0), cfg.get("down_sample_ratio_min", 0.0)
    if not 0 < hi <= 1 or not 0 <= lo <= 1:
        raise ValueError("draft.config.down_sample_ratio must be in (0, 1] and down_sample_ratio_min in [0, 1]")
    if cfg.get("label_path", "greedy") not in ("greedy", "data"):
        raise ValueError(f"draft.config.label_path={cfg['label_path']!r}: use 'greedy' or 'data'")
