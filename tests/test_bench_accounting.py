"""The benchmark's accounting on hand-made inputs with hand-computed answers (the end-to-end runs on tiny models
are tests/test_benchmark.py): crossover and the dynamic-K policy, the K recommendation's spec ranks, τ by reply
window, the draft vocabulary's coverage of AR's tokens."""

from __future__ import annotations

import pytest
import torch

from eval.bench.cost_model import choose_k, crossover_batch_size, draft_round_costs, predicted_speedup
from eval.bench.setup import Method


def test_crossover_on_hand_made_speedups():
    assert crossover_batch_size([1, 2, 4, 8, 16], [1.8, 1.3, 1.05, 0.9, 0.7]) == 8
    assert crossover_batch_size([1, 2, 4], [1.5, 1.2, 1.01]) is None
    assert crossover_batch_size([4, 1, 2], [0.9, 1.2, 1.1]) == 4  # sorted by batch size first
    assert crossover_batch_size([1, 2], [0.95, 1.2]) == 1


def test_dynamic_k_policy_on_hand_made_tables():
    acc = [0.8, 0.5, 0.2]
    # E(K) = 1 + Σ_j Π_{i<=j} α_i (models/core/acceptance.py chain_tau, tested in test_acceptance.py): 1, 1.8, 2.2, 2.28
    c = 0.1
    w1 = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}  # batch 1: verifying more tokens is almost free
    w2 = {0: 1.1, 1: 1.4, 2: 1.7, 3: 2.0}
    w8 = {0: 2.0, 1: 3.5, 2: 5.0, 3: 6.5}  # batch 8: compute-bound, every extra token costs
    # B=1: K=1 → 1.8/1.2 = 1.5, K=2 → 2.2/1.4 = 1.571, K=3 → 2.28/1.6 = 1.425
    k, pred = choose_k(acc, c, w1, 1, 3)
    assert k == 2 and pred == pytest.approx({0: 1.0, 1: 1.5, 2: 2.2 / 1.4, 3: 2.28 / 1.6})
    # B=2: K=1 → 1.8·1.1/(0.2+1.4) = 1.2375, K=2 → 2.42/2.1 = 1.152, K=3 → 2.508/2.6 = 0.965
    k, pred = choose_k(acc, c, w2, 2, 3)
    assert k == 1 and pred[1] == pytest.approx(1.2375) and pred[3] == pytest.approx(2.508 / 2.6)
    # B=8: K=1 → 3.6/4.3 = 0.837 < 1: speculation off, unless K >= 1 is forced (the exporter's number)
    assert choose_k(acc, c, w8, 8, 3)[0] == 0
    assert choose_k(acc, c, w8, 8, 3, k_min=1)[0] == 1
    assert crossover_batch_size([1, 2, 8], [predicted_speedup(acc, c, w, b, 2) for b, w in
                                            ((1, w1), (2, w2), (8, w8))]) == 8
    # unmeasured K are interpolated: v(1) between v(0) = 1.0 and v(2) = 1.2
    assert predicted_speedup(acc, c, {0: 1.0, 2: 1.2}, 1, 1) == pytest.approx(1.8 / (0.1 + 1.1))
    # a measured batched drafting cost d_B(K) replaces B·K·c: a drafter costing 0.05 per round for all 8 rows
    # (one forward for the batch) keeps speculation on at B=8 (K=1: 3.6/3.55) where B·K·c = 0.8 turned it off
    flat = {1: 0.05, 2: 0.05, 3: 0.05}
    assert predicted_speedup(acc, c, w8, 8, 1, draft=flat) == pytest.approx(1.8 * 2.0 / (0.05 + 3.5))
    assert choose_k(acc, c, w8, 8, 3, draft=flat)[0] == 1
    assert choose_k(acc, c, w2, 2, 3, draft={1: 0.2, 2: 0.4, 3: 0.6})[1] == pytest.approx(choose_k(acc, c, w2, 2, 3)[1])
    # the microbenchmark's shape, the in-situ level: B=1 at K_ref is exactly K_ref·c
    d = draft_round_costs(0.05, 2, {1: {1: 1e-3, 2: 2e-3}, 4: {1: 1e-3, 2: 3e-3}})
    assert d[1] == pytest.approx({1: 0.05, 2: 0.1}) and d[4] == pytest.approx({1: 0.05, 2: 0.15})


def test_the_recommended_k_comes_from_the_spec_ranks():
    """``recommended_for``: the swept chain whose proposer has the lowest ``ProposerSpec.recommend_rank`` (a new
    method declares its own; none ranked → no recommendation)."""
    from eval.bench.benchmark import recommendation

    names = ("ngram", "mtp", "peagle")
    pol = {n: {"recommended_num_speculative_tokens": {1: i + 1, 2: 0}, "best_positive_num_speculative_tokens": i + 1}
           for i, n in enumerate(names)}
    chains = [Method(n, n) for n in names]
    ranks = {m.name: m.proposer_spec().recommend_rank for m in chains}
    assert ranks == {"ngram": 4, "mtp": 2, "peagle": None}
    r = recommendation(chains, pol)
    assert r["recommended_for"] == "mtp" and r["recommended_num_speculative_tokens"] == 2
    assert r["recommended_num_speculative_tokens_by_batch"] == {1: 2, 2: 0} and r["speculation_pays_at_batch_1"]
    assert recommendation(chains[2:], pol) == {}


def test_tau_by_reply_window_places_each_round_where_it_began():
    """Rounds pooled by the 32-token reply window their first token falls in (reply token 0 is the prefill's)."""
    from eval.bench.stats import TAU_WINDOW, Pooled
    from eval.decode.result import DecodeResult

    assert TAU_WINDOW == 32
    # rounds begin at reply tokens 1, 4, 5, 30, 35, 36: windows 0, 0, 0, 0, 1, 1
    r = DecodeResult(tokens=list(range(40)), accepted=[2, 0, 24, 4, 0, 3])
    pool = Pooled()
    pool.add(r, None)
    pool.add(DecodeResult(tokens=list(range(3)), accepted=[1]), None)  # a second prompt: window 0
    assert pool.window_rounds == [5, 2] and pool.window_tokens == [3 + 1 + 25 + 5 + 2, 1 + 4]
    assert pool.tau_by_window == [36 / 5, 5 / 2]
    assert sum(pool.window_tokens) == pool.accepted + pool.rounds
    from eval.bench.report import _window_md

    row = {"method": "eagle3", "kind": "eagle3", "temperature": 0.0,
           "tau_by_window": {"tokens": TAU_WINDOW, "tau": pool.tau_by_window, "rounds": pool.window_rounds}}
    assert _window_md({"runs": [row]})[-1] == "| eagle3 | 0 | 7.20 | 2.50 |"
    assert "| 0-31 | 32-63 |" in _window_md({"runs": [row]})[-3]
    one = {**row, "tau_by_window": {"tokens": TAU_WINDOW, "tau": [1.5], "rounds": [4]}}
    assert _window_md({"runs": [one]}) == []  # one window: the τ column already says it


def test_draft_vocab_coverage_counts_ar_tokens_the_draft_vocabulary_holds():
    from types import SimpleNamespace

    from eval.bench.stats import draft_vocab_coverage

    methods = [SimpleNamespace(name="ar", model=None), SimpleNamespace(name="eagle3", model=SimpleNamespace(
        draft_ids=torch.tensor([3, 5, 9])))]
    assert draft_vocab_coverage(methods, [[3, 4, 5], [9, 9, 1, 2, 3]]) == {
        "eagle3": {"size": 3, "covers_ar_tokens": 5 / 8}}
    assert draft_vocab_coverage(methods, []) == {}
