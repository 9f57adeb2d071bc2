"""Acceptance maths every method shares, written once: τ of a chain, per-rank acceptance from held-out rank
metrics, and the cost-model choice "the size n maximising τ(n) / cost(n)".

    chain_tau       E[tokens per verification round] of a K-token chain: 1 + Σ_{j≤K} Π_{i≤j} α_i (the 1 is the
                    bonus token; α_i = P(accept depth i | depth i-1 accepted), what training-time test measures)
    rank_accuracy   [steps, R] P(rank-r draft at depth k is the target's token | its path was) from the cumulative
                    ``{key}{j}_{k}`` metrics training writes (top-j hit rate; ``mass`` for the target's mass)
    best_by_cost    argmax_n gain(n) / cost(n) (ties → the smaller n), with the whole table for the record

A tree's τ (Σ over nodes of the product along its path) is models/core/tree.py ``expected_tree_tau``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch


def _rate(a: float | None) -> float:
    """An acceptance rate as a probability: unmeasured (None / NaN) counts as 0, and it is clamped to [0, 1]."""
    return 0.0 if a is None or math.isnan(float(a)) else min(max(float(a), 0.0), 1.0)


def chain_taus(acceptance: Sequence[float | None], k: int | None = None) -> list[float]:
    """[τ(0), τ(1), …, τ(k)]: τ of chains of 0..k drafts (k defaults to len(acceptance); positions past the list
    count as never accepted)."""
    k = len(acceptance) if k is None else int(k)
    out, run = [1.0], 1.0
    for j in range(k):
        run *= _rate(acceptance[j]) if j < len(acceptance) else 0.0
        out.append(out[-1] + run)
    return out


def chain_tau(acceptance: Sequence[float | None], k: int | None = None) -> float:
    """τ of a chain of k drafts (default: one per acceptance rate given)."""
    return chain_taus(acceptance, k)[-1]


def rank_accuracy(metrics: Mapping[str, float], steps: int, ranks: int, key: str = "top",
                  why_missing: str = "") -> torch.Tensor:
    """[steps, ranks] float64 P(the rank-r draft at step k is accepted | its path was): the differences of the
    cumulative ``{key}{j}_{k}`` metrics (j = 1..ranks), clamped at 0 (held-out noise can make them dip).
    A missing metric is a one-line error naming it, followed by ``why_missing`` (what to do)."""
    need = [f"{key}{j}_{k}" for k in range(steps) for j in range(1, ranks + 1)]
    missing = [n for n in need if n not in metrics]
    if missing:
        raise ValueError(f"rank accuracies need the held-out metrics {missing[:3]}...; {why_missing}".rstrip("; "))
    cum = torch.tensor([[_rate(metrics[f"{key}{j}_{k}"]) for j in range(1, ranks + 1)] for k in range(steps)],
                       dtype=torch.float64)  # an unscored step (null held-out metric) is never accepted
    return torch.diff(cum, dim=1, prepend=torch.zeros(steps, 1, dtype=torch.float64)).clamp_min(0)


def best_by_cost(sizes: Iterable[int], gain: Callable[[int], float], cost: Callable[[int], float]
                 ) -> tuple[int, dict[int, float]]:
    """The n in ``sizes`` maximising gain(n) / cost(n) (ties → the smaller n) and {n: gain(n) / cost(n)}: the one
    cost-model sizer (EAGLE-2 tree nodes, Medusa tree nodes, DFlash verified slots, the chain length K*)."""
    pred = {int(n): float(gain(n)) / float(cost(n)) for n in sizes}
    if not pred:
        raise ValueError("best_by_cost: no candidate sizes")
    return max(pred, key=lambda n: (pred[n], -n)), pred
