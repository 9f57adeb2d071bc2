"""The P-EAGLE proposer: one drafter forward per round drafts up to K tokens (the cache: the package docstring)."""

from __future__ import annotations

import torch
from torch import Tensor

from models.core.proposal import Proposal, Sampling, chain_proposal, check_k, pick_token
from models.methods.peagle.net import PEagleDrafter


class PEagleProposer:
    """One drafter forward per round drafts min(K, max_depth) tokens (package docstring: the cache)."""

    def __init__(self, drafter: PEagleDrafter, num_speculative_tokens: int | None = None, sample_drafts: bool = True):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        K = drafter.cfg.num_depths
        self.num_speculative_tokens = check_k("num_speculative_tokens",
                                              num_speculative_tokens if num_speculative_tokens is not None else K)
        if self.num_speculative_tokens > K:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: this drafter was trained for {K} "
                             "parallel depths; lower num_speculative_tokens or retrain with "
                             "draft.config.num_depths >= num_speculative_tokens")
        self.sample_drafts = sample_drafts
        self.vocab_ids, self.vocab_size = drafter.draft_ids, drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.n = 0  # real entries cached
        self.pending: tuple[Tensor, Tensor] | None = None
        self._add(tokens[:, 1:], hidden)

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self._add(tokens, hidden)

    def _add(self, next_tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        """Real entries for the r new target states: (emb(t_{i+1}), g_i); run with the next round's drafts."""
        dr = self.drafter
        g = dr.fuse({k: hidden[k] for k in self.layer_ids})
        e = dr.embed_tokens(next_tokens.long()).to(g.dtype)
        if self.pending is not None:
            e, g = torch.cat([self.pending[0], e], 1), torch.cat([self.pending[1], g], 1)
        self.pending = (e, g)

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        dr = self.drafter
        k = min(self.num_speculative_tokens, max_depth)
        e, g = self.pending
        r = e.shape[1]
        em, gm = dr.mask_entry(1, k - 1)
        pos = torch.arange(self.n, self.n + r + k - 1, device=g.device)[None]
        x, kvs = dr.forward_entries(torch.cat([e, em], 1), torch.cat([g, gm], 1), pos, self.kv, None)
        new = [(kk[:, :, :r], vv[:, :, :r]) for kk, vv in kvs]  # keep the real entries only
        self.kv = new if self.kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                                for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.n += r
        self.pending = (e[:, :0], g[:, :0])
        logits = dr.logits(x[0, r - 1 :])  # the newest real entry drafts depth 0, the masks depths 1..k-1
        toks, qs = [], []
        for s in range(k):
            tok, q = pick_token(logits[s], self.sampling, self.sample_drafts, self.vocab_ids, self.vocab_size)
            toks.append(tok)
            qs.append(q)
        return chain_proposal(toks, qs, g.device)
