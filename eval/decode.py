"""Decoding engine for the frozen target: plain autoregressive decoding and lossless speculative decoding.

A ladder of small functions (gpt-fast style):

    new_cache → prefill → sample_token                         (both decoders)
    decode_ar: prefill, then one token per target forward       (the baseline)
    speculative_decode, per round:
        proposer.propose → Proposal (chain, or tree with parents)
        verify_inputs / verify_forward: ONE target forward over [last accepted token (root) + drafted nodes]
            with positions prefix_len + depth and, for trees, a 4D mask over [prefix + tree] (nodes see
            the prefix, the root, their ancestors and themselves)
        accept_proposal: models/verify.py (greedy at temperature 0, speculative sampling otherwise; trees with
            deterministic drafts use the point-mass rule, sampled drafts the residual rule)
        commit_kv: keep only the accepted path's KV entries (chain: crop; tree: gather into place, crop)
        proposer.accept(new tokens, the target's hidden states for them)

Context bookkeeping shared with the proposers (models/<method>.py): the context is x_0..x_m where x_m, the
newest token, has not been through the target yet (it is the root of the next verification); the target's
KV cache and hidden states cover x_0..x_{m-1}. ``begin`` receives the prompt plus the first generated token
and the prompt's hidden states; each ``accept`` receives the round's r new tokens (accepted drafts + the
target's next token) and the target's hidden states for the r tokens *before* them (old root + accepted
drafts), i.e. always exactly one hidden row per new token.

τ (tokens per target forward, bonus included) = mean over verification rounds of (accepted + 1); the prefill
forward, which emits the first token, is counted in ``target_forwards`` but is not a round.
``speculative_decode_batch`` / ``decode_ar_batch`` run B sequences with one batched verification forward
per round (chains only): each row keeps its own B=1 proposer, drafts of different lengths are padded, and the
shared cache holds per-row valid lengths (right padding hidden by a 4D mask; accepted entries moved into place
per row, see ``commit_kv_rows``). They live in eval/decode_batch.py, which builds on this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from models import verify
from models.proposal import MAX_TREE_NODES, Proposal, Proposer, Sampling
from models.target import FrozenTarget, TargetOutput
from models.tree import tree_layout

__all__ = [
    "Sampling",
    "Proposal",
    "Proposer",
    "DecodeResult",
    "new_cache",
    "prefill",
    "sample_token",
    "decode_ar",
    "verify_inputs",
    "verify_forward",
    "accept_proposal",
    "commit_kv",
    "speculative_decode",
    "MAX_TREE_NODES",
]

@dataclass
class DecodeResult:
    """One decoded sequence and its accounting."""

    tokens: list[int]  # generated ids (prompt excluded), eos included when it stopped the run
    target_forwards: int = 0  # prefill + verification rounds
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per round (bonus excluded)
    drafted: list[int] = field(default_factory=list)  # drafted nodes per round
    pos_tries: list[int] = field(default_factory=list)  # [k]: rounds whose depth-k slot was tried
    pos_accepts: list[int] = field(default_factory=list)  # [k]: rounds that accepted a depth-(k+1) token
    prefill_s: float = 0.0
    draft_s: float = 0.0  # proposer time (propose + accept)
    verify_s: float = 0.0  # target verification forwards, acceptance and KV compaction
    total_s: float = 0.0
    stop: str = "length"  # "length" | "eos"

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per verification forward, bonus included (1.0 for autoregressive decoding)."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else float("nan")

    @property
    def acceptance_by_pos(self) -> list[float]:
        """P(draft at depth k+1 accepted | the round got that far and drafted something there)."""
        return [a / t if t else float("nan") for a, t in zip(self.pos_accepts, self.pos_tries)]

    def _count(self, depth_tried: int, n_accepted: int) -> None:
        """Record a round in which depths 1..depth_tried were tried (depth_tried <= n_accepted + 1)."""
        while len(self.pos_tries) < depth_tried:
            self.pos_tries.append(0)
            self.pos_accepts.append(0)
        for k in range(depth_tried):
            self.pos_tries[k] += 1
            self.pos_accepts[k] += int(k < n_accepted)


def device_time(device: torch.device) -> float:
    if device.type == "cuda":  # time device work, not kernel launches
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_prompt(prompt_ids: Tensor, max_new_tokens: int) -> Tensor:
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [T] or [1, T] with T >= 1, got {tuple(prompt_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return prompt_ids.long()


# --------------------------------------------------------------------------------------------- basic steps
def new_cache(target: FrozenTarget) -> DynamicCache:
    """An empty KV cache for the target (transformers DynamicCache, one layer per decoder layer). Every layer keeps
    every entry, sliding ones included, so rejected drafts can be cropped (eval/window.py)."""
    from eval.window import full_cache

    return full_cache()


def prefill(target: FrozenTarget, prompt_ids: Tensor, cache: DynamicCache, layer_ids: list[int] = ()) -> TargetOutput:
    """Run the prompt [1, P] through the target into ``cache``: logits of the last position [1, 1, V] and the
    requested hidden states for every prompt position {id: [1, P, H]}."""
    return target(prompt_ids, layer_ids=layer_ids, cache=cache, use_cache=True, logits_to_keep=1)


def sample_token(logits: Tensor, sampling: Sampling) -> Tensor:
    """logits [B, V] → next token [B] (argmax at temperature 0, else a draw from the processed distribution)."""
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(sampling.probs(logits), 1, generator=sampling.generator).squeeze(-1)


def decode_ar(
    target: FrozenTarget,
    prompt_ids: Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
) -> DecodeResult:
    """Plain autoregressive decoding with a KV cache: one target forward per token (the baseline)."""
    sampling = Sampling(temperature, top_p, top_k, generator)
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    device = prompt_ids.device
    res = DecodeResult(tokens=[])
    t0 = device_time(device)
    cache = new_cache(target)
    tok = sample_token(prefill(target, prompt_ids, cache).logits[:, -1], sampling)  # [1]
    res.prefill_s = device_time(device) - t0
    res.target_forwards = 1
    out = [tok]
    stop = eos_id is not None and int(tok) == eos_id
    while len(out) < max_new_tokens and not stop:
        logits = target(tok[:, None], cache=cache, use_cache=True).logits[:, -1]
        tok = sample_token(logits, sampling)
        out.append(tok)
        res.target_forwards += 1
        res.accepted.append(0)
        res.drafted.append(0)
        stop = eos_id is not None and int(tok) == eos_id  # the only sync, and only when an eos is given
    res.tokens = torch.cat(out).tolist()
    res.stop = "eos" if stop else "length"
    res.total_s = device_time(device) - t0
    res.verify_s = res.total_s - res.prefill_s
    return res


# --------------------------------------------------------------------------------------------- verification
def verify_inputs(
    root: Tensor, proposal: Proposal, prefix_len: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Inputs of the verification forward over [root + N nodes].

    root [1] (the newest token), prefix_len = tokens already in the target's cache. Returns input_ids
    [1, N+1], position_ids [1, N+1] (prefix_len + depth, root depth 0) and, for trees, the additive 4D mask
    [1, 1, N+1, prefix_len+N+1] (0 = visible, dtype-min = hidden): every row sees the prefix and the root,
    node rows also their ancestors and themselves. Chains need no mask (plain causal) → None.
    """
    device = root.device
    ids = torch.cat([root.view(1), proposal.tokens.to(device)])[None]
    n = proposal.size
    if proposal.is_chain:
        pos = torch.arange(prefix_len, prefix_len + n + 1, device=device)[None]
        return ids, pos, None
    depth, anc = proposal.depth, proposal.ancestors
    if depth is None or anc is None:
        depth, anc = tree_layout(proposal.parents.to(device))
    pos = prefix_len + torch.cat([torch.zeros(1, dtype=torch.long, device=device), depth.to(device)])[None]
    visible = torch.ones(n + 1, prefix_len + n + 1, dtype=torch.bool, device=device)
    visible[:, prefix_len + 1:] = False
    visible[1:, prefix_len + 1:] = anc.to(device)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return ids, pos, mask[None, None]


def verify_forward(
    target: FrozenTarget, cache: DynamicCache, root: Tensor, proposal: Proposal, layer_ids: list[int] = ()
) -> TargetOutput:
    """ONE target forward over [root + drafted nodes] on top of ``cache`` (which then also holds their KV).
    logits [1, N+1, V]: row 0 follows the root, row j+1 follows node j (models/verify.py's layout)."""
    prefix_len = cache.get_seq_length()
    ids, pos, mask = verify_inputs(root, proposal, prefix_len, target.model.dtype)
    if mask is not None:  # a tree: its custom mask must carry a sliding window itself (eval/window.py)
        from eval.window import apply_window

        k_pos = torch.cat([torch.arange(prefix_len, device=pos.device), pos[0]])[None]
        mask = apply_window(target.model.config, mask, pos, k_pos)
    return target(ids, layer_ids=layer_ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)


def accept_proposal(proposal: Proposal, logits: Tensor, sampling: Sampling) -> tuple[list[int], int]:
    """Acceptance through models/verify.py: logits [N+1, V] → (accepted node indices root→leaf, next token)."""
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


def commit_kv(cache: DynamicCache, prefix_len: int, path: list[int]) -> None:
    """Keep [prefix, root, accepted nodes] in the cache after a verification forward over [root + N nodes].

    The root sits at ``prefix_len``; node j at ``prefix_len + 1 + j``. A path 0..n-1 (always the case for a
    chain) is already in place: crop. Otherwise gather the accepted nodes' entries right after the root, then
    crop. (Batched chains: ``commit_kv_rows``.)
    """
    keep = prefix_len + 1 + len(path)
    if path != list(range(len(path))):
        src = torch.tensor(path, dtype=torch.long) + (prefix_len + 1)
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            s = src.to(layer.keys.device)
            layer.keys[..., prefix_len + 1 : keep, :] = layer.keys.index_select(-2, s)
            layer.values[..., prefix_len + 1 : keep, :] = layer.values.index_select(-2, s)
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def _tree_tries(proposal: Proposal, path: list[int]) -> int:
    """How many depths were tried in a round: depth k+1 counts when the node reached at depth k has children."""
    if proposal.size == 0:
        return 0
    if proposal.is_chain:
        return min(len(path) + 1, proposal.size)
    par = proposal.parents.tolist()
    has_child = set(par)  # -1 = the root has children
    tried = 0
    for d, node in enumerate([-1, *path]):
        if node in has_child:
            tried = d + 1
    return tried


# --------------------------------------------------------------------------------------------- speculative
def speculative_decode(
    target: FrozenTarget,
    proposer: Proposer,
    prompt_ids: Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    max_nodes: int = MAX_TREE_NODES,
) -> DecodeResult:
    """Lossless speculative decoding of one sequence: greedy output equals ``decode_ar``'s token for token;
    sampled output follows the target's processed distribution exactly (models/verify.py).

    Each round drafts at most ``max_new_tokens - generated - 1`` tokens deep (a round emits accepted + 1),
    so the run never overshoots and the last rounds may draft fewer tokens.
    """
    sampling = Sampling(temperature, top_p, top_k, generator)
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    device = prompt_ids.device
    layer_ids = list(proposer.layer_ids)
    res = DecodeResult(tokens=[])

    t0 = device_time(device)
    cache = new_cache(target)
    pre = prefill(target, prompt_ids, cache, layer_ids)
    root = sample_token(pre.logits[:, -1], sampling)  # [1]: the newest token, not yet through the target
    res.prefill_s = device_time(device) - t0
    res.target_forwards = 1
    out = [int(root)]
    stop = eos_id is not None and out[0] == eos_id
    t = device_time(device)
    proposer.begin(torch.cat([prompt_ids[0], root])[None], pre.hidden, sampling)
    res.draft_s += device_time(device) - t

    while len(out) < max_new_tokens and not stop:
        budget = max_new_tokens - len(out) - 1
        t = device_time(device)
        prop = proposer.propose(budget) if budget > 0 else Proposal.empty(device)
        t_drafted = device_time(device)
        res.draft_s += t_drafted - t
        check_proposal(prop, budget, max_nodes)

        prefix_len = cache.get_seq_length()
        ver = verify_forward(target, cache, root, prop, layer_ids)
        path, nxt = accept_proposal(prop, ver.logits[0], sampling)
        commit_kv(cache, prefix_len, path)
        n = len(path)
        new = torch.cat([prop.tokens[path].to(device), torch.tensor([nxt], device=device)])  # [n + 1]
        rows = torch.tensor([0, *(j + 1 for j in path)], device=device)  # root + accepted nodes
        hidden = {k: v.index_select(1, rows) for k, v in ver.hidden.items()}
        t = device_time(device)
        res.verify_s += t - t_drafted

        proposer.accept(new[None], hidden)
        res.draft_s += device_time(device) - t
        res.target_forwards += 1
        res.accepted.append(n)
        res.drafted.append(prop.size)
        res._count(_tree_tries(prop, path), n)
        new_list = new.tolist()
        if eos_id is not None and eos_id in new_list:
            new_list = new_list[: new_list.index(eos_id) + 1]
            stop = True
        out.extend(new_list)
        root = new[-1:]
    res.tokens = out
    res.stop = "eos" if stop else "length"
    res.total_s = device_time(device) - t0
    return res


def check_proposal(prop: Proposal, budget: int, max_nodes: int) -> None:
    n = prop.size
    if n > max_nodes:
        raise ValueError(f"proposal has {n} nodes, more than max_nodes={max_nodes}; draft a smaller tree "
                         "(fewer total_tokens / medusa choices) or raise max_nodes")
    if prop.tokens.dim() != 1 or (prop.parents is not None and prop.parents.shape != prop.tokens.shape):
        raise ValueError(f"proposal tokens must be [N] and parents [N], got {tuple(prop.tokens.shape)} and "
                         f"{None if prop.parents is None else tuple(prop.parents.shape)}")
    if n == 0:
        return
    if not prop.is_chain and (prop.depth is None or prop.ancestors is None):
        prop.depth, prop.ancestors = tree_layout(prop.parents)  # once per round, reused by verify_inputs
    depth = n if prop.is_chain else int(prop.depth.max())
    if depth > budget:
        raise ValueError(f"proposal is {depth} tokens deep but only {budget} more can be drafted this round; "
                         "proposers must honour propose(max_depth)")
