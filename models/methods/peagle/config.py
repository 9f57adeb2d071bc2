"""P-EAGLE's configuration (``draft.config``; the method: the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass


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
