"""Batched decoding: ``speculative_decode_batch`` / ``decode_ar_batch`` run B sequences (prompts of any lengths)
through the ladder (eval/decode/ladder.py ``decode``) with one batched verification forward per round.

The proposers: a ``BatchProposer`` (models/core/proposal.py) drafts for all rows at once — a method's batched form is
``batch_proposer(rows, spec.batched)``, one drafter call per round for all rows (DFlash, EAGLE-3 chains, n-gram);
a list of B=1 proposers, one per row, drafts row after row (``PerRowProposers``). Chains and trees batch alike
(each row's tree has its own mask rows; trees are accepted by the B=1 rules per row).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from eval.decode import ladder
from eval.decode.result import DecodeResult
from models.core.proposal import MAX_TREE_NODES, BatchProposer, PerRowProposers, Proposer, Sampling
from models.methods.ar import NoDrafts


def speculative_decode_batch(
    target,
    proposers: Sequence[Proposer] | BatchProposer,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    max_nodes: int = MAX_TREE_NODES,
) -> list[DecodeResult]:
    """Speculative decoding of B sequences: one ``BatchProposer`` for all rows, or one proposer per row (drafting
    one after another). ``sampling``: how tokens are chosen (None: greedy); drafts of different lengths are
    right-padded with ``pad_id`` (see ``ladder.accept``: exact even where the pad is a real token). Each row's
    result counts the rounds it took part in; timings are the batch's (shared)."""
    sampling = Sampling() if sampling is None else sampling
    if isinstance(proposers, Sequence):
        if len(proposers) != len(prompts) or not prompts:
            raise ValueError(f"need one proposer per prompt, got {len(proposers)} proposers for {len(prompts)} "
                             "prompts")
        proposers = PerRowProposers(list(proposers))
    return ladder.decode(target, proposers, prompts, max_new_tokens, sampling, eos_id, pad_id, max_nodes)


def decode_ar_batch(
    target,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_id: int | None = None,
) -> list[DecodeResult]:
    """Batched autoregressive baseline: the batched engine with empty drafts (one token per row per forward)."""
    sampling = Sampling() if sampling is None else sampling
    return ladder.decode(target, NoDrafts(), prompts, max_new_tokens, sampling, eos_id)
