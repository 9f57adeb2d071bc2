"""Prompt lookup: the context as a draft source, alone (the n-gram method) or in front of a model.

``PromptLookup`` finds the most recent earlier occurrence of the context's last n tokens (n = max_ngram down to
min_ngram) and proposes the tokens that followed it: no model, point-mass drafts.

``LookupFirst`` puts it in front of a drafter (suffix decoding in front of a model speculator, as Snowflake's
Arctic Inference serves them): a round whose context repeats drafts the lookup's continuation, free and often long
(code, lists, quoted text); every other round the model's. Both see every accepted token, so each is current
whichever drafted; verification is the same lossless rule per round (point mass for the lookup's drafts, the
model's own q for its sampled ones).
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.core.proposal import Proposal, Proposer, Sampling, check_k
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS

LOOKUP_MAX_NGRAM = 3  # the longest context suffix LookupFirst matches (the n-gram method's max_ngram default)


class PromptLookup:
    """Prompt lookup of up to ``num_speculative_tokens`` tokens (see the module docstring); ``matched``: the
    n-gram length of the last proposal's match (0: none)."""

    layer_ids: list[int] = []

    def __init__(self, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, max_ngram: int = 3,
                 min_ngram: int = 1):
        self.num_speculative_tokens = check_k("num_speculative_tokens", num_speculative_tokens)
        self.max_ngram = check_k("max_ngram", max_ngram)
        self.min_ngram = check_k("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram={min_ngram} > max_ngram={max_ngram}")
        self.ctx = torch.zeros(0, dtype=torch.long)
        self.matched = 0

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.ctx = tokens[0].long().clone()

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.ctx = torch.cat([self.ctx, tokens[0].to(self.ctx)])

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        k = min(self.num_speculative_tokens, max_depth)
        c = self.ctx
        length = c.shape[0]
        self.matched = 0
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
                    self.matched = n
                    return Proposal(tokens=cont.clone())
        return Proposal.empty(c.device)


class LookupFirst:
    """``model``'s proposals, except in rounds where ``lookup`` matches (see the module docstring). ``rounds``
    counts the rounds each drafted (``{"lookup": n, "model": m}``)."""

    def __init__(self, model: Proposer, lookup: PromptLookup):
        self.model, self.lookup = model, lookup
        self.layer_ids = list(model.layer_ids)
        self.rounds = {"lookup": 0, "model": 0}

    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.model.begin(tokens, hidden, sampling)
        self.lookup.begin(tokens, hidden, sampling)

    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.model.accept(tokens, hidden)
        self.lookup.accept(tokens, hidden)

    def propose(self, max_depth: int) -> Proposal:
        p = self.lookup.propose(max_depth)
        if p.size:
            self.rounds["lookup"] += 1
            return p
        self.rounds["model"] += 1
        return self.model.propose(max_depth)


def lookup_width(options: dict) -> int:
    """Tokens a lookup round of a proposer with these options drafts at most (0: no lookup): the verification
    widths a cost table must cover."""
    return int(options.get("lookup_tokens", 0)) if options.get("lookup") else 0


def with_lookup(proposer: Proposer, min_ngram: int, num_speculative_tokens: int) -> Proposer:
    """``proposer`` behind prompt lookup of ``num_speculative_tokens`` tokens when the context's last
    ``min_ngram``..3 tokens occurred before (a method's ``lookup`` option); ``min_ngram`` 0: ``proposer`` itself."""
    if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or not 0 <= min_ngram <= LOOKUP_MAX_NGRAM:
        raise ValueError(f"lookup must be 0 (off) or the shortest context n-gram to match, 1..{LOOKUP_MAX_NGRAM}; "
                         f"got {min_ngram!r}")
    if min_ngram == 0:
        return proposer
    return LookupFirst(proposer, PromptLookup(num_speculative_tokens, LOOKUP_MAX_NGRAM, min_ngram))
