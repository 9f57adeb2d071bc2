"""What every draft method provides to the shared training loop (a protocol, not a base class).

The loop (train/loop.py) does, per batch:

    out = target(input_ids, layer_ids=drafter.layer_ids)          # frozen, no grad
    loss, metrics = drafter.training_loss(input_ids, loss_mask, out.hidden, out.logits)
    loss.backward()

Conventions shared by all methods:
- ``input_ids``/``loss_mask``: [B, T]; ``loss_mask[b, t] == 1`` when token t is a training
  target (assistant tokens for chat data, every real token for code windows; 0 on padding).
- ``hidden``: {layer id → [B, T, H]} in the HF ``output_hidden_states`` index convention
  (models/core/target.py); id L (= num_hidden_layers) is the last layer *after* the final norm.
- ``target_logits``: [B, T, V] the target's logits; position t predicts token t+1. A drafter with a reduced
  vocabulary that sets ``reads_draft_vocab_teacher`` may get a ``DraftVocabTeacher`` instead (offline training
  from a feature cache): the same information it reads, without the full-vocabulary lm_head at every step.
- ``metrics``: flat {name: float}, e.g. ``loss_0``, ``acc_0`` … per step/head, plus
  ``sim_tau`` (expected accepted length of a greedy chain from per-position agreement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftVocabTeacher:
    """The target's logits as a reduced-vocabulary drafter reads them: the full-vocabulary argmax (stored once in the
    feature cache) and the logits at the draft-vocabulary ids only. On SmolLM2 (V=49152, Vd=4096) this removes the
    [B*T, H] x [H, V] lm_head from every training step, a third of an EAGLE-3 step on CPU."""

    top: torch.Tensor  # [B, T] the target's argmax over its full vocabulary (target ids)
    logits: torch.Tensor  # [B, T, Vd] the target's logits at draft_ids, in draft-id order
    draft_ids: torch.Tensor  # [Vd] the target id of each draft id (what ``logits`` was gathered at)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, draft_ids: torch.Tensor) -> DraftVocabTeacher:
        return cls(logits.argmax(-1), logits.index_select(-1, draft_ids), draft_ids)


class Drafter(Protocol):
    layer_ids: list[int]

    def training_loss(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: dict[int, torch.Tensor],
        target_logits: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...

    def config_dict(self) -> dict: ...


def softcap(logits, cap: float | None):
    """The target's final-logit soft-capping (Gemma-2/3: ``cap * tanh(logits / cap)``), so heads that end in the
    target's lm_head produce the target's kind of distribution; None / 0 → unchanged."""
    import torch

    return logits if not cap else torch.tanh(logits / cap) * cap
