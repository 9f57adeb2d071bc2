"""Verification of drafted tokens against the target: the one module every draft method shares.

Pure tensor functions, no model code. Two families:

* **Greedy** (temperature 0): accept the longest drafted prefix / root-to-node path whose tokens
  equal the target's argmax at their parent, then append the target's argmax at the break (the
  "bonus" token when everything was accepted). Tokens per target forward τ = accepted + 1.
* **Speculative (rejection) sampling**, lossless for any draft distribution q:
  chain — Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
  Algorithm 1) and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling",
  Algorithm 2); tree — SpecInfer (Miao et al. 2023, "multi-step speculative sampling")
  for sampled siblings, and the point-mass special case of the same rule for deterministic top-k
  siblings (as used by EAGLE / Medusa trees).

Conventions (shared with the decoders):

* ``p`` are target probabilities and ``q`` draft probabilities, both produced by
  :func:`sampling_probs` with the *same* temperature / top-k / top-p; losslessness is with respect
  to that processed target distribution.
* Trees are given as ``parents[j]`` = index of node j's parent, ``-1`` for children of the root,
  with nodes in topological order (``parents[j] < j``). Target rows are ``N + 1``: row 0 is the
  root (the last accepted token, i.e. the distribution of the first new token) and row ``j + 1``
  is node j (the distribution of node j's children, or of the bonus token after node j).
* Siblings are tried in node-index order.

Greedy functions take no generator; sampling functions draw every random number from the passed
``torch.Generator`` so a run is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from models.core.tree import tree_layout

__all__ = [
    "sampling_probs",
    "residual_probs",
    "tree_children",
    "greedy_accept_chain",
    "greedy_accept_chain_batch",
    "greedy_accept_tree",
    "speculative_sample_chain",
    "speculative_sample_chain_batch",
    "speculative_sample_tree",
    "speculative_sample_tree_batch",
]


# --------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------
def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Probabilities after temperature, then top-k, then top-p (the order HF ``generate`` uses).

    ``logits`` [..., V] → probabilities [..., V] (float32, or float64 for float64 input).
    ``temperature == 0`` means greedy: a one-hot at the argmax (first index on ties), and top-k /
    top-p are irrelevant. ``top_k == 0`` disables top-k (ties with the k-th logit are kept);
    ``top_p == 1`` disables top-p, otherwise the smallest most-probable set whose mass reaches
    ``top_p`` is kept (always at least one token). Apply it identically to target and draft.
    """
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0 = disabled), got {top_k}")
    top_k = int(top_k)
    x = logits if logits.dtype == torch.float64 else logits.float()
    vocab = x.shape[-1]
    if temperature == 0:
        return F.one_hot(x.argmax(-1), vocab).to(x.dtype)
    x = x / temperature
    if 0 < top_k < vocab:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more probable tokens
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def residual_probs(p: Tensor, q: Tensor) -> Tensor:
    """p'(x) = norm(max(0, p(x) − q(x))) over the last dim (Leviathan et al. 2023 §2.3; Chen et al. 2023 Alg. 2).

    Where the residual has no mass (p ≤ q everywhere, i.e. p == q, so a rejection had probability
    0 and only happens through rounding) ``p`` itself is returned.
    """
    res = (p - q).clamp_min(0)
    total = res.sum(-1, keepdim=True)
    return torch.where(total > 0, res / total.clamp_min(torch.finfo(res.dtype).tiny), p)


# --------------------------------------------------------------------------------------------
# Tree helpers
# --------------------------------------------------------------------------------------------
def _parents_list(parents: Tensor | Sequence[int]) -> list[int]:
    par = parents.tolist() if isinstance(parents, Tensor) else [int(x) for x in parents]
    for j, pj in enumerate(par):
        if not -1 <= pj < j:
            raise ValueError(f"parents[{j}] = {pj}: nodes must be topologically ordered (-1 <= parent < index)")
    return par


def tree_children(parents: Tensor | Sequence[int]) -> list[list[int]]:
    """Children lists in node order: entry 0 is the root's children, entry ``j + 1`` node j's."""
    par = _parents_list(parents)
    children: list[list[int]] = [[] for _ in range(len(par) + 1)]
    for j, pj in enumerate(par):
        children[pj + 1].append(j)
    return children


def _as_float(x: Tensor) -> Tensor:
    """Probabilities in at least float32 (uniform draws and multinomial in bf16/fp16 are too coarse)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------
def greedy_accept_chain_batch(draft_tokens: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy chain verification of B sequences.

    ``draft_tokens`` [B, K] (int), ``target_logits`` [B, K+1, V] where row i scores the token
    after draft token i-1 (row 0 follows the last accepted token). Returns ``n_accepted`` [B]
    (longest prefix with draft_i == argmax_i) and ``next_token`` [B] = argmax at row n_accepted
    (the bonus token when n_accepted == K).
    """
    if draft_tokens.dim() != 2 or target_logits.dim() != 3:
        raise ValueError(f"expected draft [B, K] and logits [B, K+1, V], got {tuple(draft_tokens.shape)} "
                         f"and {tuple(target_logits.shape)}")
    b, k = draft_tokens.shape
    if target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [B, K+1, V] = [{b}, {k + 1}, V], got {tuple(target_logits.shape)}")
    best = target_logits.argmax(-1)  # [B, K+1]
    match = draft_tokens == best[:, :k]
    n_accepted = match.long().cumprod(1).sum(1)  # length of the all-true prefix
    next_token = best.gather(1, n_accepted[:, None]).squeeze(1)
    return n_accepted, next_token


def greedy_accept_chain(draft_tokens: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """Greedy chain verification of one sequence: draft [K], target_logits [K+1, V] → (n_accepted, next_token)."""
    if draft_tokens.dim() != 1 or target_logits.dim() != 2:
        raise ValueError(f"expected draft [K] and logits [K+1, V], got {tuple(draft_tokens.shape)} "
                         f"and {tuple(target_logits.shape)}")
    n, nxt = greedy_accept_chain_batch(draft_tokens[None], target_logits[None])
    n, nxt = torch.stack([n[0], nxt[0]]).tolist()  # one host read, not two
    return n, nxt


def greedy_accept_tree(
    tree_tokens: Tensor, parents: Tensor | Sequence[int], target_logits: Tensor
) -> tuple[list[int], int]:
    """Greedy tree verification of one sequence.

    ``tree_tokens`` [N], ``parents`` [N] (-1 = child of the root, topologically ordered),
    ``target_logits`` [N+1, V] (row 0 = root, row j+1 = node j). A node is accepted when its
    token equals the target argmax at its parent and its parent is accepted. Returns the node
    indices of the longest accepted root-to-node path (root excluded; the lowest-index node wins a
    tie between equally deep paths, possible only with duplicate sibling tokens) and the target
    argmax after the path's last node (after the root when nothing is accepted).
    """
    par = _parents_list(parents)
    n = len(par)
    if tree_tokens.shape != (n,) or target_logits.dim() != 2 or target_logits.shape[0] != n + 1:
        raise ValueError(f"expected tree_tokens [N] and target_logits [N+1, V] with N = len(parents) = {n}, got "
                         f"{tuple(tree_tokens.shape)} and {tuple(target_logits.shape)}")
    best = target_logits.argmax(-1).tolist()
    toks = tree_tokens.tolist()
    ok = [False] * n
    depth = [0] * n
    deepest, deepest_depth = -1, 0
    for j, pj in enumerate(par):
        if (pj < 0 or ok[pj]) and toks[j] == best[pj + 1]:
            ok[j] = True
            depth[j] = 1 if pj < 0 else depth[pj] + 1
            if depth[j] > deepest_depth:
                deepest, deepest_depth = j, depth[j]
    path: list[int] = []
    node = deepest
    while node >= 0:
        path.append(node)
        node = par[node]
    path.reverse()
    return path, best[deepest + 1]


# --------------------------------------------------------------------------------------------
# Speculative sampling: chain
# --------------------------------------------------------------------------------------------
def speculative_sample_chain_batch(
    draft_tokens: Tensor, q: Tensor, p: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Speculative sampling of B chains (Leviathan et al. 2023 Alg. 1; Chen et al. 2023 Alg. 2).

    ``draft_tokens`` [B, K] with x_i ~ q_i; ``q`` [B, K, V] draft probabilities; ``p`` [B, K+1, V]
    target probabilities (row i conditioned on x_<i). x_i is accepted with probability
    min(1, p_i(x_i) / q_i(x_i)) — drawn as ``r · q_i(x_i) < p_i(x_i)`` with r ~ U[0, 1), so a token
    with p_i(x) = 0 is never accepted; the first rejection at i emits a sample of
    norm(max(0, p_i − q_i)); if all K are accepted the bonus is sampled from p_K.
    Returns ``n_accepted`` [B] and ``next_token`` [B].
    """
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got {tuple(draft_tokens.shape)}")
    b, k = draft_tokens.shape
    if p.dim() != 3 or p.shape[:2] != (b, k + 1) or q.shape != (b, k, p.shape[-1]):
        raise ValueError(f"expected q [B, K, V] and p [B, K+1, V] with B={b}, K={k}, got {tuple(q.shape)} "
                         f"and {tuple(p.shape)}")
    p, q = _as_float(p), _as_float(q)
    rows = torch.arange(b, device=p.device)
    idx = draft_tokens.long()[..., None]
    p_x = p[:, :k].gather(2, idx).squeeze(2)  # p_i(x_i), [B, K]
    q_x = q.gather(2, idx).squeeze(2)  # q_i(x_i)
    r = torch.rand(b, k, generator=generator, device=p.device, dtype=p.dtype)
    accepted = r * q_x < p_x  # P = min(1, p/q)
    n_accepted = accepted.long().cumprod(1).sum(1)
    # Row n_accepted: residual norm(max(0, p_n − q_n)) after a rejection; plain p_K for the bonus.
    p_n = p[rows, n_accepted]
    if k > 0:
        q_n = q[rows, n_accepted.clamp(max=k - 1)] * (n_accepted < k)[:, None]
    else:
        q_n = torch.zeros_like(p_n)
    dist = residual_probs(p_n, q_n)
    next_token = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return n_accepted, next_token


def speculative_sample_chain(
    draft_tokens: Tensor, q: Tensor, p: Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """One chain: draft [K], q [K, V], p [K+1, V] → (n_accepted, next_token). See the batch version."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be [K], got {tuple(draft_tokens.shape)}")
    n, nxt = speculative_sample_chain_batch(draft_tokens[None], q[None], p[None], generator)
    n, nxt = torch.stack([n[0], nxt[0]]).tolist()  # one host read, not two
    return n, nxt


# --------------------------------------------------------------------------------------------
# Speculative sampling: tree
# --------------------------------------------------------------------------------------------
def _tree_sampling_inputs(tree_tokens: Tensor, parents: Tensor | Sequence[int], q: Tensor | None, p: Tensor,
                          deterministic: bool) -> tuple[list[int], Tensor, Tensor | None]:
    """``speculative_sample_tree_batch``'s inputs checked and broadcast: (parents list, p [B, N+1, V], q [B, N, V]
    or None when deterministic)."""
    par = _parents_list(parents)
    n = len(par)
    if tree_tokens.dim() != 2 or tree_tokens.shape[1] != n:
        raise ValueError(f"tree_tokens must be [B, N] with N = len(parents) = {n}, got {tuple(tree_tokens.shape)}")
    b = tree_tokens.shape[0]
    p = _as_float(p)
    q = None if q is None else _as_float(q)
    if p.dim() == 2:
        p = p.unsqueeze(0).expand(b, -1, -1)
    if p.dim() != 3 or p.shape[:2] != (b, n + 1):
        raise ValueError(f"p must be [B, N+1, V] or [N+1, V] with B={b}, N={n}, got {tuple(p.shape)}")
    vocab = p.shape[-1]
    if not deterministic:
        if q is None:
            raise ValueError("q is required for sampled drafts (deterministic=False)")
        if q.dim() == 2:
            q = q.unsqueeze(0).expand(b, -1, -1)
        if q.shape != (b, n, vocab):
            raise ValueError(f"q must be [B, N, V] or [N, V] with B={b}, N={n}, V={vocab}, got {tuple(q.shape)}")
    return par, p, q


def _child_table(par: list[int], device: torch.device) -> tuple[Tensor, int, int]:
    """(table [N+1, W]: row r = the children of node r-1 (row 0: the root's), -1 padded; W; the tree depth)."""
    children = tree_children(par)
    width = max((len(c) for c in children), default=0)
    depth = int(tree_layout(torch.tensor(par, dtype=torch.long))[0].max()) if par else 0
    table = torch.full((len(par) + 1, max(width, 1)), -1, dtype=torch.long, device=device)
    for row, kids in enumerate(children):
        if kids:
            table[row, : len(kids)] = torch.tensor(kids, dtype=torch.long, device=device)
    return table, width, depth


def speculative_sample_tree_batch(
    tree_tokens: Tensor,
    parents: Tensor | Sequence[int],
    q: Tensor | None,
    p: Tensor,
    generator: torch.Generator,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree rejection sampling for B trees sharing one topology (SpecInfer's multi-step speculative sampling).

    Shapes: ``tree_tokens`` [B, N]; ``parents`` [N] (-1 = child of the root, parents[j] < j);
    ``p`` [B, N+1, V] or [N+1, V] target probabilities (row 0 = root, row j+1 = after node j);
    ``q`` [B, N, V] or [N, V]: row j is the draft distribution node j's token was sampled from
    (siblings drawn i.i.d. from one distribution share the same row); ignored when
    ``deterministic``.

    Walk from the root; at the current node keep a working target distribution p' (initially the
    node's target row) and try its children c in index order:

    * sampled drafts (``deterministic=False``; each child drawn independently from its q row):
      accept with probability min(1, p'(c) / q(c)); on rejection p' ← norm(max(0, p' − q)).
    * deterministic drafts (``deterministic=True``; e.g. top-k children, q a point mass on c):
      the same rule with q = δ_c, i.e. accept with probability p'(c); on rejection
      p'(c) ← 0 and renormalise.

    On acceptance move to c (p' ← c's target row); if every child is rejected, or the node is a
    leaf, sample the next token from p'. Both variants emit tokens distributed exactly as p.

    Returns ``path`` [B, D] (accepted node index at depth 1..D, -1 padded; D = tree depth),
    ``n_accepted`` [B] and ``next_token`` [B].
    """
    par, p, q = _tree_sampling_inputs(tree_tokens, parents, q, p, deterministic)
    b, vocab, device = tree_tokens.shape[0], p.shape[-1], p.device
    table, width, depth = _child_table(par, device)
    rows = torch.arange(b, device=device)
    toks = tree_tokens.long()
    cur = torch.full((b,), -1, dtype=torch.long, device=device)  # current node, -1 = root
    done = torch.zeros(b, dtype=torch.bool, device=device)
    n_accepted = torch.zeros(b, dtype=torch.long, device=device)
    path = torch.full((b, depth), -1, dtype=torch.long, device=device)
    work = p[:, 0].clone()  # p' at the current node
    for d in range(depth):
        moved = torch.zeros(b, dtype=torch.bool, device=device)
        for s in range(width):
            child = table[cur + 1, s]
            active = ~done & ~moved & (child >= 0)
            if not bool(active.any()):
                break  # children are packed left, so no trial has a child in a later slot
            c = child.clamp_min(0)
            tok = toks[rows, c]
            q_row = F.one_hot(tok, vocab).to(work.dtype) if deterministic else q[rows, c]
            p_c = work.gather(1, tok[:, None]).squeeze(1)
            q_c = q_row.gather(1, tok[:, None]).squeeze(1)
            r = torch.rand(b, generator=generator, device=device, dtype=work.dtype)
            acc = active & (r * q_c < p_c)  # P = min(1, p'(c) / q(c))
            rej = active & ~acc
            work = torch.where(rej[:, None], residual_probs(work, q_row), work)  # p' ← norm(max(0, p' − q))
            path[:, d] = torch.where(acc, c, path[:, d])
            cur = torch.where(acc, c, cur)
            moved |= acc
        n_accepted += moved.long()
        done |= ~moved
        work = torch.where(moved[:, None], p[rows, cur + 1], work)
        if bool(done.all()):
            break
    next_token = torch.multinomial(work, 1, generator=generator).squeeze(1)
    return path, n_accepted, next_token


def speculative_sample_tree(
    tree_tokens: Tensor,
    parents: Tensor | Sequence[int],
    q: Tensor | None,
    p: Tensor,
    generator: torch.Generator,
    deterministic: bool = False,
) -> tuple[list[int], int]:
    """One tree: tree_tokens [N], parents [N], q [N, V] (or None if deterministic), p [N+1, V].

    Returns (accepted node indices root→leaf, next_token). See :func:`speculative_sample_tree_batch`.
    """
    if tree_tokens.dim() != 1:
        raise ValueError(f"tree_tokens must be [N], got {tuple(tree_tokens.shape)}")
    if p.dim() != 2:
        raise ValueError(f"p must be [N+1, V], got {tuple(p.shape)}")
    if q is not None and not deterministic and q.dim() != 2:
        raise ValueError(f"q must be [N, V], got {tuple(q.shape)}")
    path, n, nxt = speculative_sample_tree_batch(tree_tokens[None], parents, q, p, generator, deterministic)
    return path[0, : int(n[0])].tolist(), int(nxt[0])
