"""Proposers for eval/decode.py's speculative decoding: one protocol (decode.Proposer), one class per method.

    NGramProposer           prompt lookup, no model: chain, point-mass drafts
    DraftModelProposer      a separate small causal LM sharing the tokenizer: chain with its own KV cache
    Eagle3ChainProposer     EAGLE-3 head, KV-cached, K steps
    Eagle3TreeProposer      EAGLE-2 dynamic tree on the EAGLE-3 head (top-k expansion, best total_tokens nodes)
    MedusaProposer          Medusa heads on a static tree (medusa_choices)
    MTPProposer             MTP modules, chain, the last module reused past depth D

Bookkeeping (decode.py docstring): ``begin(tokens [1, P+1], hidden {id: [1, P, H]}, sampling)`` then per
round ``propose(max_depth) -> Proposal`` and ``accept(new tokens [1, r], hidden {id: [1, r, H]})`` where the
hidden rows belong to the r tokens *before* the new ones (old root + accepted drafts), so a proposer that
reads target states always holds states for every context token but the newest.

Drafted chains may be sampled (``q`` = the draft distribution under the same temperature/top-p/top-k,
verified with the residual rule) or greedy/deterministic (``q`` None, point-mass rule); trees are always
deterministic top-k siblings. At temperature 0 every proposer drafts greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from eval.decode import MAX_TREE_NODES, Proposal, Sampling, tree_layout
from models.target import FrozenTarget

__all__ = [
    "NGramProposer",
    "DraftModelProposer",
    "Eagle3ChainProposer",
    "Eagle3TreeProposer",
    "MedusaProposer",
    "MTPProposer",
    "default_medusa_choices",
    "load_proposer",
]


def _check_k(name: str, k: int) -> int:
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"{name} must be a positive integer, got {k}")
    return int(k)


def _pick(logits: Tensor, sampling: Sampling, sample: bool, vocab_ids: Tensor | None,
          vocab_size: int) -> tuple[Tensor, Tensor | None]:
    """Choose one draft token from logits [V'] (V' = the drafter's vocabulary).

    Greedy (temperature 0 or ``sample`` False): argmax, q None (a point mass). Otherwise a draw from the
    processed distribution, returned as q over the *target* vocabulary [V] (``vocab_ids`` [V'] maps a
    reduced draft vocabulary to target ids). Returns (target id [1], q or None).
    """
    if sampling.greedy or not sample:
        idx = logits.argmax(-1, keepdim=True)
        return (idx if vocab_ids is None else vocab_ids[idx]), None
    probs = sampling.probs(logits)
    idx = torch.multinomial(probs, 1, generator=sampling.generator)
    if vocab_ids is None:
        return idx, probs
    q = probs.new_zeros(vocab_size).index_copy_(0, vocab_ids, probs)
    return vocab_ids[idx], q


def _chain(tokens: list[Tensor], qs: list[Tensor | None], device: torch.device) -> Proposal:
    if not tokens:
        return Proposal.empty(device)
    q = None if qs[0] is None else torch.stack(qs)
    return Proposal(tokens=torch.cat(tokens).long(), q=q)


# --------------------------------------------------------------------------------------------- n-gram
class NGramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens (n = max_ngram
    down to min_ngram) and propose the (up to) k tokens that followed it. No model; q = point masses."""

    layer_ids: list[int] = []

    def __init__(self, k: int = 5, max_ngram: int = 3, min_ngram: int = 1):
        self.k = _check_k("k", k)
        self.max_ngram = _check_k("max_ngram", max_ngram)
        self.min_ngram = _check_k("min_ngram", min_ngram)
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


# --------------------------------------------------------------------------------------------- draft model
class DraftModelProposer:
    """A separate small causal LM (same tokenizer) drafting a chain of k tokens with its own KV cache.

    Its cache keeps the longest prefix of (context + drafts) that is still the context after acceptance, so
    each round feeds only the tokens it has not seen. A draft vocabulary larger than the target's (padded
    embeddings) is cut to the target's ids; a smaller one, or a different tokenizer, is refused.
    """

    layer_ids: list[int] = []

    def __init__(self, model: PreTrainedModel, k: int = 4, target: FrozenTarget | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, sample_drafts: bool = True):
        self.model = model.eval()
        self.k = _check_k("k", k)
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
        self.cache = DynamicCache()  # every layer croppable, sliding ones too (eval/window.py)

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
        k = min(self.k, max_depth)
        logits = self._forward(self.ctx[self.seen.shape[0]:])  # the context tokens it has not seen (>= 1)
        toks, qs = [], []
        for s in range(k):
            tok, q = _pick(logits, self.sampling, self.sample_drafts, None, self.vocab_size)
            toks.append(tok)
            qs.append(q)
            if s + 1 < k:
                logits = self._forward(tok)
        return _chain(toks, qs, self.ctx.device)

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


# --------------------------------------------------------------------------------------------- EAGLE-3
class _Eagle3Base:
    """KV cache of the drafter's "real" entries (built from the target's fused states, models/eagle3.py
    convention: entry i reads (emb(x_{i+1}), g_i) at RoPE position i). Drafted entries never enter it."""

    def __init__(self, drafter):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        self.vocab_ids = drafter.draft_ids  # [Vd] target id of each draft id
        self.vocab_size = drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        from models.eagle3 import DraftKV

        self.sampling = sampling
        self.kv = DraftKV()  # real entries [0, n_real); drafted ones are scratch after them
        self.n_real = 0
        self.pending_ids = tokens[:, 1:].long()  # the token each pending entry's embedding reads
        self.pending_g = self.drafter.fuse(hidden)  # [1, P, H]

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.pending_ids = torch.cat([self.pending_ids, tokens.long()], dim=1)
        self.pending_g = torch.cat([self.pending_g, self.drafter.fuse(hidden)], dim=1)

    @torch.no_grad()
    def _extend(self) -> Tensor:
        """Add the pending real entries to the cache; return the last one's output a [1, H] (it scores the
        token after the newest context token)."""
        from models.eagle3 import cached_step

        t = self.pending_ids.shape[1]
        pos = torch.arange(self.n_real, self.n_real + t, device=self.pending_g.device)
        a = cached_step(self.drafter, self.pending_ids, self.pending_g, pos, self.kv, self.n_real)
        self.n_real += t
        self.pending_ids = self.pending_ids[:, :0]
        self.pending_g = self.pending_g[:, :0]
        return a[:, -1]


class Eagle3ChainProposer(_Eagle3Base):
    """EAGLE-3 chain of k drafts: draft s (1-based) enters as (emb(d_s), a of the previous entry) at RoPE
    position n + s (n = the last real entry's position) and attends to every real entry and earlier draft."""

    def __init__(self, drafter, k: int = 5, sample_drafts: bool = True):
        super().__init__(drafter)
        self.k = _check_k("k", k)
        self.sample_drafts = sample_drafts

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        from models.eagle3 import cached_step

        k = min(self.k, max_depth)
        a = self._extend()  # [1, H]
        last = self.n_real - 1
        toks, qs = [], []
        for s in range(1, k + 1):
            tok, q = _pick(self.drafter.logits(a)[0], self.sampling, self.sample_drafts, self.vocab_ids,
                           self.vocab_size)
            toks.append(tok)
            qs.append(q)
            if s < k:  # draft s enters as scratch entry n_real + s - 1, RoPE position last + s
                pos = torch.tensor([last + s], device=a.device)
                a = cached_step(self.drafter, tok[None], a[:, None], pos, self.kv, self.n_real + s - 1)[:, -1]
        return _chain(toks, qs, a.device)


class Eagle3TreeProposer(_Eagle3Base):
    """EAGLE-2 dynamic draft tree on an EAGLE-3 head.

    Depth 1: the top_k tokens after the newest context token, score = log q. Then for depth-1 more levels:
    expand the top_k highest-scoring nodes of the newest level (each node's entry reads (emb(token), a of its
    parent's entry) at RoPE position n + depth and sees the real entries, its ancestors' entries and itself),
    give each its top_k children with score = parent score + log q. Finally keep the best ``total_tokens``
    of all generated nodes (ties: shallower first, so the kept set contains every kept node's ancestors).
    Scores use the drafter's softmax at temperature 1; drafts are deterministic (point-mass verification).
    """

    def __init__(self, drafter, depth: int = 6, top_k: int = 10, total_tokens: int = 60,
                 max_nodes: int = MAX_TREE_NODES):
        super().__init__(drafter)
        self.depth = _check_k("depth", depth)
        self.top_k = _check_k("top_k", top_k)
        self.total_tokens = _check_k("total_tokens", total_tokens)
        if self.top_k > drafter.draft_vocab_size:
            raise ValueError(f"top_k={top_k} exceeds the draft vocabulary ({drafter.draft_vocab_size})")
        if self.total_tokens > max_nodes:
            raise ValueError(f"total_tokens={total_tokens} is more than max_nodes={max_nodes} tree nodes; "
                             "lower total_tokens")

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        from models.eagle3 import cached_step

        dr, top_k = self.drafter, self.top_k
        a_root = self._extend()  # [1, H]
        device = a_root.device
        last = self.n_real - 1
        logp = torch.log_softmax(dr.logits(a_root).float(), -1)[0]  # [Vd]
        top = logp.topk(top_k)
        # the node pool, level by level; pool index order is topological (children appended after parents)
        tokens = [self.vocab_ids[top.indices]]
        scores = [top.values]
        parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
        depths = [torch.ones(top_k, dtype=torch.long, device=device)]
        n_pool = top_k
        frontier = torch.arange(top_k, device=device)  # pool indices to expand next
        # drafted entries: outputs, KV, ancestor mask over entries (incl. self); entry index of expanded nodes
        ent_a = a_root.new_zeros(0, a_root.shape[-1])
        ent_anc = torch.zeros(0, 0, dtype=torch.bool, device=device)
        node_entry = torch.full((top_k,), -1, dtype=torch.long, device=device)
        all_tok, all_par = tokens[0], parents[0]
        for d in range(1, min(self.depth, max_depth)):
            f = frontier.shape[0]
            e = ent_a.shape[0]
            if d == 1:  # depth-1 nodes hang off the root: they read the last real entry's output
                h_in = a_root.expand(f, -1)
                anc_rows = torch.zeros(f, 0, dtype=torch.bool, device=device)
            else:  # every frontier node's parent was expanded one level up, so it has an entry
                par_ent = node_entry[all_par[frontier]]
                h_in = ent_a[par_ent]
                anc_rows = ent_anc[par_ent]  # [f, e]: the parent's entry and its ancestors' entries
            mask = torch.cat([torch.ones(f, self.n_real, dtype=torch.bool, device=device), anc_rows,
                              torch.eye(f, dtype=torch.bool, device=device)], dim=1)
            pos = torch.full((f,), last + d, device=device)
            out = cached_step(dr, all_tok[frontier][None], h_in[None], pos, self.kv, self.n_real + e, mask)
            ent_anc = torch.cat([torch.cat([ent_anc, torch.zeros(e, f, dtype=torch.bool, device=device)], 1),
                                 torch.cat([anc_rows, torch.eye(f, dtype=torch.bool, device=device)], 1)], 0)
            ent_a = torch.cat([ent_a, out[0]], dim=0)
            node_entry[frontier] = e + torch.arange(f, device=device)
            # children of every expanded node: top_k each, cumulative log q
            logq = torch.log_softmax(dr.logits(out[0]).float(), -1)  # [f, Vd]
            ctop = logq.topk(top_k, dim=-1)
            cscore = torch.cat(scores)[frontier][:, None] + ctop.values  # [f, top_k]
            tokens.append(self.vocab_ids[ctop.indices].reshape(-1))
            scores.append(cscore.reshape(-1))
            parents.append(frontier[:, None].expand(f, top_k).reshape(-1))
            depths.append(torch.full((f * top_k,), d + 1, dtype=torch.long, device=device))
            frontier = n_pool + cscore.reshape(-1).topk(min(top_k, f * top_k)).indices
            n_pool += f * top_k
            node_entry = torch.cat([node_entry, torch.full((f * top_k,), -1, dtype=torch.long, device=device)])
            all_tok, all_par = torch.cat(tokens), torch.cat(parents)
        return self._select(torch.cat(tokens), torch.cat(scores), torch.cat(parents), torch.cat(depths))

    def _select(self, tok: Tensor, score: Tensor, par: Tensor, depth: Tensor) -> Proposal:
        """Keep the best total_tokens nodes (score desc, then depth asc), re-indexed in pool (topological) order."""
        order = depth.argsort(stable=True)
        order = order[score[order].argsort(descending=True, stable=True)]
        keep = order[: self.total_tokens].sort().values
        new_index = torch.full_like(par, -1)
        new_index[keep] = torch.arange(keep.shape[0], device=keep.device)
        kp = par[keep]
        parents = torch.where(kp >= 0, new_index[kp.clamp_min(0)], -1)
        if bool(((kp >= 0) & (parents < 0)).any()):
            raise RuntimeError("EAGLE-2 tree selection dropped an ancestor of a kept node")
        d, anc = tree_layout(parents)
        self.last_scores = score[keep]  # [N] cumulative log q of the kept nodes (for inspection)
        return Proposal(tokens=tok[keep].long(), parents=parents, depth=d, ancestors=anc)


# --------------------------------------------------------------------------------------------- Medusa
def default_medusa_choices(num_heads: int, top_k: int = 10, num_nodes: int = 63) -> list[tuple[int, ...]]:
    """A Medusa tree without measured head accuracies: build_medusa_tree on a made-up table where head k's
    rank-r candidate is right with probability 0.6^(k+1) / (r+1) (deeper heads and lower ranks less often).
    Prefer ``build_medusa_tree(head_topk_accuracy(...), n)`` with the trained heads."""
    from models.medusa import build_medusa_tree, tree_capacity

    acc = torch.tensor([[0.6 ** (k + 1) / (r + 1) for r in range(top_k)] for k in range(num_heads)])
    return build_medusa_tree(acc, min(num_nodes, tree_capacity(num_heads, top_k)))


class MedusaProposer:
    """Medusa heads on a static tree: node (r_0, …, r_{d-1}) is head d-1's rank-r_{d-1} token, read from the
    target's post-norm hidden state of the token before the newest one (head k predicts newest + 1 + k)."""

    def __init__(self, heads, choices: Sequence[Sequence[int]] | None = None, max_nodes: int = MAX_TREE_NODES):
        from models.medusa import tree_buffers

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
        from models.medusa import propose, tree_tokens

        b = self.buffers
        cand = propose(self.heads, self.last_h, self.top_k)  # [1, K, top_k]
        tok = tree_tokens(b, cand)[0]
        n = int((b.depth <= max_depth).sum())  # choices are sorted by depth: a prefix is a shallower tree
        return Proposal(tokens=tok[:n], parents=b.parent[:n].to(tok.device), depth=b.depth[:n].to(tok.device),
                        ancestors=b.attn_mask[:n, :n].to(tok.device))


# --------------------------------------------------------------------------------------------- MTP
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
    """MTP chain with a KV cache per depth, identical to models/mtp.py ``propose_chain`` (each step j runs
    module min(j, D-1) over the whole context; entries that read a drafted token are recomputed each round)."""

    def __init__(self, drafter, k: int | None = None, sample_drafts: bool = True):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        self.k = _check_k("k", drafter.cfg.num_modules if k is None else k)
        self.sample_drafts = sample_drafts

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.ctx = tokens[0].long().clone()
        h0 = hidden[self.layer_ids[0]]
        self.h0, self.h0_start = h0, 0  # target states for positions h0_start..m-1
        empty = h0[:, :0]
        self.streams = [_Stream(DynamicCache(), 0, empty, 0) for _ in range(self.k)]

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.ctx = torch.cat([self.ctx, tokens[0].to(self.ctx)])
        self.h0 = torch.cat([self.h0, hidden[self.layer_ids[0]]], dim=1)

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        from models.mtp import run_module_cached

        dr = self.drafter
        k = min(self.k, max_depth)
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
            full = torch.cat([st.out, h], dim=1)  # this stream's outputs for st.out_start..m-1
            st.out = full[:, : c + conf - st.out_start]
            st.n = c + conf
            prev, prev_start = full, st.out_start
            tok, q = _pick(dr.logits(min(j, dr.cfg.num_modules - 1), h[:, -1])[0], self.sampling,
                           self.sample_drafts, None, dr.vocab_size)
            toks.append(tok)
            qs.append(q)
            ext = torch.cat([ext, tok])
        self._trim()
        return _chain(toks, qs, self.ctx.device)

    def _trim(self) -> None:
        """Drop stored outputs no later stream needs (stream j+1 restarts at its own confirmed count)."""
        need = self.streams[0].n
        self.h0, self.h0_start = self.h0[:, need - self.h0_start:], need
        for j in range(self.k - 1):
            st, nxt = self.streams[j], self.streams[j + 1]
            cut = max(nxt.n - st.out_start, 0)
            st.out, st.out_start = st.out[:, cut:], st.out_start + cut
        last = self.streams[-1]
        last.out, last.out_start = last.out[:, last.out.shape[1]:], last.n


# --------------------------------------------------------------------------------------------- factory
def load_proposer(path: str | Path, target: FrozenTarget, tree: bool = False, **kwargs) -> object:
    """A proposer from a trained drafter checkpoint (train/build.py ``load_drafter``, which refuses a
    checkpoint made for another target). ``tree``: EAGLE-3 → the EAGLE-2 dynamic tree instead of a chain.
    Extra keyword arguments go to the proposer (k, depth, top_k, total_tokens, choices, …)."""
    from train.build import load_drafter

    drafter, meta = load_drafter(path, target)
    method = meta["method"]
    if method == "eagle3":
        return Eagle3TreeProposer(drafter, **kwargs) if tree else Eagle3ChainProposer(drafter, **kwargs)
    if method == "medusa":
        if kwargs.get("choices") is None:  # the tree trained with it, when saved
            from models.medusa import load_static_tree

            kwargs["choices"] = load_static_tree(path)
        return MedusaProposer(drafter, **kwargs)
    if method == "mtp":
        return MTPProposer(drafter, **kwargs)
    raise ValueError(f"{path}: no proposer for method {method!r}")

