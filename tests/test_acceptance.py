"""models/core/acceptance.py: the one τ, rank-accuracy and cost-sizing implementation every method uses."""

from __future__ import annotations

import math

import pytest
import torch

from models.core.acceptance import best_by_cost, chain_tau, chain_taus, rank_accuracy
from models.core.tree import expected_tree_tau


def test_chain_tau_is_one_plus_the_sum_of_running_products():
    a = [0.8, 0.5, 0.25]
    assert chain_tau(a) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert chain_taus(a) == pytest.approx([1.0, 1.8, 2.2, 2.3])
    assert chain_tau(a, 1) == pytest.approx(1.8)
    assert chain_tau(a, 5) == pytest.approx(2.3)  # positions never measured are never accepted
    assert chain_tau([]) == 1.0  # AR: the bonus token only


def test_chain_tau_treats_unmeasured_rates_as_zero_and_clamps():
    assert chain_tau([0.5, float("nan"), 0.9]) == pytest.approx(1.5)
    assert chain_tau([None, 0.9]) == 1.0
    assert chain_tau([1.5, -0.2]) == pytest.approx(2.0)


def test_a_chain_is_the_one_path_tree():
    """A chain of k drafts is the tree whose only branch is rank 0 at every depth: the two τ formulas agree."""
    acc = torch.tensor([[0.7, 0.2], [0.6, 0.3], [0.4, 0.1]], dtype=torch.float64)
    chain = [tuple([0] * d) for d in range(1, 4)]
    assert expected_tree_tau(acc, chain) == pytest.approx(chain_tau(acc[:, 0].tolist()))


def test_rank_accuracy_differences_the_cumulative_metrics():
    m = {"top1_0": 0.5, "top2_0": 0.7, "top1_1": 0.4, "top2_1": 0.35}
    acc = rank_accuracy(m, steps=2, ranks=2)
    assert acc.dtype == torch.float64
    # a dip from held-out noise (top2_1 < top1_1) is clamped at 0
    assert torch.allclose(acc, torch.tensor([[0.5, 0.2], [0.4, 0.0]], dtype=torch.float64))
    mass = rank_accuracy({"mass1_0": 0.3}, steps=1, ranks=1, key="mass")
    assert mass.tolist() == [[0.3]]


def test_rank_accuracy_names_the_missing_metric_and_what_to_do():
    with pytest.raises(ValueError, match=r"top2_0.*retrain with metric_top_k"):
        rank_accuracy({"top1_0": 0.5}, steps=1, ranks=2, why_missing="retrain with metric_top_k >= 2")


def test_best_by_cost_maximises_gain_over_cost_and_breaks_ties_to_the_smaller_size():
    gain = {1: 1.5, 2: 2.0, 3: 2.4, 4: 2.5}
    cost = {1: 1.0, 2: 1.0, 3: 1.2, 4: 1.25}
    n, pred = best_by_cost(gain, gain.get, cost.get)
    assert pred == pytest.approx({1: 1.5, 2: 2.0, 3: 2.0, 4: 2.0})
    assert n == 2  # 2, 3 and 4 tie: the smallest wins (less work for the same speedup)
    with pytest.raises(ValueError, match="no candidate"):
        best_by_cost([], gain.get, cost.get)


def test_best_by_cost_turns_speculation_off_when_nothing_pays():
    tau = chain_taus([0.1, 0.1])
    n, _ = best_by_cost(range(3), lambda k: tau[k], lambda k: 1.0 + 0.5 * k)
    assert n == 0 and not math.isnan(tau[2])
