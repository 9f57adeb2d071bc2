"""MTP proposers: the uncached greedy chain (the reference) and ``MTPProposer`` (a KV cache per depth)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from models.core.proposal import Proposal, Sampling, chain_proposal, check_k, pick_token
from models.methods.mtp.net import MTPDrafter, run_module_cached


@torch.no_grad()
def propose_chain(drafter: MTPDrafter, input_ids: torch.Tensor, hidden: torch.Tensor,
                  num_speculative_tokens: int) -> torch.Tensor:
    """Greedy chain of k = num_speculative_tokens draft tokens.

    input_ids [B, n+1] = x_0..x_n: the verified prefix plus the target's own next token x_n;
    hidden [B, n, H] = the target's id-L hidden states for x_0..x_{n-1} → drafts [B, k] = x_{n+1}..x_{n+k}.
    Step j (0-based) runs module min(j, D-1) over the whole prefix: input h^j (the previous step's output,
    h^0 = hidden) and emb(x_{i+j+1}) for i = 0..n-1, drafting from its last position. Beyond D modules the
    last one is reused recursively (as engines do with a single native MTP layer). No KV cache: each step
    recomputes its module over all n positions (O(k·n) per proposal); all rows share the same n.
    """
    B, n1 = input_ids.shape
    n = n1 - 1
    if hidden.shape[1] != n:
        raise ValueError(f"hidden covers {hidden.shape[1]} positions, expected len(input_ids) - 1 = {n}")
    D = drafter.cfg.num_modules
    tokens, prev = input_ids, hidden
    drafts = []
    for j in range(num_speculative_tokens):
        d = min(j, D - 1)
        h = drafter.run_module(d, prev, tokens[:, j + 1 : j + 1 + n])  # [B, n, H]
        nxt = drafter.logits(d, h[:, -1]).argmax(-1)  # [B]
        prev = drafter.hand_on(d, h)
        drafts.append(nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return torch.stack(drafts, dim=1) if drafts else input_ids.new_zeros(B, 0)


@dataclass
class _Stream:
    """One MTP depth j of the chain: module min(j, D-1) over positions 0..m-1 (input x_{i+j+1} and the previous
    stream's output). ``cache`` holds its confirmed entries 0..n-1 (inputs made of context tokens only);
    ``out`` its confirmed outputs for positions out_start..n-1 (what stream j+1 still needs)."""

    cache: DynamicCache
    n: int
    out: Tensor
    out_start: int


class MTPProposer:
    """MTP chain with a KV cache per depth, identical to ``propose_chain`` above (each step j runs
    module min(j, D-1) over the whole context; entries that read a drafted token are recomputed each round)."""

    def __init__(self, drafter, num_speculative_tokens: int | None = None, sample_drafts: bool = True):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        n = drafter.cfg.num_modules if num_speculative_tokens is None else num_speculative_tokens  # None → 1 per module
        self.num_speculative_tokens = check_k("num_speculative_tokens", n)
        self.sample_drafts = sample_drafts

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.ctx = tokens[0].long().clone()
        h0 = hidden[self.layer_ids[0]]
        self.h0, self.h0_start = h0, 0  # target states for positions h0_start..m-1
        empty = h0[:, :0]
        self.streams = [_Stream(DynamicCache(), 0, empty, 0) for _ in range(self.num_speculative_tokens)]

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.ctx = torch.cat([self.ctx, tokens[0].to(self.ctx)])
        self.h0 = torch.cat([self.h0, hidden[self.layer_ids[0]]], dim=1)

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        dr = self.drafter
        k = min(self.num_speculative_tokens, max_depth)
        m = self.ctx.shape[0] - 1  # positions 0..m-1 have target states; x_m is the newest token
        ext = self.ctx
        prev, prev_start = self.h0, self.h0_start  # the previous stream's outputs for prev_start..m-1
        toks, qs = [], []
        for j in range(k):
            st = self.streams[j]
            c = st.n
            h = run_module_cached(dr, min(j, dr.cfg.num_modules - 1), prev[:, c - prev_start:],
                                  ext[c + j + 1 : m + j + 1][None], st.cache, start=c)  # [1, m - c, H]
            conf = max(0, m - j - c)  # positions i <= m-1-j read context tokens only: keep them
            if m - c > conf:
                st.cache.crop(conf - (m - c))
            # this stream's outputs for st.out_start..m-1, as the next depth reads them (MTPDrafter.hand_on)
            full = torch.cat([st.out, dr.hand_on(min(j, dr.cfg.num_modules - 1), h)], dim=1)
            st.out = full[:, : c + conf - st.out_start]
            st.n = c + conf
            prev, prev_start = full, st.out_start
            tok, q = pick_token(dr.logits(min(j, dr.cfg.num_modules - 1), h[:, -1])[0], self.sampling,
                           self.sample_drafts, None, dr.vocab_size)
            toks.append(tok)
            qs.append(q)
            ext = torch.cat([ext, tok])
        self._trim()
        return chain_proposal(toks, qs, self.ctx.device)

    def _trim(self) -> None:
        """Drop stored outputs no later stream needs (stream j+1 restarts at its own confirmed count)."""
        need = self.streams[0].n
        self.h0, self.h0_start = self.h0[:, need - self.h0_start:], need
        for j in range(self.num_speculative_tokens - 1):
            st, nxt = self.streams[j], self.streams[j + 1]
            cut = max(nxt.n - st.out_start, 0)
            st.out, st.out_start = st.out[:, cut:], st.out_start + cut
        last = self.streams[-1]
        last.out, last.out_start = last.out[:, last.out.shape[1]:], last.n

