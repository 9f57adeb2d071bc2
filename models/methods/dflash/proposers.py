"""Proposers of a block drafter: ONE drafter forward per round drafts a block (DFlash, DSpark).

Written against the drafter's interface only — ``layer_ids``, ``block_size``, ``num_spec``, ``slot_offset``,
``draft_ids``, ``vocab_size``, ``block_head``, ``context``, ``context_kv``, ``blocks``, ``logits``
(models/methods/dflash/net.py ``DFlashDrafter``), which it does not import. An intra-block head
(models/methods/dflash/heads.py) drafts the slots one after another; ``min_confidence`` is the
confidence-scheduled K.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from models.core.proposal import PerRowProposers, Proposal, Sampling, chain_proposal, check_k, pick_token
from models.core.ragged import RaggedKV
from models.methods.dflash.heads import draft_block


class DFlashProposer:
    """One drafter forward per round drafts min(B−1, max_depth) tokens after the newest one (a chain).

    Draft cache: per layer the K/V of the injected context for positions 0..n−1 (n = tokens with target
    states); each ``accept`` appends the new rows. Greedy at T=0 (point masses); otherwise each slot's token
    is sampled from its own distribution q_k, verified with the residual rule (the slots are drafted in
    parallel, so q_k does not depend on the earlier slots' samples — any q is lossless)."""

    def __init__(self, drafter: Any, num_speculative_tokens: int | None = None, sample_drafts: bool = True,
                 min_confidence: float = 0.0, verify_costs: list[float] | None = None):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        n = drafter.num_spec if num_speculative_tokens is None else num_speculative_tokens  # None → the whole block
        self.num_speculative_tokens = check_k("num_speculative_tokens", n)
        if self.num_speculative_tokens > drafter.num_spec:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: a block of {drafter.block_size} drafts "
                             f"at most {drafter.num_spec} tokens (slots past the block were never trained); lower "
                             "num_speculative_tokens or retrain a larger block")
        self.min_confidence = _check_confidence(drafter, min_confidence)
        self.verify_costs = _check_costs(drafter, verify_costs)
        self.sample_drafts = sample_drafts
        self.vocab_ids = drafter.draft_ids
        self.vocab_size = drafter.vocab_size

    @classmethod
    def batched(cls, rows: list[DFlashProposer]) -> DFlashBatchProposer | PerRowProposers:
        """One proposer for a batch of these (``DFlashBatchProposer``: one block forward per round for all rows);
        rows with different drafters or settings draft one after another instead."""
        p0 = rows[0]
        key = lambda p: (p.drafter, p.num_speculative_tokens, p.sample_drafts, p.min_confidence,  # noqa: E731
                         p.verify_costs)
        if any(key(p) != key(p0) for p in rows):
            return PerRowProposers(rows)
        return DFlashBatchProposer(p0.drafter, p0.num_speculative_tokens, p0.sample_drafts, p0.min_confidence,
                                   p0.verify_costs)

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.n = 0
        self.anchor = tokens[:, -1:].long()
        self._extend(hidden)

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.anchor = tokens[:, -1:].long()
        self._extend(hidden)

    def _extend(self, hidden: dict[int, Tensor]) -> None:
        """Project the new context rows (positions n..n+r−1) into every layer's cache."""
        dr = self.drafter
        ctx = dr.context(hidden)
        r = ctx.shape[1]
        if r == 0:
            return
        pos = torch.arange(self.n, self.n + r, device=ctx.device)[None]
        new = dr.context_kv(ctx, pos)
        self.kv = new if self.kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                                for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.n += r

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        dr = self.drafter
        k = min(self.num_speculative_tokens, max_depth)
        pos = torch.arange(self.n, self.n + dr.block_size, device=self.anchor.device)[None]
        off = dr.slot_offset
        out = dr.blocks(self.anchor, self.kv, pos, None)[:, off : off + k]  # [1, k, H]; no mask: context < anchor

        def pick(logits: Tensor) -> tuple[Tensor, Tensor | None]:
            return pick_token(logits[0], self.sampling, self.sample_drafts, self.vocab_ids, self.vocab_size)

        toks, qs, keep = draft_block(dr.block_head, dr.logits(out), out, self.anchor[:, 0], pick,
                                     self.min_confidence, self.verify_costs)
        n = len(toks) if keep is None else int(keep[0])
        return chain_proposal(list(toks[:n]), list(qs[:n]), self.anchor.device)


def _check_confidence(drafter: Any, min_confidence: float) -> float:
    m = float(min_confidence or 0.0)
    if not 0 <= m < 1:
        raise ValueError(f"min_confidence={min_confidence}: use 0 (verify every slot) or a probability in (0, 1)")
    if m and getattr(drafter.block_head, "confidence_head", None) is None:
        raise ValueError("min_confidence needs a confidence head (draft.config.block_head=markov with "
                         "confidence_head=true); this drafter has none")
    return m


def _check_costs(drafter: Any, verify_costs: list[float] | str | None) -> list[float] | None:
    if not verify_costs or verify_costs == "auto":  # auto: filled in by the cost model (models/methods/dflash)
        return None
    if getattr(drafter.block_head, "confidence_head", None) is None:
        raise ValueError("verify_costs schedule the verified length from a confidence head; this drafter has none")
    costs = [float(v) for v in verify_costs]
    if any(v <= 0 for v in costs):
        raise ValueError(f"verify_costs={verify_costs}: verification costs must be positive")
    return costs


class DFlashBatchProposer:
    """``BatchProposer`` (models/core/proposal.py) for a DFlash drafter: ONE block forward per round for all rows.

    Rows differ in context length n_a, so the draft cache is ragged (models/core/ragged.py): ``propose`` runs every
    row's block at its own positions n_a..n_a+B−1 in one ``blocks`` call with a mask hiding each row's cache
    padding (none when all rows have the same length); ``accept`` projects all rows' new context features in
    one ``context`` / ``context_kv`` call. Drafts equal the B=1 ``DFlashProposer``'s up to float rounding."""

    def __init__(self, drafter: Any, num_speculative_tokens: int, sample_drafts: bool = True,
                 min_confidence: float = 0.0, verify_costs: list[float] | None = None):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        self.num_speculative_tokens, self.sample_drafts = int(num_speculative_tokens), sample_drafts
        self.min_confidence = _check_confidence(drafter, min_confidence)
        self.verify_costs = _check_costs(drafter, verify_costs)
        self.vocab_ids, self.vocab_size = drafter.draft_ids, drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.cache = RaggedKV(len(tokens), tokens[0].device)
        self.accept([t[:-1] for t in tokens], hidden)  # the prompts' states, then the first token as anchor
        self.anchor = torch.stack([t[-1] for t in tokens]).long()

    @torch.no_grad()
    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        device = self.cache.n.device
        self.anchor = torch.stack([t[-1] for t in tokens]).long().to(device)
        r = torch.tensor([t.shape[0] for t in tokens], dtype=torch.long, device=device)
        ctx = self.drafter.context({k: hidden[k] for k in self.layer_ids})  # [A, R, H], all rows at once
        pos = self.cache.n[:, None] + torch.arange(ctx.shape[1], device=device)
        self.cache.extend(self.drafter.context_kv(ctx, pos), r)

    def retain(self, rows: list[int]) -> None:
        self.cache.retain(rows)
        self.anchor = self.anchor[torch.tensor(rows, dtype=torch.long, device=self.anchor.device)]

    @torch.no_grad()
    def propose(self, max_depth: list[int]) -> list[Proposal]:
        dr, device = self.drafter, self.anchor.device
        ks = [min(self.num_speculative_tokens, d) for d in max_depth]
        kmax, blk = max(ks, default=0), dr.block_size
        if kmax == 0:
            return [Proposal.empty(device) for _ in ks]
        mask = self.cache.visible()  # row a sees its own context 0..n_a−1 and its whole block
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], blk)], 1)[:, None, None].expand(-1, 1, blk, -1)
        pos = self.cache.n[:, None] + torch.arange(blk, device=device)
        off = dr.slot_offset
        out = dr.blocks(self.anchor[:, None], self.cache.kv, pos, mask)[:, off : off + kmax]
        ids = self.vocab_ids.to(device)

        def pick(logits: Tensor) -> tuple[Tensor, Tensor | None]:  # [A, V'] → every row's token, one draw call
            if self.sampling.greedy or not self.sample_drafts:
                return ids[logits.argmax(-1)], None
            probs = self.sampling.probs(logits)
            idx = torch.multinomial(probs, 1, generator=self.sampling.generator)[:, 0]
            return ids[idx], probs.new_zeros(probs.shape[0], self.vocab_size).index_copy_(1, ids, probs)

        toks, qs, keep = draft_block(dr.block_head, dr.logits(out), out, self.anchor, pick, self.min_confidence,
                                     self.verify_costs)
        toks = torch.stack(toks, 1)  # [A, k']
        q = None if qs[0] is None else torch.stack(qs, 1)
        if keep is not None:
            ks = [min(k, int(c)) for k, c in zip(ks, keep)]
        return [Proposal(tokens=toks[a, :k].clone(), q=None if q is None else q[a, :k].clone()) if k
                else Proposal.empty(device) for a, k in enumerate(ks)]
