"""Draft-tree layout, derived once from the parents array (core: the verifier, the engine, Medusa's static tree
and EAGLE-2's dynamic tree all use this one function), and static trees built from rank accuracies (what the
cost model sizes Medusa's and EAGLE-2's trees with).

A tree of N drafted nodes is ``parents`` [N]: -1 = child of the root (the newest real token), otherwise the
index of the parent node, always smaller than the node's own index (topological order).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from torch import Tensor


def tree_layout(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents [N] (-1 = root child, topological) → (depth [N] 1-based, ancestors [N, N] bool incl. self).

    Vectorised over nodes, one step per tree level: walk every node's ancestor chain in lockstep.
    """
    n = parents.shape[0]
    device = parents.device
    anc = torch.eye(n, dtype=torch.bool, device=device)
    depth = torch.ones(n, dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)
    cur = parents.clone()
    while bool((cur >= 0).any()):
        live = cur >= 0
        anc[rows[live], cur[live]] = True
        depth += live.long()
        cur = torch.where(live, parents[cur.clamp_min(0)], cur)
    return depth, anc


# ------------------------------------------------------- static trees from rank accuracies (tree sizing)
def expected_tree_tau(acc: torch.Tensor, choices: Sequence[Sequence[int]]) -> float:
    """Expected tokens per verification of a static tree: 1 (the bonus token) + Σ_nodes P(node's path is
    accepted) = 1 + Σ Π_i acc[i, r_i], heads treated as independent (as ``build_medusa_tree`` ranks them)."""
    a = acc.double()
    return 1.0 + sum(float(torch.prod(a[torch.arange(len(c)), torch.tensor(c)])) for c in choices)


def tree_capacity(num_heads: int, top_k: int) -> int:
    """Largest tree K heads × top_k ranks can address: Σ_{d=1..K} top_k^d."""
    return sum(top_k**d for d in range(1, num_heads + 1))


def build_rank_tree(acc: torch.Tensor, num_nodes: int) -> list[tuple[int, ...]]:
    """Greedy static tree in ``medusa_choices`` style from per-depth rank accuracies (Medusa's heads, EAGLE-2's
    levels).

    acc [K, top_k]: acc[k, r] = P(the depth-(k+1) rank-r candidate is the target's token | its path was accepted).
    A node (r_0, …, r_{d-1}) scores Π_i acc[i, r_i] (its estimated acceptance probability, heads treated
    as independent). Repeatedly add the connected node (parent already chosen; depth-1 nodes hang off the
    root) with the highest score until ``num_nodes``. Ties: shallower, then lexicographically smaller path.
    Returned sorted by (depth, path), so every parent precedes its children.
    """
    if acc.dim() != 2:
        raise ValueError(f"acc must be [num_heads, top_k], got shape {tuple(acc.shape)}")
    K, top_k = acc.shape
    cap = tree_capacity(K, top_k)
    if not 0 < num_nodes <= cap:
        raise ValueError(f"num_nodes={num_nodes} out of range: {K} heads x top-{top_k} address 1..{cap} nodes")
    a = acc.double().tolist()
    # max-heap of frontier nodes: (−score, depth, path)
    frontier = [(-a[0][r], 1, (r,)) for r in range(top_k)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < num_nodes:
        neg, d, path = heapq.heappop(frontier)
        chosen.append(path)
        if d < K:  # children read head d
            for r in range(top_k):
                heapq.heappush(frontier, (neg * a[d][r], d + 1, path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))
