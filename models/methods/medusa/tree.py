"""Medusa's static tree: the rank accuracies it is built from, the tree saved with a checkpoint, its cost-model
size, and the buffers tree decoding reads.

Decoding uses a static tree (``medusa_choices``): node = tuple of per-head ranks along its path; node
(r_0, …, r_{d-1}) is the token ranked r_{d-1} by head d-1, placed at depth d, and attends to its ancestors only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from models.core import acceptance
from models.core.tree import build_rank_tree as build_medusa_tree
from models.core.tree import expected_tree_tau, tree_capacity, tree_layout

TREE_FILE = "medusa_choices.json"  # next to the final weights (MedusaHeads.save_static_tree)


def rank_accuracy(metrics: Mapping[str, float], num_heads: int, top_k: int) -> torch.Tensor:
    """[K, top_k] P(head k's rank-r candidate is the target's token) from cumulative top{j}_{k} metrics
    (``MedusaHeads.training_loss`` with metric_top_k): acc[k, r] = top{r+1}_k - top{r}_k."""
    return acceptance.rank_accuracy(metrics, num_heads, top_k,
                                    why_missing=f"train with draft.config.metric_top_k >= {top_k}")


def load_static_tree(ckpt_dir: str | Path, num_nodes: int | None = None) -> list[tuple[int, ...]] | None:
    """The tree saved with a checkpoint (``save_static_tree``); with ``num_nodes`` (and a different size)
    rebuilt from the saved rank accuracies. None when the checkpoint has no tree."""
    path = Path(ckpt_dir) / TREE_FILE
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    choices = [tuple(int(r) for r in c) for c in saved["choices"]]
    if num_nodes is None or num_nodes == len(choices):
        return choices
    acc = torch.tensor(saved["rank_accuracy"], dtype=torch.float64)
    return build_medusa_tree(acc, min(int(num_nodes), tree_capacity(*acc.shape)))


def load_rank_accuracy(ckpt_dir: str | Path) -> torch.Tensor | None:
    """The [K, top_k] held-out rank accuracies saved with a checkpoint (``save_static_tree``), or None."""
    path = Path(ckpt_dir) / TREE_FILE
    return torch.tensor(json.loads(path.read_text())["rank_accuracy"], dtype=torch.float64) if path.exists() else None


def size_tree(acc: torch.Tensor, verify_cost, max_nodes: int) -> tuple[int, dict[int, float]]:
    """The tree size n <= max_nodes maximising expected τ(n) / verify_cost(n): a wider tree accepts more but
    its verification forward costs more (on a CPU it grows with width; ``verify_cost(n)`` is the measured cost of
    a forward over n + 1 tokens in one-token-forward units). Medusa drafts every node in one call whatever n is,
    so the draft cost does not enter. Returns (n, {n: predicted speedup bound})."""
    cap = min(int(max_nodes), tree_capacity(*acc.shape))
    return acceptance.best_by_cost(range(1, cap + 1), lambda n: expected_tree_tau(acc, build_medusa_tree(acc, n)),
                                   verify_cost)


@dataclass
class MedusaTreeBuffers:
    """What tree decoding needs for N = len(choices) candidate nodes (the root is not a node here).

    The root is the target's own next token (bonus token at the last verified position); decoders put it
    in front of the N nodes: it sits at position ``p`` and every node also attends to it and to the prefix;
    node i sits at position ``p + depth[i]``.
    """

    choices: list[tuple[int, ...]]  # sorted by (depth, path)
    parent: torch.Tensor  # [N] int64, index of the parent node, -1 for depth-1 nodes (parent = root)
    depth: torch.Tensor  # [N] int64, 1-based (= len(path))
    head: torch.Tensor  # [N] int64, head the node's token comes from (= depth - 1)
    rank: torch.Tensor  # [N] int64, rank within that head's top-k (= path[-1])
    attn_mask: torch.Tensor  # [N, N] bool, [i, j] = node j is node i or one of its ancestors
    leaf_paths: torch.Tensor  # [num_leaves, max_depth] int64 node indices root→leaf, right-padded with -1


def tree_buffers(choices: Sequence[Sequence[int]]) -> MedusaTreeBuffers:
    """Parent/depth/(head, rank) per node, the [N, N] ancestor mask and root→leaf paths."""
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
    if len(paths) != len(choices):
        raise ValueError("medusa tree choices contain duplicates")
    if not paths or any(len(p) == 0 for p in paths):
        raise ValueError("medusa tree needs at least one node and no empty path")
    index = {p: i for i, p in enumerate(paths)}
    N = len(paths)
    parent = torch.full((N,), -1, dtype=torch.long)
    for i, p in enumerate(paths):
        if len(p) > 1:
            if p[:-1] not in index:
                raise ValueError(f"medusa tree node {p} has no parent {p[:-1]} in the tree")
            parent[i] = index[p[:-1]]
    depth, mask = tree_layout(parent)  # depth = len(path); mask: itself and every ancestor (prefixes of its path)
    is_parent = torch.zeros(N, dtype=torch.bool)
    is_parent[parent[parent >= 0]] = True
    leaves = [i for i in range(N) if not is_parent[i]]
    max_depth = int(depth.max())
    leaf_paths = torch.full((len(leaves), max_depth), -1, dtype=torch.long)
    for row, i in enumerate(leaves):
        p = paths[i]
        leaf_paths[row, : len(p)] = torch.tensor([index[p[:d]] for d in range(1, len(p) + 1)])
    return MedusaTreeBuffers(
        choices=paths, parent=parent, depth=depth, head=depth - 1,
        rank=torch.tensor([p[-1] for p in paths], dtype=torch.long), attn_mask=mask, leaf_paths=leaf_paths,
    )


def tree_tokens(buffers: MedusaTreeBuffers, candidates: torch.Tensor) -> torch.Tensor:
    """candidates [B, K, top_k] (``propose``) → node tokens [B, N] in ``buffers.choices`` order."""
    return candidates[:, buffers.head.to(candidates.device), buffers.rank.to(candidates.device)]


def default_medusa_choices(num_heads: int, top_k: int = 10, num_nodes: int = 63) -> list[tuple[int, ...]]:
    """A Medusa tree without measured head accuracies: build_medusa_tree on a made-up table where head k's
    rank-r candidate is right with probability 0.6^(k+1) / (r+1) (deeper heads and lower ranks less often).
    Prefer ``build_medusa_tree(head_topk_accuracy(...), n)`` with the trained heads."""
    acc = torch.tensor([[0.6 ** (k + 1) / (r + 1) for r in range(top_k)] for k in range(num_heads)])
    return build_medusa_tree(acc, min(num_nodes, tree_capacity(num_heads, top_k)))
