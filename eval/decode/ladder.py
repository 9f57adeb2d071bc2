"""The decoding ladder: every step takes a batch dimension; ``speculative_decode`` is its B=1 call.

    new_cache → prefill → sample_token                      (the first token of every row)
    per round, for the A active rows:
        proposer.propose(budgets) → one Proposal per row (chain, or tree with parents; rows may differ)
        verify_inputs / verify_forward: ONE target forward over [root + drafted nodes] per row, right-padded
            to the widest row; positions lens[a] + depth; a 4D mask when any row needs one (a tree, or a row
            whose cache holds padding past its valid prefix): row a sees its own valid prefix [0, lens[a]),
            its root, and its nodes' ancestors (chains: causal)
        accept: models/core/verify.py — chains of several rows: the batched chain rules in one call (padding: see
            ``accept``); sampled trees sharing one topology: the batched tree rule in one call; otherwise (one
            row, trees of different shapes, greedy trees) the B=1 rules per row (``accept_proposal``)
        commit_kv: per row, move [root, accepted nodes] to lens[a].. and crop to the longest row
        proposer.accept(new tokens, the target's hidden states for them); finished rows leave the batch

The cache is shared by the rows: row a's valid entries are [0, lens[a]) and anything up to the cache length
is garbage hidden by the mask. At B=1 the cache never holds padding, chains get no mask (plain causal), and the
proposer (``PerRowProposers``) receives exactly the tensors of the historical B=1 engine, so results are
unchanged. Context bookkeeping (what ``begin`` / ``accept`` receive): eval/decode/single.py's docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from eval.decode.result import DecodeResult, check_prompt, check_proposal, device_time
from eval.decode.window import apply_window, full_cache
from models.core import verify
from models.core.proposal import MAX_TREE_NODES, BatchProposer, Proposal, Sampling, right_pad
from models.core.static_kv import StaticKV
from models.core.target import FrozenTarget, TargetOutput
from models.core.tree import tree_layout

__all__ = ["new_cache", "prefill", "sample_token", "batch_mask", "verify_inputs", "verify_forward",
           "accept_proposal", "accept", "commit_kv", "accepted_hidden", "decode"]


# --------------------------------------------------------------------------------------------- basic steps
def new_cache(target: FrozenTarget, rows: int = 1, need: int = 0) -> DynamicCache | StaticKV:
    """An empty KV cache for ``rows`` sequences of up to ``need`` tokens each. One row of a target with a static step
    (``FrozenTarget.use_static``): a ``StaticKV`` over the compiled step (models/core/static_kv.py). Otherwise a
    transformers DynamicCache whose every layer keeps every entry, sliding ones included, so rejected drafts can be
    cropped (eval/decode/window.py)."""
    if target.static is not None and rows == 1:
        return target.static.new_cache(need)
    return full_cache()


def prefill(target: FrozenTarget, prompts: Sequence[Tensor], cache: DynamicCache, layer_ids: Sequence[int] = (),
            pad_id: int = 0) -> tuple[TargetOutput, Tensor, Tensor]:
    """Run the prompts (row b: [P_b]) through the target into ``cache``, right-padded when ragged (the padding
    sits past each row's length and is never visible afterwards). Returns (output with hidden {id: [B, P, H]},
    lens [B] = P_b, the logits after each row's last prompt token [B, V])."""
    ids, lens = right_pad(list(prompts), pad_id)
    if bool((lens == ids.shape[1]).all()):  # no padding: plain causal attention, only the last logits
        out = target(ids, layer_ids=layer_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out, lens, out.logits[:, -1]
    attn = (torch.arange(ids.shape[1], device=ids.device)[None] < lens[:, None]).long()
    out = target(ids, layer_ids=layer_ids, attention_mask=attn, cache=cache, use_cache=True)
    return out, lens, out.logits[torch.arange(len(prompts), device=ids.device), lens - 1]


def sample_token(logits: Tensor, sampling: Sampling) -> Tensor:
    """logits [B, V] → next token [B] (argmax at temperature 0, else a draw from the processed distribution)."""
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(sampling.probs(logits), 1, generator=sampling.generator).squeeze(-1)


# --------------------------------------------------------------------------------------------- verification
def additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """bool [A, Q, K] (True = visible) → additive mask [A, 1, Q, K] (0 / dtype-min)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min)[:, None]


def batch_mask(lens: Tensor, start: int, width: int, dtype: torch.dtype) -> Tensor:
    """[A, 1, width, start+width] additive mask for chains: row a's queries see its valid prefix [0, lens[a]) and
    the new entries causally (key start+j visible to query i when j <= i)."""
    causal = torch.ones(width, width, dtype=torch.bool, device=lens.device).tril()
    return additive(row_visibility(lens, start, causal.expand(lens.shape[0], -1, -1)), dtype)


def row_visibility(lens: Tensor, start: int, new: Tensor) -> Tensor:
    """[A, W, start+W] bool: prefix keys c < lens[a], then ``new`` [A, W, W] over the W new entries."""
    keys = torch.arange(start, device=lens.device)
    prefix = (keys[None, None, :] < lens[:, None, None]).expand(-1, new.shape[1], -1)
    return torch.cat([prefix, new], dim=2)


def node_visibility(prop: Proposal, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """One row's (depth [W] of root + nodes + padding, visibility [W, W] among them). Chains (and padding
    after a chain) are causal at depths 0..W-1; a tree's nodes see the root, their ancestors and themselves,
    its padding the root and itself."""
    if prop.is_chain:
        return torch.arange(width, device=device), torch.ones(width, width, dtype=torch.bool, device=device).tril()
    depth, anc = prop.depth, prop.ancestors
    if depth is None or anc is None:
        depth, anc = tree_layout(prop.parents.to(device))
    n = prop.size
    d = torch.zeros(width, dtype=torch.long, device=device)
    d[1 : n + 1] = depth.to(device)
    vis = torch.eye(width, dtype=torch.bool, device=device)
    vis[:, 0] = True
    vis[1 : n + 1, 1 : n + 1] = anc.to(device)
    return d, vis


def verify_inputs(roots: Tensor, props: Sequence[Proposal], lens: Tensor, start: int, dtype: torch.dtype,
                  pad_id: int = 0, lens_host: Sequence[int] | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Inputs of the verification forward over [root + N_a nodes] per row, right-padded to W = 1 + max N_a.

    roots [A] (each row's newest token), lens [A] (each row's valid cache entries), start = the cache length.
    Returns input_ids [A, W], position_ids [A, W] (lens[a] + depth, root depth 0) and the additive 4D mask
    [A, 1, W, start+W] (0 = visible, dtype-min = hidden; ``row_visibility``), or None when plain causal attention
    is exact: chains only and no row with padding in the cache (always the case at B=1 for chains). ``lens_host``:
    the same lengths as host ints, when the caller keeps them (the decode loop does), so that choosing the mask does
    not make the host wait for the device.
    """
    device = roots.device
    width = 1 + max((p.size for p in props), default=0)
    ids = torch.full((len(props), width), pad_id, dtype=torch.long, device=device)
    ids[:, 0] = roots
    for a, p in enumerate(props):
        ids[a, 1 : p.size + 1] = p.tokens.to(device)
    layout = [node_visibility(p, width, device) for p in props]
    pos = lens[:, None] + torch.stack([d for d, _ in layout])
    uniform = all(n == start for n in lens_host) if lens_host is not None else bool((lens == start).all())
    if all(p.is_chain for p in props) and uniform:
        return ids, pos, None
    return ids, pos, additive(row_visibility(lens, start, torch.stack([v for _, v in layout])), dtype)


def verify_forward(target: FrozenTarget, cache: DynamicCache, roots: Tensor, props: Sequence[Proposal],
                   lens: Tensor, layer_ids: Sequence[int] = (), pad_id: int = 0,
                   lens_host: Sequence[int] | None = None) -> TargetOutput:
    """ONE target forward over every row's [root + drafted nodes] on top of ``cache`` (which then also holds
    their KV at start..start+W-1). logits [A, W, V]: row a's entry 0 follows its root, entry j+1 its node j."""
    start = cache.get_seq_length()
    ids, pos, mask = verify_inputs(roots, props, lens, start, target.model.dtype, pad_id, lens_host)
    if mask is not None:  # a custom mask must carry a sliding window itself (eval/decode/window.py)
        k_pos = torch.cat([torch.arange(start, device=pos.device).expand(pos.shape[0], -1), pos], dim=1)
        mask = apply_window(target.model.config, mask, pos, k_pos)
    return target(ids, layer_ids=layer_ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)


# --------------------------------------------------------------------------------------------- acceptance
def accept_proposal(proposal: Proposal, logits: Tensor, sampling: Sampling) -> tuple[list[int], int]:
    """The B=1 rules (models/core/verify.py): logits [N+1, V] → (accepted node indices root→leaf, next token)."""
    toks = proposal.tokens.to(logits.device)
    if sampling.greedy:
        if proposal.is_chain:
            n, nxt = verify.greedy_accept_chain(toks, logits)
            return list(range(n)), nxt
        return verify.greedy_accept_tree(toks, proposal.parents, logits)
    p = sampling.probs(logits)  # [N+1, V]
    q = proposal.q
    if q is not None and q.shape != (proposal.size, p.shape[-1]):
        raise ValueError(f"proposal q has shape {tuple(q.shape)}, expected [N, V] = [{proposal.size}, {p.shape[-1]}] "
                         "(draft probabilities over the target vocabulary)")
    if proposal.is_chain:
        if q is None:  # deterministic drafts: q is a point mass on each drafted token
            q = F.one_hot(toks, p.shape[-1]).to(p.dtype)
        n, nxt = verify.speculative_sample_chain(toks, q.to(p.device), p, sampling.generator)
        return list(range(n)), nxt
    return verify.speculative_sample_tree(toks, proposal.parents, None if q is None else q.to(p.device), p,
                                          sampling.generator, deterministic=q is None)


def accept(props: Sequence[Proposal], logits: Tensor, sampling: Sampling,
           pad_id: int = 0) -> list[tuple[list[int], int]]:
    """Per row (accepted node indices, next token) from logits [A, W, V].

    Sampled trees sharing one topology (same parents, all sampled or all deterministic drafts): one call of
    ``speculative_sample_tree_batch``. One row, or other trees: ``accept_proposal`` per row on its unpadded
    logits. Chains of several rows: one call of
    the batched chain rules on the drafts right-padded with ``pad_id`` (q = a point mass on the pad). A row whose
    pad at position k_a was accepted stops there: the pad *is* that position's token — a draw from p (accept
    w.p. p(pad), else the residual p − δ_pad) — so truncating keeps the output exact.
    """
    if len(props) > 1 and shared_sampled_tree(props, sampling):
        return accept_tree_batch(props, logits, sampling)
    if len(props) == 1 or not all(p.is_chain for p in props):
        return [accept_proposal(p, logits[a, : p.size + 1], sampling) for a, p in enumerate(props)]
    device = logits.device
    k = torch.tensor([p.size for p in props], device=device)
    drafts = torch.full((len(props), logits.shape[1] - 1), pad_id, dtype=torch.long, device=device)
    for a, p in enumerate(props):
        drafts[a, : p.size] = p.tokens.to(device)
    if sampling.greedy:
        n, nxt = verify.greedy_accept_chain_batch(drafts, logits)
    else:
        q = F.one_hot(drafts, logits.shape[-1]).float()  # point masses for deterministic drafts and the padding
        for a, p in enumerate(props):
            if p.q is not None:
                q[a, : p.size] = p.q.to(device=device, dtype=q.dtype)
        n, nxt = verify.speculative_sample_chain_batch(drafts, q, sampling.probs(logits), sampling.generator)
    last = torch.where(n > k, torch.full_like(nxt, pad_id), nxt)
    return [(list(range(na)), la) for na, la in zip(torch.minimum(n, k).tolist(), last.tolist())]


def shared_sampled_tree(props: Sequence[Proposal], sampling: Sampling) -> bool:
    """Whether the rows' proposals are sampled-mode trees of one topology the batched tree rule can take."""
    p0 = props[0]
    if sampling.greedy or p0.is_chain or p0.size == 0:
        return False
    return all(not p.is_chain and p.size == p0.size and (p.q is None) == (p0.q is None)
               and torch.equal(p.parents.cpu(), p0.parents.cpu()) for p in props)


def accept_tree_batch(props: Sequence[Proposal], logits: Tensor, sampling: Sampling) -> list[tuple[list[int], int]]:
    """Trees of one topology, every row in one call of models/core/verify.py's batched tree rule."""
    device = logits.device
    toks = torch.stack([p.tokens.to(device) for p in props])
    p = sampling.probs(logits)  # [A, N+1, V]
    q = None if props[0].q is None else torch.stack([x.q.to(device=device, dtype=p.dtype) for x in props])
    path, n, nxt = verify.speculative_sample_tree_batch(toks, props[0].parents, q, p, sampling.generator,
                                                        deterministic=q is None)
    return [(pa[:na], x) for pa, na, x in zip(path.tolist(), n.tolist(), nxt.tolist())]


# --------------------------------------------------------------------------------------------- bookkeeping
def commit_kv(cache: DynamicCache, lens: Tensor, start: int, paths: Sequence[list[int]],
              lens_host: Sequence[int] | None = None) -> Tensor:
    """Keep [valid prefix, root, accepted nodes] per row after a verification forward written at ``start``.

    Row a's root sits at start, its node j at start+1+j; they move to lens[a], lens[a]+1, ... (entries already
    in place — every B=1 chain — are not touched), then the cache is cropped to the longest row. Returns the
    rows' new valid lengths lens + 1 + len(path). ``lens_host``: ``lens`` as host ints (no device read)."""
    device = lens.device
    lens_host = lens.tolist() if lens_host is None else list(lens_host)
    rows, src, dst = [], [], []
    for a, (n0, path) in enumerate(zip(lens_host, paths)):
        s = [start, *(start + 1 + j for j in path)]
        if s != list(range(n0, n0 + len(s))):
            rows += [a] * len(s)
            src += s
            dst += range(n0, n0 + len(s))
    if rows:
        idx = [torch.tensor(x, dtype=torch.long) for x in (rows, src, dst)]
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            r, s, d = (x.to(layer.keys.device) for x in idx)
            if len(paths) == 1:  # one row: a contiguous destination, one index_select per tensor (cheaper)
                lo, hi = dst[0], dst[-1] + 1
                layer.keys[..., lo:hi, :] = layer.keys.index_select(-2, s)
                layer.values[..., lo:hi, :] = layer.values.index_select(-2, s)
                continue
            layer.keys[r, :, d] = layer.keys[r, :, s]  # the RHS is a copy: overlapping ranges are safe
            layer.values[r, :, d] = layer.values[r, :, s]
    keep = lens + 1 + torch.tensor([len(p) for p in paths], dtype=torch.long, device=device)
    drop = cache.get_seq_length() - max(n0 + 1 + len(p) for n0, p in zip(lens_host, paths))
    if drop > 0:
        cache.crop(-drop)
    return keep


def accepted_hidden(hidden: dict[int, Tensor], paths: Sequence[list[int]]) -> dict[int, Tensor]:
    """{id: [A, W, H]} of a verification forward → {id: [A, R, H]}: row a's first 1 + len(path) rows are the
    states of its root and accepted nodes (the tokens before its new ones), right-padded to R."""
    if not hidden:
        return {}
    r = 1 + max(len(p) for p in paths)
    idx = torch.zeros(len(paths), r, dtype=torch.long)
    for a, p in enumerate(paths):
        idx[a, 1 : len(p) + 1] = torch.tensor(p, dtype=torch.long) + 1
    out = {}
    for k, v in hidden.items():
        i = idx.to(v.device)
        out[k] = v.gather(1, i[:, :, None].expand(-1, -1, v.shape[-1])) if len(paths) > 1 else v.index_select(1, i[0])
    return out


# --------------------------------------------------------------------------------------------- the loop
class Rows:
    """The active rows between rounds: their original indices, valid cache lengths and newest tokens."""

    def __init__(self, ids: list[int], lens: Tensor, roots: Tensor):
        self.ids, self.lens, self.roots = ids, lens, roots
        self.lens_host = lens.tolist()  # the same lengths on the host: a round reads these, never the device's

    def advance(self, keep: Tensor, paths: Sequence[list[int]], roots: Tensor) -> None:
        """After a round: each row's valid length grew by its root and accepted nodes; ``roots`` are the new ones."""
        self.lens, self.roots = keep, roots
        self.lens_host = [n + 1 + len(p) for n, p in zip(self.lens_host, paths)]

    def retain(self, keep: list[int], cache: DynamicCache, proposer: BatchProposer) -> None:
        """Only the rows ``keep`` (indices into the active rows) go on: cache, proposer and state follow."""
        if len(keep) == len(self.ids):
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.lens.device)
        if keep:
            cache.batch_select_indices(idx)
            proposer.retain(keep)
        self.ids = [self.ids[a] for a in keep]
        self.lens, self.roots = self.lens[idx], self.roots[idx]
        self.lens_host = [self.lens_host[a] for a in keep]


def finished(out: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
    return len(out) >= max_new_tokens or (eos_id is not None and out[-1] == eos_id)


def emit(out: list[int], new: list[int], eos_id: int | None) -> None:
    """Append a round's new tokens, up to and including an eos."""
    if eos_id is not None and eos_id in new:
        new = new[: new.index(eos_id) + 1]
    out.extend(new)


def verify_round(target: FrozenTarget, cache: DynamicCache, act: Rows, props: Sequence[Proposal], sampling: Sampling,
                 layer_ids: Sequence[int], pad_id: int, device: torch.device
                 ) -> tuple[list[list[int]], list[int], Tensor, dict[int, Tensor], list[Tensor]]:
    """A round's verification half, split from ``decode`` (timed there as one span): ONE target forward over every
    active row's [root + drafts], acceptance, KV commit. Returns (accepted paths, next tokens, the rows' new valid
    lengths, the target's hidden states for the accepted tokens, each row's new tokens = accepted drafts + next)."""
    start = cache.get_seq_length()
    ver = verify_forward(target, cache, act.roots, props, act.lens, layer_ids, pad_id, act.lens_host)
    picked = accept(props, ver.logits, sampling, pad_id)
    paths = [path for path, _ in picked]
    keep = commit_kv(cache, act.lens, start, paths, act.lens_host)
    hidden = accepted_hidden(ver.hidden, paths)
    new = [torch.cat([p.tokens[path].to(device), torch.tensor([nxt], device=device)])
           for p, (path, nxt) in zip(props, picked)]
    return paths, [nxt for _, nxt in picked], keep, hidden, new


@torch.no_grad()
def decode(target: FrozenTarget, proposer: BatchProposer, prompts: Sequence[Tensor], max_new_tokens: int,
           sampling: Sampling, eos_id: int | None = None, pad_id: int = 0,
           max_nodes: int = MAX_TREE_NODES) -> list[DecodeResult]:
    """Lossless speculative decoding of B prompts (any lengths) with one batched proposer: the ladder above.

    Each round drafts at most ``max_new_tokens - generated - 1`` tokens deep per row (a round emits accepted + 1),
    so no row overshoots. Each row's result counts the rounds it took part in; timings are the batch's (shared).
    """
    if not prompts:
        raise ValueError("need at least one prompt")
    rows_in = [check_prompt(p, max_new_tokens)[0] for p in prompts]
    device = rows_in[0].device
    layer_ids = list(proposer.layer_ids)
    res = [DecodeResult(tokens=[]) for _ in rows_in]

    t0 = device_time(device)
    cache = new_cache(target, len(rows_in), max(len(r) for r in rows_in) + max_new_tokens + max_nodes + 1)
    pre, lens, logits = prefill(target, rows_in, cache, layer_ids, pad_id)
    roots = sample_token(logits, sampling)  # [B]: each row's newest token, not yet through the target
    t = device_time(device)
    prefill_s = t - t0
    outs = [[x] for x in roots.tolist()]
    proposer.begin([torch.cat([r, roots[b : b + 1]]) for b, r in enumerate(rows_in)], pre.hidden, sampling)
    draft_s, verify_s = device_time(device) - t, 0.0
    act = Rows(list(range(len(rows_in))), lens, roots)
    act.retain([a for a, b in enumerate(act.ids) if not finished(outs[b], max_new_tokens, eos_id)], cache, proposer)

    while act.ids:
        t = device_time(device)
        budgets = [max_new_tokens - len(outs[b]) - 1 for b in act.ids]
        props = proposer.propose(budgets)
        for p, budget in zip(props, budgets):
            check_proposal(p, budget, max_nodes)
        t_drafted = device_time(device)
        draft_s += t_drafted - t

        paths, nxts, keep, hidden, new = verify_round(target, cache, act, props, sampling, layer_ids, pad_id, device)
        t = device_time(device)
        verify_s += t - t_drafted

        proposer.accept(new, hidden)
        draft_s += device_time(device) - t
        for b, p, path, toks in zip(act.ids, props, paths, new):
            res[b].record_round(p, path)
            emit(outs[b], toks.tolist(), eos_id)
        act.advance(keep, paths, torch.tensor(nxts, device=device))
        act.retain([a for a, b in enumerate(act.ids) if not finished(outs[b], max_new_tokens, eos_id)], cache,
                   proposer)

    total = device_time(device) - t0
    for r, out in zip(res, outs):
        r.tokens, r.target_forwards = out, r.target_forwards + 1  # + the prefill forward
        r.stop = "eos" if eos_id is not None and out[-1] == eos_id else "length"
        r.prefill_s, r.draft_s, r.verify_s, r.total_s = prefill_s, draft_s, verify_s, total
    return res

