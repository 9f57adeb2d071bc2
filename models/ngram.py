"""Prompt lookup (n-gram) drafting: no model, the context is the draft source (a model-free method).

Chains of deterministic drafts (point-mass verification); see models/proposal.py for the protocol.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.proposal import Proposal, Sampling, check_k
from models.spec import MethodSpec, ProposerSpec


class NGramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens (n = max_ngram
    down to min_ngram) and propose the (up to) k tokens that followed it. No model; q = point masses."""

    layer_ids: list[int] = []

    def __init__(self, k: int = 5, max_ngram: int = 3, min_ngram: int = 1):
        self.k = check_k("k", k)
        self.max_ngram = check_k("max_ngram", max_ngram)
        self.min_ngram = check_k("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram={min_ngram} > max_ngram={max_ngram}")
        self.ctx = torch.zeros(0, dtype=torch.long)

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.ctx = tokens[0].long().clone()

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.ctx = torch.cat([self.ctx, tokens[0].to(self.ctx)])

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        k = min(self.k, max_depth)
        c = self.ctx
        length = c.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = c.unfold(0, n, 1)[:-1]  # [length - n, n]: every earlier n-gram (the last one is the pattern)
            hits = (windows == c[length - n:]).all(1).nonzero()
            if hits.numel():
                # The most recent match whose continuation has all k tokens; the latest matches sit near
                # the end of the context and would propose only a token or two. Else the longest one.
                starts = hits[:, 0] + n
                full = starts[starts + k <= length]
                start = int(full[-1]) if full.numel() else int(starts[0])
                cont = c[start : start + k]
                if cont.numel():
                    return Proposal(tokens=cont.clone())
        return Proposal.empty(c.device)


SPEC = MethodSpec(
    name="ngram", source="none",
    proposers=(ProposerSpec("ngram", lambda _model, _target, **o: NGramProposer(**o),
                            {"k": 5, "max_ngram": 3, "min_ngram": 1}),),
)
