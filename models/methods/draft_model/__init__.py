"""A separate small causal LM as the drafter (same tokenizer): the classic draft-model baseline.

The model is loaded by eval (``draft_model`` = a path or model id); this file is its proposal.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from models.core.proposal import Proposal, Sampling, chain_proposal, check_k, pick_token
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS, MethodSpec, ProposerSpec
from models.core.target import FrozenTarget


class DraftModelProposer:
    """A separate small causal LM (same tokenizer) drafting a chain of num_speculative_tokens tokens with its own KV
    cache.

    Its cache keeps the longest prefix of (context + drafts) that is still the context after acceptance, so
    each round feeds only the tokens it has not seen. A draft vocabulary larger than the target's (padded
    embeddings) is cut to the target's ids; a smaller one, or a different tokenizer, is refused.
    """

    layer_ids: list[int] = []

    def __init__(self, model: PreTrainedModel, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 target: FrozenTarget | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 sample_drafts: bool = True):
        self.model = model.eval()
        self.num_speculative_tokens = check_k("num_speculative_tokens", num_speculative_tokens)
        self.sample_drafts = sample_drafts
        dv = int(model.config.vocab_size)
        self.vocab_size = dv if target is None else target.vocab_size
        if dv < self.vocab_size:
            raise ValueError(f"draft model vocab ({dv}) is smaller than the target's ({self.vocab_size}): "
                             "it must share the target's tokenizer")
        tt = None if target is None else target.tokenizer
        if tt is not None and tokenizer is not None and tt.get_vocab() != tokenizer.get_vocab():
            raise ValueError("draft model tokenizer differs from the target's: a draft model must share the "
                             "target's tokenizer (same token ids)")

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.ctx = tokens[0].long().clone()
        self.seen = torch.zeros(0, dtype=torch.long, device=self.ctx.device)  # tokens in the draft cache
        self.cache = DynamicCache()  # every layer croppable, sliding ones too (eval/decode/window.py)

    @torch.no_grad()
    def _forward(self, ids: Tensor) -> Tensor:
        """Feed ids [n] after the cached ones → logits of the last position [V]."""
        start = self.seen.shape[0]
        pos = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
        out = self.model(input_ids=ids[None], position_ids=pos, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.seen = torch.cat([self.seen, ids])
        return out.logits[0, -1, : self.vocab_size]

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        k = min(self.num_speculative_tokens, max_depth)
        if self.seen.shape[0] >= self.ctx.shape[0]:
            # every context token is cached (the new tokens matched its drafts all the way, which a verified
            # round never gives but a caller may): drop the newest entry and re-feed it for its logits
            keep = self.ctx.shape[0] - 1
            self.cache.crop(keep - self.seen.shape[0])  # negative: the number of newest entries removed
            self.seen = self.seen[:keep]
        logits = self._forward(self.ctx[self.seen.shape[0]:])  # the context tokens it has not seen (>= 1)
        toks, qs = [], []
        for s in range(k):
            tok, q = pick_token(logits, self.sampling, self.sample_drafts, None, self.vocab_size)
            toks.append(tok)
            qs.append(q)
            if s + 1 < k:
                logits = self._forward(tok)
        return chain_proposal(toks, qs, self.ctx.device)

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.ctx = torch.cat([self.ctx, tokens[0].to(self.ctx)])
        # keep the cache entries whose tokens still match the context (KV depends on the token prefix only)
        n = min(self.seen.shape[0], self.ctx.shape[0])
        same = (self.seen[:n] == self.ctx[:n]).long().cumprod(0).sum()
        keep = int(same)
        if keep < self.seen.shape[0]:
            self.cache.crop(keep - self.seen.shape[0])
            self.seen = self.seen[:keep]


def load_draft_model(path: str, target: FrozenTarget) -> PreTrainedModel:
    """The draft model in the target's dtype and device; refuses one with another tokenizer now, not mid-run."""
    from models.core.target import load_causal_lm

    model, tok = load_causal_lm(path, dtype=target.model.dtype, device=str(target.model.device))
    DraftModelProposer(model, target=target, tokenizer=tok)  # the vocabulary/tokenizer checks
    return model


SPEC = MethodSpec(
    # tiny-code's small draft LM (python -m train.build_tiny_code --draft); also the HF assisted-generation peer
    name="draft_model", source="model", load=load_draft_model, default_path="runs/tiny_code_draft",
    proposers=(ProposerSpec("draft_model", lambda model, target, **o: DraftModelProposer(model, target=target, **o),
                            {"num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS}, recommend_rank=3,
                            hf_peer=lambda _o, model: ("hf_assisted", {"assistant_model": model})),),
)
