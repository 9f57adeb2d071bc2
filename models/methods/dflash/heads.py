"""Intra-block heads for block drafters: what slot k drafts may depend on what slot k−1 drafted.

A block drafter (models/methods/dflash) writes every slot of a block in one forward, so slot k does not know the
token drafted at slot k−1. Every 2026 follow-up keeps that backbone and adds a small head on its logits that
models the dependency inside the block (DSpark: low-rank Markov + confidence; Domino: GRU; DFlash2: conv +
selector; …). A head here is one small module behind one interface, chosen by ``draft.config.block_head``:

    block_logits(z, h, prev) → (logits, conf)   teacher forced, for training: z [..., S, Vd] backbone logits,
                                                h [..., S, H] backbone outputs, prev [..., S] the token before
                                                each slot's label (target ids; slot 0: the block's anchor)
    init_state(shape) → state                   before a block is drafted at decode time
    step(z_k, h_k, prev_k, state) → (logits_k, conf_k, state)
                                                one slot at decode time, prev_k = the token just drafted
    conf: acceptance logits (sigmoid → the head's estimate that the verifier accepts the slot given the earlier
    ones), or None for a head without a confidence head.

``step`` must equal ``block_logits`` slot by slot when fed the same ``prev`` (tested), which is what makes
training (teacher forced) and decoding (each slot conditioned on the previous draft) the same model.
Decoding stays lossless whatever the head computes: each slot's token is drawn from its own distribution given
the earlier drafts, exactly the chain the verifier checks.

MarkovHead is DSpark's (arXiv 2607.05147; speculators ``models/dspark/markov_head.py`` ``VanillaMarkov`` and
``confidence_head.py`` ``AcceptRatePredictor``; shared/design/dflash.md §7):
    bias_k = W2 · W1[prev_k]    W1 Embedding(V_target, r), W2 Linear(r → V_draft, no bias); added to z_k
    conf_k = proj(cat(h_k, W1[prev_k]))   Linear(H + r → 1) (H → 1 without ``confidence_with_markov``)
Tensor names (export): ``markov_head.markov_w1.weight [V, r]``, ``markov_head.markov_w2.weight [Vd, r]``,
``confidence_head.proj.weight [1, H+r]``, ``confidence_head.proj.bias [1]`` — under ``block_head.`` in the
drafter's state dict. W2 starts at zero, so a fresh head leaves the backbone's drafts unchanged (a warm start
from a DFlash checkpoint drafts exactly what that checkpoint drafted until training moves it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov head with its confidence head (module docstring)."""

    def __init__(self, cfg: Any, hidden: int, vocab: int, draft_vocab: int):
        super().__init__()
        r = int(cfg.markov_rank)
        if r < 1:
            raise ValueError(f"draft.config.markov_rank={r}: the Markov head needs a rank >= 1 (DSpark uses 256)")
        if cfg.markov_head_type != "vanilla":
            raise ValueError(f"draft.config.markov_head_type={cfg.markov_head_type!r}: only 'vanilla' is "
                             "implemented (speculators also has 'gated' and 'rnn')")
        self.rank, self.with_markov = r, bool(cfg.confidence_with_markov)
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(vocab, r)
        self.markov_head.markov_w2 = nn.Linear(r, draft_vocab, bias=False)
        nn.init.normal_(self.markov_head.markov_w1.weight, std=r ** -0.5)
        nn.init.zeros_(self.markov_head.markov_w2.weight)
        self.confidence_head = None
        if cfg.confidence_head:
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(hidden + (r if self.with_markov else 0), 1)

    def _conf(self, h: Tensor, e: Tensor) -> Tensor | None:
        if self.confidence_head is None:
            return None
        x = torch.cat([h, e.to(h.dtype)], -1) if self.with_markov else h
        return self.confidence_head.proj(x).squeeze(-1)

    def block_logits(self, z: Tensor, h: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None]:
        e = self.markov_head.markov_w1(prev.long())
        return z + self.markov_head.markov_w2(e).to(z.dtype), self._conf(h, e)

    def init_state(self, shape: tuple[int, ...]) -> None:
        return None

    def step(self, z: Tensor, h: Tensor, prev: Tensor, state: None) -> tuple[Tensor, Tensor | None, None]:
        logits, conf = self.block_logits(z, h, prev)
        return logits, conf, state


# name → factory(cfg, hidden, target vocab, draft vocab); "none" = no head (plain DFlash)
BLOCK_HEADS: dict[str, Callable[..., nn.Module]] = {"markov": MarkovHead}


def build_block_head(cfg: Any, hidden: int, vocab: int, draft_vocab: int) -> nn.Module | None:
    name = cfg.block_head
    if name in (None, "none"):
        return None
    if name not in BLOCK_HEADS:
        raise ValueError(f"draft.config.block_head={name!r}: use 'none' or one of {sorted(BLOCK_HEADS)}")
    return BLOCK_HEADS[name](cfg, hidden, vocab, draft_vocab)


def draft_block(head: nn.Module | None, z: Tensor, h: Tensor, anchor: Tensor, pick: Callable[[Tensor], tuple],
                min_confidence: float = 0.0, verify_costs: list[float] | None = None
                ) -> tuple[list[Tensor], list[Any], Tensor | None]:
    """Draft the slots of a block one after another (rows in parallel).

    z [A, k, Vd] backbone logits, h [A, k, H] backbone outputs, anchor [A] the token before slot 0, ``pick``
    (logits [A, Vd]) → (tokens [A] target ids, q or None). Without a head the slots are independent and ``pick``
    sees z as is. With one, slot s reads the token drafted at slot s−1. ``min_confidence`` > 0 (needs a
    confidence head): a row stops before the slot where the running product of the head's acceptance estimates
    falls below it — the confidence-scheduled K (at least one slot is always drafted). ``verify_costs`` (v(K) for
    K = 1.., in target steps; needs a confidence head): each row keeps the K maximising
    (1 + Σ_{j<=K} Π_{i<=j} c_i) / v(K) — the expected tokens per verify cost by the head's own estimates (DSpark's
    load-aware verification length). Returns (tokens per slot, q per slot, the number of slots kept per row [A] or
    None = all k)."""
    k = z.shape[1]
    if head is None:
        toks, qs = zip(*(pick(z[:, s]) for s in range(k))) if k else ((), ())
        return list(toks), list(qs), None
    state = head.init_state(tuple(z.shape[:1]))
    prev, run = anchor.long(), torch.ones(z.shape[0], device=z.device)
    keep = torch.full((z.shape[0],), k, dtype=torch.long, device=z.device)
    toks, qs, runs = [], [], []
    for s in range(k):
        logits, conf, state = head.step(z[:, s], h[:, s], prev, state)
        if conf is not None:
            run = run * torch.sigmoid(conf.float())
            runs.append(run)
        if conf is not None and min_confidence > 0:
            stop = (run < min_confidence) & (keep == k) & (s > 0)
            keep = torch.where(stop, torch.full_like(keep, s), keep)
            if bool((keep <= s).all()):
                break
        tok, q = pick(logits)
        toks.append(tok)
        qs.append(q)
        prev = tok
    if verify_costs and runs:
        n = min(len(toks), len(verify_costs))
        gain = 1 + torch.stack(runs[:n], 1).cumsum(1)  # [A, n] expected tokens when verifying 1..n slots
        best = (gain / torch.tensor(verify_costs[:n], device=gain.device)).argmax(1) + 1
        keep = torch.minimum(keep, best)
    return toks, qs, keep
