"""Batched decoding: ``speculative_decode_batch`` / ``decode_ar_batch`` run B sequences (prompts of any lengths)
through the ladder (eval/ladder.py ``decode``) with one batched verification forward per round.

The proposers: a ``BatchProposer`` (models/proposal.py) drafts for all rows at once; a list of B=1 proposers,
one per row, becomes their class's batched form when it has one (DFlash, n-gram: one drafter call per round
for all rows) and ``PerRowProposers`` (row after row) otherwise. Chains and trees batch alike (each row's
tree has its own mask rows; trees are accepted by the B=1 rules per row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from eval import ladder
from eval.decode_result import DecodeResult, resolve_sampling
from models.proposal import MAX_TREE_NODES, BatchProposer, Proposal, Proposer, Sampling, batch_proposer

__all__ = ["NoDrafts", "speculative_decode_batch", "decode_ar_batch"]


class NoDrafts:
    """Drafts nothing for any row: the batched engine then is plain batched autoregressive decoding."""

    layer_ids: list[int] = []

    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        pass

    def propose(self, max_depth: list[int]) -> list[Proposal]:
        return [Proposal.empty() for _ in max_depth]

    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        pass

    def retain(self, rows: list[int]) -> None:
        pass


def speculative_decode_batch(
    target,
    proposers: Sequence[Proposer] | BatchProposer,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    sampling: Sampling | None = None,
    max_nodes: int = MAX_TREE_NODES,
) -> list[DecodeResult]:
    """Speculative decoding of B sequences: one proposer per row (``batch_proposer`` picks their batched form)
    or one ``BatchProposer`` for all rows. ``sampling`` replaces the four scalars when given; drafts of
    different lengths are right-padded with ``pad_id`` (see ``ladder.accept``: exact even where the pad is a
    real token). Each row's result counts the rounds it took part in; timings are the batch's (shared)."""
    sampling = resolve_sampling(sampling, temperature, top_p, top_k, generator)
    if isinstance(proposers, Sequence):
        if len(proposers) != len(prompts) or not prompts:
            raise ValueError(f"need one proposer per prompt, got {len(proposers)} proposers for {len(prompts)} "
                             "prompts")
        proposers = batch_proposer(list(proposers))
    return ladder.decode(target, proposers, prompts, max_new_tokens, sampling, eos_id, pad_id, max_nodes)


def decode_ar_batch(
    target,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    sampling: Sampling | None = None,
) -> list[DecodeResult]:
    """Batched autoregressive baseline: the batched engine with empty drafts (one token per row per forward)."""
    sampling = resolve_sampling(sampling, temperature, top_p, top_k, generator)
    return ladder.decode(target, NoDrafts(), prompts, max_new_tokens, sampling, eos_id)
