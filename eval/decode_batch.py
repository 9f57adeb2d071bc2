"""Batched decoding engine (chains only): ``speculative_decode_batch`` / ``decode_ar_batch`` run B sequences with
one batched verification forward per round. Each row keeps its own B=1 proposer, drafts of different lengths are
padded, and the shared cache holds per-row valid lengths (right padding hidden by a 4D mask; accepted entries
moved into place per row, see ``commit_kv_rows``).

Split out of eval/decode.py for readability (no behaviour change); eval/decode.py re-exports every name here, so
``from eval.decode import speculative_decode_batch`` keeps working. The single-sequence engine, the types
(``Sampling``, ``Proposal``, ``Proposer``, ``DecodeResult``) and the context bookkeeping are documented there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from eval.decode import (
    MAX_TREE_NODES,
    DecodeResult,
    Proposal,
    Proposer,
    Sampling,
    check_prompt,
    check_proposal,
    device_time,
    new_cache,
    sample_token,
)
from eval.window import apply_window, batch_key_positions
from models import verify
from models.target import FrozenTarget

__all__ = ["commit_kv_rows", "speculative_decode_batch", "decode_ar_batch"]


# --------------------------------------------------------------------------------------------- batched chains
class _NoDraft:
    """Drafts nothing: the batched engine then is plain batched autoregressive decoding."""

    layer_ids: list[int] = []

    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        pass

    def propose(self, max_depth: int) -> Proposal:
        return Proposal.empty()

    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        pass


def commit_kv_rows(cache: DynamicCache, lens: Tensor, start: int, width: int, keep: Tensor) -> None:
    """Per-row compaction after a batched verification forward.

    Row b's valid entries are [0, lens[b]) followed by garbage (right padding) up to ``start``; the forward
    appended ``width`` entries at start..start+width-1 (root + drafts). Move them to lens[b].. (only the
    first keep[b] - lens[b] matter; the rest become garbage), then crop to max(keep)."""
    device = lens.device
    t = torch.arange(width, device=device)
    rows = torch.arange(lens.shape[0], device=device).repeat_interleave(width)
    dst = (lens[:, None] + t).reshape(-1)
    src = (start + t).repeat(lens.shape[0])
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys[rows, :, dst] = layer.keys[rows, :, src]  # the RHS is a copy: overlapping ranges are safe
        layer.values[rows, :, dst] = layer.values[rows, :, src]
    drop = cache.get_seq_length() - int(keep.max())
    if drop > 0:
        cache.crop(-drop)


def batch_mask(lens: Tensor, start: int, width: int, dtype: torch.dtype) -> Tensor:
    """[A, 1, width, start+width] additive mask: row a's queries see its valid prefix [0, lens[a]) and the new
    entries causally (key start+j visible to query i when j <= i)."""
    device = lens.device
    keys = torch.arange(start + width, device=device)
    prefix = keys[None, None, :] < lens[:, None, None]  # [A, 1, S+W]
    new = (keys[None, :] - start <= torch.arange(width, device=device)[:, None]) & (keys[None, :] >= start)
    visible = prefix | new[None]  # [A, W, S+W]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def speculative_decode_batch(
    target: FrozenTarget,
    proposers: Sequence[Proposer],
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
) -> list[DecodeResult]:
    """Speculative decoding of B sequences (prompts of any lengths), one proposer per row, chains only.

    Per round: every active row drafts (its own proposer, its own budget), drafts are right-padded with
    ``pad_id`` to the longest (q = a point mass on the pad), ONE target forward verifies all rows
    (per-row positions lens[b] + i and a 4D mask), models/verify.py's batched rules accept, and each row keeps
    its accepted entries (``commit_kv_rows``). A row whose draft was padded at position k_b stops there: if
    the pad was accepted, the pad *is* that position's token — a draw from p (accept w.p. p(pad), else the
    residual p − δ_pad) — so truncating keeps the output exact. Finished rows leave the batch.
    Each row's result counts the rounds it took part in; timings are the batch's (shared).
    """
    sampling = Sampling(temperature, top_p, top_k, generator)
    if len(proposers) != len(prompts) or not prompts:
        raise ValueError(f"need one proposer per prompt, got {len(proposers)} proposers for {len(prompts)} prompts")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rows_in = [check_prompt(p, max_new_tokens)[0] for p in prompts]
    device = rows_in[0].device
    layer_ids = sorted({k for pr in proposers for k in pr.layer_ids})
    b_all = len(rows_in)
    res = [DecodeResult(tokens=[]) for _ in range(b_all)]
    t0 = device_time(device)

    # prefill, right-padded: pad entries sit past each row's length and are never visible afterwards
    lens = torch.tensor([r.shape[0] for r in rows_in], device=device)
    ids = torch.full((b_all, int(lens.max())), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows_in):
        ids[b, : r.shape[0]] = r
        attn[b, : r.shape[0]] = 1
    cache = new_cache(target)
    pre = target(ids, layer_ids=layer_ids, attention_mask=attn, cache=cache, use_cache=True)
    arange_b = torch.arange(b_all, device=device)
    roots = sample_token(pre.logits[arange_b, lens - 1], sampling)  # [B]
    t_pre = device_time(device)
    for r in res:
        r.prefill_s, r.target_forwards = t_pre - t0, 1
    outs = [[int(x)] for x in roots.tolist()]
    done = [max_new_tokens == 1 or (eos_id is not None and o[0] == eos_id) for o in outs]
    for b, pr in enumerate(proposers):
        n = rows_in[b].shape[0]
        pr.begin(torch.cat([rows_in[b], roots[b : b + 1]])[None], {k: v[b : b + 1, :n] for k, v in pre.hidden.items()},
                 sampling)
    draft_s = device_time(device) - t_pre
    verify_s = 0.0

    active = [b for b in range(b_all) if not done[b]]
    keep_rows = torch.tensor(active, dtype=torch.long, device=device)  # long even when empty (every row done)
    if active and len(active) < b_all:
        cache.batch_select_indices(keep_rows)
    lens, roots = lens[keep_rows], roots[keep_rows]
    vocab = target.vocab_size
    while active:
        t = device_time(device)
        props = []
        for b in active:
            budget = max_new_tokens - len(outs[b]) - 1
            prop = proposers[b].propose(budget) if budget > 0 else Proposal.empty(device)
            if not prop.is_chain:
                raise ValueError("speculative_decode_batch verifies chains only; use speculative_decode for trees")
            check_proposal(prop, budget, MAX_TREE_NODES)
            props.append(prop)
        k_b = torch.tensor([p.size for p in props], device=device)
        width = int(k_b.max()) + 1
        drafts = torch.full((len(active), width - 1), pad_id, dtype=torch.long, device=device)
        for a, p in enumerate(props):
            drafts[a, : p.size] = p.tokens.to(device)
        q = None
        if not sampling.greedy:  # point masses for deterministic drafts and for the padding
            q = F.one_hot(drafts, vocab).float()
            for a, p in enumerate(props):
                if p.q is not None:
                    q[a, : p.size] = p.q.to(device=device, dtype=q.dtype)
        t_drafted = device_time(device)
        draft_s += t_drafted - t

        start = cache.get_seq_length()
        pos = lens[:, None] + torch.arange(width, device=device)
        mask = batch_mask(lens, start, width, target.model.dtype)
        mask = apply_window(target.model.config, mask, pos, batch_key_positions(lens, start, width))
        ver = target(torch.cat([roots[:, None], drafts], dim=1), layer_ids=layer_ids, attention_mask=mask,
                     position_ids=pos, cache=cache, use_cache=True)
        if sampling.greedy:
            n, nxt = verify.greedy_accept_chain_batch(drafts, ver.logits)
        else:
            n, nxt = verify.speculative_sample_chain_batch(drafts, q, sampling.probs(ver.logits), sampling.generator)
        n_eff = torch.minimum(n, k_b)
        # a row that accepted its padding emits the pad (a draw from p at that position), else the verifier's token
        last = torch.where(n > k_b, torch.full_like(nxt, pad_id), nxt)
        keep = lens + 1 + n_eff
        commit_kv_rows(cache, lens, start, width, keep)
        t = device_time(device)
        verify_s += t - t_drafted

        n_list, last_list, draft_list = n_eff.tolist(), last.tolist(), drafts.tolist()
        still = []
        for a, b in enumerate(active):
            na = n_list[a]
            new = draft_list[a][:na] + [last_list[a]]
            proposers[b].accept(torch.tensor([new], device=device), {k: v[a : a + 1, : na + 1]
                                                                      for k, v in ver.hidden.items()})
            r = res[b]
            r.target_forwards += 1
            r.accepted.append(na)
            r.drafted.append(props[a].size)
            r._count(min(na + 1, props[a].size), na)
            if eos_id is not None and eos_id in new:
                new = new[: new.index(eos_id) + 1]
                done[b] = True
            outs[b].extend(new)
            if len(outs[b]) >= max_new_tokens:
                done[b] = True
            if not done[b]:
                still.append(a)
        draft_s += device_time(device) - t
        if len(still) < len(active):
            idx = torch.tensor(still, dtype=torch.long, device=device)
            if still:
                cache.batch_select_indices(idx)
            keep, last = keep[idx], last[idx]
            active = [active[a] for a in still]
        lens, roots = keep, last
    total = device_time(device) - t0
    for b, r in enumerate(res):
        r.tokens = outs[b]
        r.stop = "eos" if eos_id is not None and outs[b][-1] == eos_id else "length"
        r.draft_s, r.verify_s, r.total_s = draft_s, verify_s, total
    return res


def decode_ar_batch(
    target: FrozenTarget,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
) -> list[DecodeResult]:
    """Batched autoregressive baseline: the batched engine with empty drafts (one token per row per forward)."""
    return speculative_decode_batch(target, [_NoDraft() for _ in prompts], prompts, max_new_tokens, temperature,
                                    top_p, top_k, generator, eos_id)
