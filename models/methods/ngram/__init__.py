"""Prompt lookup (n-gram) drafting: no model, the context is the draft source (a model-free method).

Chains of deterministic drafts (point-mass verification); the B=1 lookup is models/core/lookup.py's (which also
puts it in front of a model drafter), its batched form is here; models/core/proposal.py has the protocol.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.core.lookup import PromptLookup
from models.core.proposal import Proposal, Sampling, right_pad
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS, MethodSpec, ProposerSpec


class NGramProposer(PromptLookup):
    """Prompt lookup (models/core/lookup.py): the most recent earlier occurrence of the context's last n tokens
    (n = max_ngram down to min_ngram) and the (up to) num_speculative_tokens tokens that followed it. No model;
    q = point masses."""

    @classmethod
    def batched(cls, rows: list[NGramProposer]) -> NGramBatchProposer:
        """One proposer for a batch of these (the settings of the first row; all rows must share them)."""
        p0 = rows[0]
        key = lambda p: (p.num_speculative_tokens, p.max_ngram, p.min_ngram)  # noqa: E731
        if any(key(p) != key(p0) for p in rows):
            raise ValueError("batched n-gram rows must share num_speculative_tokens, max_ngram and min_ngram")
        return NGramBatchProposer(p0.num_speculative_tokens, p0.max_ngram, p0.min_ngram)


class NGramBatchProposer:
    """``NGramProposer``'s lookup for every row of a batch at once: the contexts right-padded into one [A, T]
    tensor (padding -1, never a token), each n-gram size matched for all rows in one comparison. Proposes
    exactly what ``NGramProposer`` proposes for each row."""

    layer_ids: list[int] = []

    def __init__(self, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, max_ngram: int = 3,
                 min_ngram: int = 1):
        self.one = NGramProposer(num_speculative_tokens, max_ngram, min_ngram)  # validates the settings
        self.num_speculative_tokens = self.one.num_speculative_tokens
        self.max_ngram, self.min_ngram = self.one.max_ngram, self.one.min_ngram

    @torch.no_grad()
    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.ctx, self.len = right_pad([t.long() for t in tokens], -1)

    @torch.no_grad()
    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        new, r = right_pad([t.long().to(self.ctx.device) for t in tokens], -1)
        end = int((self.len + r).max())
        if end > self.ctx.shape[1]:
            self.ctx = torch.cat([self.ctx, self.ctx.new_full((self.ctx.shape[0], end - self.ctx.shape[1]), -1)], 1)
        a, j = (torch.arange(new.shape[1], device=r.device)[None] < r[:, None]).nonzero(as_tuple=True)
        self.ctx[a, self.len[a] + j] = new[a, j]
        self.len = self.len + r

    def retain(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.len.device)
        self.ctx, self.len = self.ctx[idx], self.len[idx]

    @torch.no_grad()
    def propose(self, max_depth: list[int]) -> list[Proposal]:
        c, length = self.ctx, self.len
        device = c.device
        k = torch.tensor([min(self.num_speculative_tokens, d) for d in max_depth], dtype=torch.long, device=device)
        t = c.shape[1]
        start = torch.full_like(length, -1)
        for n in range(min(self.max_ngram, t - 1), self.min_ngram - 1, -1):
            open_ = (start < 0) & (n <= length - 1)  # rows not yet matched whose context is long enough
            if not bool(open_.any()):
                continue
            pat = c.gather(1, ((length - n)[:, None] + torch.arange(n, device=device)).clamp_min(0))  # [A, n]
            s = torch.arange(t - n + 1, device=device)
            # every earlier n-gram (window s ends before the row's last n tokens)
            hit = (c.unfold(1, n, 1) == pat[:, None]).all(-1) & (s[None] <= (length - n - 1)[:, None]) & open_[:, None]
            # the most recent match whose continuation has all k tokens, else the earliest (as NGramProposer)
            full = hit & (s[None] + n + k[:, None] <= length[:, None])
            last_full = torch.where(full, s[None], -1).max(1).values
            first = torch.where(hit, s[None], t).min(1).values
            pick = torch.where(last_full >= 0, last_full, first) + n
            start = torch.where(hit.any(1), pick, start)
        out = []
        for a, (st, ka, la) in enumerate(zip(start.tolist(), k.tolist(), length.tolist())):
            out.append(Proposal(tokens=c[a, st : min(st + ka, la)].clone()) if st >= 0 and ka > 0
                       else Proposal.empty(device))
        return out


def _prompt_lookup(o: dict, _model) -> tuple[str, dict]:
    """HF transformers' twin of this method: prompt-lookup decoding with the same K and longest n-gram."""
    return "hf_prompt_lookup", {"prompt_lookup_num_tokens": int(o["num_speculative_tokens"]),
                                "max_matching_ngram_size": int(o["max_ngram"])}


SPEC = MethodSpec(
    name="ngram", source="none",
    proposers=(ProposerSpec("ngram", lambda _model, _target, **o: NGramProposer(**o),
                            {"num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS, "max_ngram": 3, "min_ngram": 1},
                            batched=NGramProposer.batched,
                            recommend_rank=4, hf_peer=_prompt_lookup),),
)
