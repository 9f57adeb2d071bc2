"""The multi-step distillation loss every head-style method scores itself with (core).

Methods differ in *what* each step predicts (Medusa head k: token t+2+k; MTP depth k: token t+1+k; …), not in
how a step is scored: each method slices its logits, the target's logits for the same tokens and the mask, and
calls ``distill_step``; ``weighted_total`` and ``step_metrics`` make the loss and the metrics the training loop
reads (``loss_k``, ``acc_k``, ``n_k`` — the count the loop weights held-out metrics by — and ``sim_tau``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models.core.acceptance import chain_tau


def distill_step(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                 labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft step scored against the frozen target.

    logits [B, n, V] the drafter's; teacher_logits [B, n, V] the target's for the same tokens; mask [B, n] (true =
    a training target). ``labels`` None: soft cross-entropy H(softmax(teacher), softmax(logits)) (self-
    distillation); else hard CE on labels [B, n]. Returns (mean loss over the mask, agreement of the two argmaxes
    over the mask, number of masked positions); an empty step gives zeros.
    """
    m = mask.bool()
    logp = F.log_softmax(logits.float(), dim=-1)
    if labels is None:
        ce = -(F.softmax(teacher_logits.float(), dim=-1) * logp).sum(-1)
    else:
        ce = -logp.gather(-1, labels[..., None]).squeeze(-1)
    count = m.sum()
    denom = count.clamp_min(1)
    loss = torch.where(m, ce, 0.0).sum() / denom
    acc = ((logits.argmax(-1) == teacher_logits.argmax(-1)) & m).sum() / denom
    return loss, acc, count


def weighted_total(losses: Sequence[torch.Tensor], step_weight: float) -> torch.Tensor:
    """Σ_k step_weight^k · loss_k (k from 0), the Medusa-1 / EAGLE / MTP weighting."""
    total = losses[0].new_zeros((), dtype=torch.float32) if losses else torch.zeros(())
    for k, loss in enumerate(losses):
        total = total + step_weight**k * loss
    return total


def step_metrics(losses: Sequence[torch.Tensor], accs: Sequence[torch.Tensor],
                 counts: Sequence[torch.Tensor]) -> dict[str, float]:
    """loss_k, acc_k, n_k per step and sim_tau (``chain_tau`` of the agreements)."""
    out: dict[str, float] = {}
    for k, (loss, acc, n) in enumerate(zip(losses, accs, counts)):
        out[f"loss_{k}"], out[f"acc_{k}"], out[f"n_{k}"] = float(loss.detach()), float(acc), float(n)
    out["sim_tau"] = chain_tau([float(a) for a in accs])
    return out
