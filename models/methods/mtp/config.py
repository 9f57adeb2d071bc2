"""MTP's training config (``draft.config``) and the decoder-block config it derives from the target's.

Plain data read by the network (net.py), the exporter (export.py) and ``SPEC``; kept apart so each of them
imports it without importing the others.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from transformers import PreTrainedConfig

from models.core.config_checks import depth_check

# the up-front draft.config check (SPEC.check_config; also run by MTPConfig itself): the depth, the weights
check_config = depth_check("num_modules", "step_weight")

HIDDEN_BETWEEN_DEPTHS = ("post_norm", "pre_norm")


@dataclass
class MTPConfig:
    num_modules: int = 1  # D: depth k predicts token i+1+k at position i
    step_weight: float = 0.8  # depth k (1-based) weighted step_weight^(k-1)
    distill: bool = True  # soft CE against the target's distribution; False → ground-truth tokens
    # Decoder-block shape; None = the target's (required for native MTP weights).
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    # What depth k >= 2 reads as h^{k-1}: "post_norm" = shared_head.norm(h^{k-1}), what vLLM (deepseek_mtp.py,
    # v1/spec_decode/llm_base_proposer.py) and SGLang NextN (deepseek_nextn.py) feed the next step; "pre_norm" =
    # the block output itself (DeepSeek-V3 report eq. 21; draftsmith before this option: older checkpoints).
    hidden_between_depths: str = "post_norm"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_config(asdict(self))  # the up-front check train/checks.py runs on the yaml (SPEC.check_config)
        if self.hidden_between_depths not in HIDDEN_BETWEEN_DEPTHS:
            raise ValueError(f"mtp hidden_between_depths must be one of {HIDDEN_BETWEEN_DEPTHS}, got "
                             f"{self.hidden_between_depths!r}")


def decoder_config(cfg: MTPConfig, target_config: PreTrainedConfig) -> PreTrainedConfig:
    """The target's config with the MTP block overrides applied (a copy)."""
    dc = copy.deepcopy(target_config)
    if cfg.intermediate_size is not None:
        dc.intermediate_size = cfg.intermediate_size
    if cfg.num_attention_heads is not None:
        dc.num_attention_heads = cfg.num_attention_heads
        dc.head_dim = dc.hidden_size // cfg.num_attention_heads
    if cfg.num_key_value_heads is not None:
        dc.num_key_value_heads = cfg.num_key_value_heads
    # Families with per-layer attention types (Qwen2/3, Mistral-style `layer_types`) index them by layer_idx;
    # MTP modules sit at L..L+D-1, so extend the list with full attention (our mask is plain causal).
    layer_types = getattr(dc, "layer_types", None)
    if layer_types:
        dc.layer_types = list(layer_types) + ["full_attention"] * cfg.num_modules
    # We pass an explicit additive causal mask, which eager and sdpa both honour (flash kernels do not).
    if getattr(dc, "_attn_implementation", None) not in ("eager", "sdpa"):
        dc._attn_implementation = "sdpa"
    return dc
