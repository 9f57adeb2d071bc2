"""Draft-tree layout, derived once from the parents array (core: the verifier, the engine, Medusa's static tree
and EAGLE-2's dynamic tree all use this one function).

A tree of N drafted nodes is ``parents`` [N]: -1 = child of the root (the newest real token), otherwise the
index of the parent node, always smaller than the node's own index (topological order).
"""

from __future__ import annotations

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
