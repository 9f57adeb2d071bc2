"""Decoding engine for the frozen target: plain autoregressive decoding and lossless speculative decoding.

The single-sequence API over the batched ladder (eval/decode/ladder.py, gpt-fast style), whose B=1 call
``speculative_decode`` is:

    new_cache → prefill → sample_token                         (both decoders)
    decode_ar: prefill, then one token per target forward       (the baseline)
    speculative_decode, per round:
        proposer.propose → Proposal (chain, or tree with parents)
        verify_inputs / verify_forward: ONE target forward over [last accepted token (root) + drafted nodes]
            with positions prefix_len + depth and, for trees, a 4D mask over [prefix + tree] (nodes see
            the prefix, the root, their ancestors and themselves)
        accept_proposal: models/core/verify.py (greedy at temperature 0, speculative sampling otherwise; trees with
            deterministic drafts use the point-mass rule, sampled drafts the residual rule)
        commit_kv: keep only the accepted path's KV entries (chain: crop; tree: gather into place, crop)
        proposer.accept(new tokens, the target's hidden states for them)

Context bookkeeping shared with the proposers (models/methods/<name>/): the context is x_0..x_m where x_m, the
newest token, has not been through the target yet (it is the root of the next verification); the target's
KV cache and hidden states cover x_0..x_{m-1}. ``begin`` receives the prompt plus the first generated token
and the prompt's hidden states; each ``accept`` receives the round's r new tokens (accepted drafts + the
target's next token) and the target's hidden states for the r tokens *before* them (old root + accepted
drafts), i.e. always exactly one hidden row per new token.

τ (tokens per target forward, bonus included) = mean over verification rounds of (accepted + 1); the prefill
forward, which emits the first token, is counted in ``target_forwards`` but is not a round.
``speculative_decode_batch`` / ``decode_ar_batch`` (eval/decode/batch.py) are the same ladder at B rows, with one
batched verification forward and, for proposers with a batched form, one drafter forward per round for all rows.
The step functions here (``prefill``, ``verify_inputs``, ``verify_forward``, ``commit_kv``) are the ladder's
steps at B=1, in their single-sequence signatures.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache

from eval.decode import ladder
from eval.decode.ladder import new_cache, sample_token
from eval.decode.result import DecodeResult, check_prompt, device_time
from models.core.proposal import MAX_TREE_NODES, PerRowProposers, Proposal, Proposer, Sampling
from models.core.target import FrozenTarget, TargetOutput


# --------------------------------------------------------------------------------------------- B=1 steps
def prefill(target: FrozenTarget, prompt_ids: Tensor, cache: DynamicCache, layer_ids: list[int] = ()) -> TargetOutput:
    """Run the prompt [1, P] through the target into ``cache``: logits of the last position [1, 1, V] and the
    requested hidden states for every prompt position {id: [1, P, H]}."""
    return ladder.prefill(target, [prompt_ids.reshape(-1)], cache, layer_ids)[0]


def verify_inputs(
    root: Tensor, proposal: Proposal, prefix_len: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Inputs of the verification forward over [root + N nodes] (``ladder.verify_inputs`` at B=1).

    root [1] (the newest token), prefix_len = tokens already in the target's cache. Returns input_ids
    [1, N+1], position_ids [1, N+1] (prefix_len + depth, root depth 0) and, for trees, the additive 4D mask
    [1, 1, N+1, prefix_len+N+1] (0 = visible, dtype-min = hidden): every row sees the prefix and the root,
    node rows also their ancestors and themselves. Chains need no mask (plain causal) → None.
    """
    lens = torch.tensor([prefix_len], device=root.device)
    return ladder.verify_inputs(root.view(1), [proposal], lens, prefix_len, dtype)


def verify_forward(
    target: FrozenTarget, cache: DynamicCache, root: Tensor, proposal: Proposal, layer_ids: list[int] = ()
) -> TargetOutput:
    """ONE target forward over [root + drafted nodes] on top of ``cache`` (which then also holds their KV).
    logits [1, N+1, V]: row 0 follows the root, row j+1 follows node j (models/core/verify.py's layout)."""
    lens = torch.tensor([cache.get_seq_length()], device=root.device)
    return ladder.verify_forward(target, cache, root.view(1), [proposal], lens, layer_ids)


def commit_kv(cache: DynamicCache, prefix_len: int, path: list[int]) -> None:
    """Keep [prefix, root, accepted nodes] in the cache after a verification forward over [root + N nodes].

    The root sits at ``prefix_len``; node j at ``prefix_len + 1 + j``. A path 0..n-1 (always the case for a
    chain) is already in place: crop. Otherwise gather the accepted nodes' entries right after the root, then
    crop (``ladder.commit_kv`` at B=1)."""
    ladder.commit_kv(cache, torch.tensor([prefix_len]), prefix_len, [path])


# --------------------------------------------------------------------------------------------- decoders
def decode_ar(
    target: FrozenTarget,
    prompt_ids: Tensor,
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_id: int | None = None,
) -> DecodeResult:
    """Plain autoregressive decoding with a KV cache: one target forward per token (the baseline). Kept as its
    own lean loop (no proposer, one host sync per token only when an eos is given) so the baseline carries no
    engine overhead. ``sampling``: how tokens are chosen (None: greedy)."""
    sampling = Sampling() if sampling is None else sampling
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    device = prompt_ids.device
    res = DecodeResult(tokens=[])
    t0 = device_time(device)
    cache = new_cache(target, 1, prompt_ids.shape[1] + max_new_tokens)
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


def speculative_decode(
    target: FrozenTarget,
    proposer: Proposer,
    prompt_ids: Tensor,
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_id: int | None = None,
    max_nodes: int = MAX_TREE_NODES,
) -> DecodeResult:
    """Lossless speculative decoding of one sequence (the ladder, eval/decode/ladder.py ``decode``, at B=1): greedy
    output equals ``decode_ar``'s token for token; sampled output follows the target's processed distribution
    exactly (models/core/verify.py). ``sampling``: how tokens are chosen (None: greedy).

    Each round drafts at most ``max_new_tokens - generated - 1`` tokens deep (a round emits accepted + 1),
    so the run never overshoots and the last rounds may draft fewer tokens.
    """
    sampling = Sampling() if sampling is None else sampling
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    return ladder.decode(target, PerRowProposers([proposer]), [prompt_ids[0]], max_new_tokens, sampling, eos_id,
                         max_nodes=max_nodes)[0]
