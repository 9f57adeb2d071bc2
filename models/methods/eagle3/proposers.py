"""EAGLE-3 proposers: the chain (B=1), the batched chain (one midlayer pass per drafting step for every row) and
the EAGLE-2 dynamic tree, all drafting through the cached kernels of kernels.py."""

from __future__ import annotations

import torch
from torch import Tensor

from models.core.proposal import (
    MAX_TREE_NODES,
    PerRowProposers,
    Proposal,
    Sampling,
    chain_proposal,
    check_k,
    pick_token,
    right_pad,
)
from models.core.ragged import RaggedKV
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS
from models.core.tree import tree_layout
from models.methods.eagle3.kernels import DraftKV, cached_step, entry_out, entry_qkv, inference_copy
from models.methods.eagle3.net import Eagle3Drafter


class _Eagle3Base:
    """KV cache of the drafter's "real" entries (built from the target's fused states, models/methods/eagle3
    convention: entry i reads (emb(x_{i+1}), g_i) at RoPE position i). Drafted entries never enter it."""

    def __init__(self, drafter, weights: str = "float32"):
        self.drafter = inference_copy(drafter.eval(), weights)
        self.layer_ids = list(drafter.layer_ids)
        self.vocab_ids = drafter.draft_ids  # [Vd] target id of each draft id
        self.vocab_size = drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
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
        t = self.pending_ids.shape[1]
        pos = torch.arange(self.n_real, self.n_real + t, device=self.pending_g.device)
        a = cached_step(self.drafter, self.pending_ids, self.pending_g, pos, self.kv, self.n_real,
                        max_pos=self.n_real + t - 1)
        self.n_real += t
        self.pending_ids = self.pending_ids[:, :0]
        self.pending_g = self.pending_g[:, :0]
        return a[:, -1]


class Eagle3ChainProposer(_Eagle3Base):
    """EAGLE-3 chain of num_speculative_tokens drafts: draft s (1-based) enters as (emb(d_s), a of the previous
    entry) at RoPE position n + s (n = the last real entry's position) and attends to every real entry and earlier
    draft."""

    def __init__(self, drafter, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 sample_drafts: bool = True, weights: str = "float32"):
        super().__init__(drafter, weights)
        self.num_speculative_tokens = check_k("num_speculative_tokens", num_speculative_tokens)
        self.sample_drafts = sample_drafts

    @classmethod
    def batched(cls, rows: list[Eagle3ChainProposer]) -> Eagle3ChainBatchProposer | PerRowProposers:
        """One proposer for a batch of these (one midlayer pass per drafting step for all rows); rows with
        different drafters or settings, or behind prompt lookup (``lookup``), draft one after another instead."""
        p0 = rows[0]
        key = lambda p: (p.drafter, p.num_speculative_tokens, p.sample_drafts)  # noqa: E731
        if not all(isinstance(p, Eagle3ChainProposer) for p in rows) or any(key(p) != key(p0) for p in rows):
            return PerRowProposers(rows)
        return Eagle3ChainBatchProposer(p0.drafter, p0.num_speculative_tokens, p0.sample_drafts)

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        k = min(self.num_speculative_tokens, max_depth)
        a = self._extend()  # [1, H]
        last = self.n_real - 1
        toks, qs = [], []
        for s in range(1, k + 1):
            tok, q = pick_token(self.drafter.logits(a)[0].float(), self.sampling, self.sample_drafts, self.vocab_ids,
                           self.vocab_size)
            toks.append(tok)
            qs.append(q)
            if s < k:  # draft s enters as scratch entry n_real + s - 1, RoPE position last + s
                pos = torch.tensor([last + s], device=a.device)
                a = cached_step(self.drafter, tok[None], a[:, None], pos, self.kv, self.n_real + s - 1,
                                max_pos=last + s)[:, -1]
        return chain_proposal(toks, qs, a.device)


class Eagle3ChainBatchProposer:
    """``BatchProposer`` (models/core/proposal.py) for EAGLE-3 chains: each drafting step is ONE midlayer pass for
    every active row (K+1 passes a round for the whole batch, instead of K+1 per row).

    Rows sit at different lengths n_a, so the real entries live in a ragged cache (models/core/ragged.py): a round
    first adds every row's pending real entries in one pass (row a's new entry j at RoPE position n_a + j sees
    its own entries 0..n_a + j), then drafts kmax = max budget steps; draft s of row a reads (emb(d_s), a of
    the previous entry) at position n_a − 1 + s and sees row a's real entries and its earlier drafts, which
    are scratch K/V appended after the cache and dropped with the round. Drafts equal the B=1
    ``Eagle3ChainProposer``'s up to float rounding (greedy: the same tokens, tested)."""

    def __init__(self, drafter: Eagle3Drafter, num_speculative_tokens: int, sample_drafts: bool = True):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        self.num_speculative_tokens = check_k("num_speculative_tokens", num_speculative_tokens)
        self.sample_drafts = sample_drafts
        self.vocab_ids, self.vocab_size = drafter.draft_ids, drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.cache = RaggedKV(len(tokens), tokens[0].device)
        g = self.drafter.fuse(hidden)  # [B, T, H]: row b's first P_b rows are its prompt's
        self.pending_ids = [t[1:].long() for t in tokens]  # entry i reads (emb(x_{i+1}), g_i)
        self.pending_g = [g[b, : t.shape[0] - 1] for b, t in enumerate(tokens)]

    @torch.no_grad()
    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        g = self.drafter.fuse(hidden)  # [A, R, H], all rows in one fc
        for a, t in enumerate(tokens):
            self.pending_ids[a] = torch.cat([self.pending_ids[a], t.long()])
            self.pending_g[a] = torch.cat([self.pending_g[a], g[a, : t.shape[0]]])

    def retain(self, rows: list[int]) -> None:
        self.cache.retain(rows)
        self.pending_ids = [self.pending_ids[a] for a in rows]
        self.pending_g = [self.pending_g[a] for a in rows]

    def _extend(self) -> Tensor:
        """Add every row's pending real entries (ragged counts r_a) in one pass; return each row's newest entry's
        output a [A, H] (it scores the token after the row's newest context token)."""
        dr, n0 = self.drafter, self.cache.n
        ids, r = right_pad(self.pending_ids, 0)  # [A, R]
        R = ids.shape[1]
        g = torch.stack([torch.cat([x, x.new_zeros(R - x.shape[0], x.shape[1])]) for x in self.pending_g])
        pos = n0[:, None] + torch.arange(R, device=ids.device)  # [A, R]
        q, k, v, residual = entry_qkv(dr, ids, g, pos)
        self.cache.extend([(k, v)], r)
        keys, values = self.cache.kv[0]
        # new entry j of row a sees the row's entries c <= n0_a + j (its own earlier ones and itself)
        mask = torch.arange(keys.shape[2], device=ids.device)[None, None] <= pos[:, :, None]  # [A, R, C]
        out = entry_out(dr, q, keys, values, mask[:, None], residual)
        self.pending_ids = [x[:0] for x in self.pending_ids]
        self.pending_g = [x[:0] for x in self.pending_g]
        return out[torch.arange(out.shape[0], device=out.device), (r - 1).clamp_min(0)]

    def _pick(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """[A, Vd] → (target ids [A], q [A, V] or None): every row's draft in one argmax / one draw call."""
        ids = self.vocab_ids.to(logits.device)
        if self.sampling.greedy or not self.sample_drafts:
            return ids[logits.argmax(-1)], None
        probs = self.sampling.probs(logits)
        idx = torch.multinomial(probs, 1, generator=self.sampling.generator)[:, 0]
        return ids[idx], probs.new_zeros(probs.shape[0], self.vocab_size).index_copy_(1, ids, probs)

    @torch.no_grad()
    def propose(self, max_depth: list[int]) -> list[Proposal]:
        dr = self.drafter
        ks = [min(self.num_speculative_tokens, d) for d in max_depth]
        kmax = max(ks, default=0)
        device = self.cache.n.device
        if kmax == 0:
            return [Proposal.empty(device) for _ in ks]
        a = self._extend()  # [A, H]
        keys, values = self.cache.kv[0]
        seen = self.cache.visible()  # [A, C] row a's real entries, None when no row has padding
        last = self.cache.n - 1
        toks, qs = [], []
        for s in range(1, kmax + 1):
            tok, q = self._pick(dr.logits(a).float())
            toks.append(tok)
            qs.append(q)
            if s < kmax:  # draft s enters as scratch after the cache, RoPE position last_a + s
                qd, kd, vd, res = entry_qkv(dr, tok[:, None], a[:, None], (last + s)[:, None])
                keys, values = torch.cat([keys, kd], 2), torch.cat([values, vd], 2)
                mask = None
                if seen is not None:
                    seen = torch.cat([seen, seen.new_ones(seen.shape[0], 1)], 1)
                    mask = seen[:, None, None]
                a = entry_out(dr, qd, keys, values, mask, res)[:, 0]
        tok_all = torch.stack(toks, 1)  # [A, kmax]
        q_all = None if qs[0] is None else torch.stack(qs, 1)
        return [Proposal(tokens=tok_all[i, :k].clone(), q=None if q_all is None else q_all[i, :k].clone())
                if k else Proposal.empty(device) for i, k in enumerate(ks)]


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
                 max_nodes: int = MAX_TREE_NODES, weights: str = "float32"):
        super().__init__(drafter, weights)
        self.depth = check_k("depth", depth)
        self.top_k = check_k("top_k", top_k)
        self.total_tokens = check_k("total_tokens", total_tokens)
        if self.top_k > drafter.draft_vocab_size:
            raise ValueError(f"top_k={top_k} exceeds the draft vocabulary ({drafter.draft_vocab_size})")
        if self.total_tokens > max_nodes:
            raise ValueError(f"total_tokens={total_tokens} is more than max_nodes={max_nodes} tree nodes; "
                             "lower total_tokens")

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
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
            out = cached_step(dr, all_tok[frontier][None], h_in[None], pos, self.kv, self.n_real + e, mask,
                              max_pos=last + d)
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
