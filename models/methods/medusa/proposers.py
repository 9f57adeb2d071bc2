"""Medusa's proposer: the heads' top-k candidates placed on a static tree (tree.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from models.core.proposal import MAX_TREE_NODES, Proposal, Sampling
from models.methods.medusa.net import propose
from models.methods.medusa.tree import default_medusa_choices, tree_buffers, tree_tokens


class MedusaProposer:
    """Medusa heads on a static tree: node (r_0, …, r_{d-1}) is head d-1's rank-r_{d-1} token, read from the
    target's post-norm hidden state of the token before the newest one (head k predicts newest + 1 + k)."""

    def __init__(self, heads, choices: Sequence[Sequence[int]] | None = None, max_nodes: int = MAX_TREE_NODES):
        self.heads = heads.eval()
        self.layer_ids = list(heads.layer_ids)
        K = heads.cfg.num_heads
        choices = default_medusa_choices(K) if choices is None else [tuple(c) for c in choices]
        self.buffers = tree_buffers(choices)
        deepest = int(self.buffers.depth.max())
        if deepest > K:
            raise ValueError(f"medusa choices are {deepest} deep but the drafter has {K} heads: each depth needs "
                             "its own head; use choices of depth <= num_heads")
        if len(choices) > max_nodes:
            raise ValueError(f"medusa tree has {len(choices)} nodes, more than max_nodes={max_nodes}")
        self.top_k = int(self.buffers.rank.max()) + 1
        if self.top_k > heads.vocab_size:
            raise ValueError(f"medusa choices use rank {self.top_k - 1} but the vocabulary has {heads.vocab_size}")
        self.depth_of = self.buffers.depth

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.last_h = hidden[self.layer_ids[0]][:, -1]  # [1, H]

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.last_h = hidden[self.layer_ids[0]][:, -1]

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        b = self.buffers
        cand = propose(self.heads, self.last_h, self.top_k)  # [1, K, top_k]
        tok = tree_tokens(b, cand)[0]
        n = int((b.depth <= max_depth).sum())  # choices are sorted by depth: a prefix is a shallower tree
        return Proposal(tokens=tok[:n], parents=b.parent[:n].to(tok.device), depth=b.depth[:n].to(tok.device),
                        ancestors=b.attn_mask[:n, :n].to(tok.device))
