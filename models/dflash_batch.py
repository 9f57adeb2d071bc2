"""DFlash's batched proposer: ONE drafter block forward per round drafts for every row of a batch.

Rows differ in how much context they have (n_a tokens with target states), so the draft cache is one padded
tensor per layer, [A, kv, C, d] with C = max n_a: row a's entries at 0..n_a−1, zeros past them. ``propose``
runs the block [anchor, mask × (B−1)] of every row at its own positions n_a..n_a+B−1 in one ``blocks`` call,
with a [A, 1, B, C+B] mask hiding each row's padding (none when every row has the same length); ``accept``
projects all rows' new context features in one ``context`` / ``context_kv`` call and writes row a's r_a
rows at n_a.. The drafts are the B=1 ``DFlashProposer``'s (models/dflash.py), up to float rounding of the
masked attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.proposal import Proposal, Sampling


class DFlashBatchProposer:
    """``BatchProposer`` (models/proposal.py) for a DFlash drafter: one block forward per round for all rows."""

    def __init__(self, drafter, k: int, sample_drafts: bool = True):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        self.k, self.sample_drafts = int(k), sample_drafts
        self.vocab_ids = drafter.draft_ids
        self.vocab_size = drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        device = tokens[0].device
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.n = torch.zeros(len(tokens), dtype=torch.long, device=device)
        self.anchor = torch.stack([t[-1] for t in tokens]).long()
        self._extend(hidden, torch.tensor([t.shape[0] - 1 for t in tokens], dtype=torch.long, device=device))

    @torch.no_grad()
    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        self.anchor = torch.stack([t[-1] for t in tokens]).long().to(self.n.device)
        self._extend(hidden, torch.tensor([t.shape[0] for t in tokens], dtype=torch.long, device=self.n.device))

    def retain(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.n.device)
        self.n, self.anchor = self.n[idx], self.anchor[idx]
        if self.kv is not None:
            self.kv = [(k[idx], v[idx]) for k, v in self.kv]

    def _extend(self, hidden: dict[int, Tensor], r: Tensor) -> None:
        """Project every row's new context rows (row a: its first r[a], at positions n_a..) into the caches."""
        dr = self.drafter
        ctx = dr.context({k: hidden[k] for k in self.layer_ids})  # [A, R, H], one call for all rows
        width = ctx.shape[1]
        if width == 0 or int(r.max()) == 0:
            return
        pos = self.n[:, None] + torch.arange(width, device=ctx.device)  # [A, R]
        new = dr.context_kv(ctx, pos)
        length = int((self.n + r).max())
        a, j = (torch.arange(width, device=ctx.device)[None] < r[:, None]).nonzero(as_tuple=True)
        dst = self.n[a] + j
        grown = []
        for layer, (k1, v1) in enumerate(new):
            if self.kv is None:
                k0 = k1.new_zeros(k1.shape[0], k1.shape[1], length, k1.shape[3])
                v0 = v1.new_zeros(k0.shape)
            else:
                k0, v0 = self.kv[layer]
                pad = length - k0.shape[2]
                if pad > 0:
                    k0 = torch.cat([k0, k0.new_zeros(*k0.shape[:2], pad, k0.shape[3])], 2)
                    v0 = torch.cat([v0, v0.new_zeros(*v0.shape[:2], pad, v0.shape[3])], 2)
            k0[a, :, dst], v0[a, :, dst] = k1[a, :, j], v1[a, :, j]
            grown.append((k0, v0))
        self.kv = grown
        self.n = self.n + r

    @torch.no_grad()
    def propose(self, max_depth: list[int]) -> list[Proposal]:
        dr = self.drafter
        device = self.anchor.device
        ks = [min(self.k, d) for d in max_depth]
        kmax = max(ks, default=0)
        if kmax == 0:
            return [Proposal.empty(device) for _ in ks]
        blk = dr.block_size
        pos = self.n[:, None] + torch.arange(blk, device=device)
        c = self.kv[0][0].shape[2]
        mask = None
        if bool((self.n != c).any()):  # row a sees its own context 0..n_a−1 and its whole block
            see = torch.arange(c, device=device)[None] < self.n[:, None]
            mask = torch.cat([see, see.new_ones(see.shape[0], blk)], 1)[:, None, None].expand(-1, 1, blk, -1)
        out = dr.blocks(self.anchor[:, None], self.kv, pos, mask)[:, 1 : kmax + 1]  # [A, kmax, H]
        logits = dr.logits(out)
        ids = self.vocab_ids.to(device)
        if self.sampling.greedy or not self.sample_drafts:
            toks, q = ids[logits.argmax(-1)], None
        else:
            probs = self.sampling.probs(logits)  # [A, kmax, V']
            idx = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=self.sampling.generator)
            toks = ids[idx.view(probs.shape[:2])]
            q = probs.new_zeros(*probs.shape[:2], self.vocab_size).index_copy_(2, ids, probs)
        return [Proposal(tokens=toks[a, :k].clone(), q=None if q is None else q[a, :k].clone()) if k
                else Proposal.empty(device) for a, k in enumerate(ks)]
