"""DFlash's (and DSpark's) training config (``draft.config``) and its layer-id default.

The config is plain data read by the network (net.py), the builder (``__init__``) and the exporter (export.py);
kept apart so each of them imports it without importing the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.core.config_checks import int_at_least


@dataclass
class DFlashConfig:
    # Target hidden states fused, in this project's convention (index into HF output_hidden_states = vLLM's
    # capture ids = z-lab target_layer_ids + 1). None → z-lab's build_target_layer_ids(L, num_layers) + 1.
    layer_ids: list[int] | None = None
    num_layers: int = 1  # draft decoder layers (z-lab / speculators / ModelOpt ship 5 for 8B targets)
    block_size: int = 8  # B: anchor + B−1 drafted slots (vLLM num_speculative_tokens = B−1; SGLang counts B)
    mask_token_id: int | None = None  # None → chosen at build time (an embedding row the data never uses)
    num_anchors: int = 32  # blocks per row per step (≈ T / B covers a row)
    loss: str = "ce"  # "ce": the target's greedy token; "kl": the target's distribution
    # "greedy": slot k is scored only where the data's tokens a+1..a+k-1 are the target's own greedy choices, so
    # its label is exactly what a greedy verifier accepts after slots 1..k-1 (on data the target did not write,
    # a teacher-forced label conditions on tokens the accepted drafts would not be); "data": every slot
    label_path: str = "greedy"
    decay_gamma: float | None = None  # None → 7 for B >= 16, else 4 (paper / ModelOpt recommendation)
    dpace: bool = False  # D-PACE position weights (arXiv 2605.18810), CE only
    dpace_alpha: float = 0.5
    draft_vocab_size: int | None = None  # None → the target's whole vocabulary
    intermediate_size: int | None = None  # None → the target's
    loss_chunk: int = 2048  # slots per logits chunk (never all N·B slots × V in fp32 at once)
    # DSpark (arXiv 2607.05147; models/methods/dflash/heads.py): an intra-block head, and the block convention
    block_head: str = "none"  # none | markov (| any name in models.methods.dflash.heads.BLOCK_HEADS)
    # true (DSpark): the anchor slot drafts too — slot s predicts token a+s+1, B speculative tokens per block;
    # false (DFlash): slot 0 is the anchor, slots 1..B-1 predict a+1..a+B-1
    sample_from_anchor: bool = False
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True  # DSpark's acceptance-rate head (BCE against 1 - TV(p, q)); needs a block head
    confidence_with_markov: bool = True  # its input is cat(h, W1[prev]) (else h)
    confidence_alpha: float = 1.0
    ce_weight: float = 1.0  # per-slot loss = ce_weight * CE (or KL) + tv_weight * TV(p, q) (DSpark: 0.1 / 0.9)
    tv_weight: float = 0.0
    warm_start: str | None = None  # a trained DFlash checkpoint dir (…/final): its weights, vocabulary, mask id


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """z-lab / SpecForge / ModelOpt / SGLang ``build_target_layer_ids`` (output-of-layer ids: [L//2] for n = 1,
    else evenly spaced 1..L−3), converted to this project's convention (+1)."""
    if n == 1:
        zl = [num_target_layers // 2]
    else:
        zl = [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]
    return [i + 1 for i in zl]


def _one_of(cfg: Mapping[str, Any], field: str, allowed: tuple[str, ...], what: str) -> None:
    v = cfg.get(field)
    if v is not None and v not in allowed:
        raise ValueError(f"draft.config.{field}={v!r}: use {what}")


def check_config(cfg: Mapping[str, Any], max_len: int | None = None) -> None:
    """Every target-free check of a DFlash / DSpark ``draft.config`` (SPEC.check_config: train/checks.py runs it on
    the yaml before any model loads; the drafter runs it on its dataclass): one ValueError naming the bad key."""
    for field, lo in (("num_layers", 1), ("block_size", 2), ("num_anchors", 1), ("loss_chunk", 1)):
        int_at_least(cfg, field, lo)  # block_size >= 2: a block is the anchor plus at least one drafted slot
    _one_of(cfg, "loss", ("ce", "kl"), "'ce' (target's token) or 'kl' (its distribution)")
    _one_of(cfg, "label_path", ("greedy", "data"), "'greedy' or 'data'")
    if cfg.get("dpace") and cfg.get("loss", "ce") != "ce":
        raise ValueError("draft.config.dpace=true needs loss=ce (D-PACE weights come from the CE of each slot)")
    ce, tv = cfg.get("ce_weight"), cfg.get("tv_weight")
    if ce is not None and tv is not None and (ce < 0 or tv < 0 or ce + tv <= 0):
        raise ValueError(f"draft.config.ce_weight={ce}, tv_weight={tv}: both >= 0, one > 0")
    block = cfg.get("block_size")
    if block is not None and isinstance(max_len, int) and block > max_len:
        raise ValueError(f"draft.config.block_size={block} is longer than data.max_len={max_len}: no block fits in a "
                         "training row; lower draft.config.block_size or raise data.max_len")
