"""EAGLE-3's configuration (``draft.config``; maths and index conventions: the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass
class Eagle3Config:
    # Hidden-state ids in the models/core/target.py convention (index into HF output_hidden_states);
    # None → (2, L//2, L-3), EAGLE-3's (1, L//2-1, L-4) "output of layer" ids.
    layer_ids: list[int] | None = None
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    step_weight: float = 0.8
    # Decoder shape overrides; None → the target's value.
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    # Saved by config_dict and read back, so a reload rebuilds the shapes it was trained with even where the
    # target's head_dim != hidden/heads (Gemma, Qwen3, DeepSeek-V3, gpt-oss, Mistral-Nemo).
    head_dim: int | None = None
    # False: residual = g (EAGLE-3 original, native SGLang/vLLM loader); True: residual = hidden_norm(g).
    norm_before_residual: bool = False
    # EAGLE-3.1 (speculators 0.9.0 Eagle3SpeculatorConfig; same names, same tensors). Defaults = EAGLE-3.
    norm_before_fc: bool = False  # one RMSNorm over cat(h_0, h_1, h_2) [3H] before fc (tensor input_norm.weight)
    fc_norm: bool = False  # one RMSNorm per fused state before the cat (tensors fc_norm.{i}.weight [H])
    norm_output: bool = False  # the next step reads norm(a) instead of a; logits lm_head(norm(a)) either way
    # Training only: Gaussian noise of this std added to the 3 target states before fc (speculators trains with
    # 0.05), so the drafter meets states a little off the cached ones, as it will when its own drafts feed back.
    hidden_noise: float = 0.0
    # "new": EAGLE-3's trainable lm_head from a random init; "target": it starts as the target's lm_head rows of the
    # draft vocabulary (still trained); "target_frozen": those rows, never trained (speculators' default), so the
    # drafter learns to reach states the target's own head reads.
    lm_head: str = "new"

    def __post_init__(self) -> None:
        import math

        if isinstance(self.hidden_noise, bool) or not isinstance(self.hidden_noise, (int, float)) \
                or not math.isfinite(self.hidden_noise) or self.hidden_noise < 0:
            raise ValueError(f"draft.config.hidden_noise={self.hidden_noise!r}: give a standard deviation >= 0")
        if self.lm_head not in ("new", "target", "target_frozen"):
            raise ValueError(f"draft.config.lm_head={self.lm_head!r}: use 'new', 'target' or 'target_frozen'")


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's fused layers (2, L//2, L-3) in our hidden-state index convention."""
    return [2, num_layers // 2, num_layers - 3]


def fused_layer_ids(cfg: Eagle3Config, num_layers: int) -> list[int]:
    """The 3 hidden-state ids the drafter fuses: ``cfg.layer_ids`` or the defaults (range-checked by the caller)."""
    L = num_layers
    if cfg.layer_ids is None:
        ids = default_layer_ids(L)
        if len(set(ids)) != 3 or min(ids) < 0:
            raise ValueError(f"default EAGLE-3 layer ids (2, L//2, L-3) = {ids} are invalid for a {L}-layer "
                             "target; set layer_ids to 3 distinct ids in 0..L explicitly")
    else:
        ids = list(cfg.layer_ids)
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 fuses exactly 3 hidden states, got layer_ids={ids}; pass 3 ids in 0..{L}")
    return ids


def decoder_shape(cfg: Eagle3Config, tc: PretrainedConfig) -> tuple[int, int, int, int, int, float, bool, str]:
    """(hidden, intermediate, heads, kv_heads, head_dim, rms eps, attention bias, activation) of the draft decoder
    layer: the config's overrides, else the target config ``tc``'s values."""
    H = tc.hidden_size
    hidden = cfg.hidden_size or H
    if hidden != H:
        raise ValueError(f"hidden_size={hidden} differs from the target's {H}: the drafter reuses the target's "
                         "embedding, so its hidden size must equal the target's; drop the override")
    heads = cfg.num_attention_heads or tc.num_attention_heads
    kv_heads = cfg.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if cfg.head_dim:
        head_dim = int(cfg.head_dim)
    elif cfg.num_attention_heads is None and getattr(tc, "head_dim", None):
        head_dim = int(tc.head_dim)
    elif hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    else:
        head_dim = hidden // heads
    intermediate = cfg.intermediate_size or tc.intermediate_size
    eps = float(getattr(tc, "rms_norm_eps", 1e-6))
    bias = bool(getattr(tc, "attention_bias", False))
    act = getattr(tc, "hidden_act", "silu")
    return hidden, intermediate, heads, kv_heads, head_dim, eps, bias, act
