"""What a proposer is and what it hands the verifier (core: every method and the engine import this).

``Sampling`` (how tokens are chosen, the same for target and draft), ``Proposal`` (one round's drafted
chain or tree), the ``Proposer`` protocol the engine drives (eval/decode.py docstring: context bookkeeping),
and the small helpers proposers share. A tree's depth and ancestors: ``models.tree.tree_layout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from models import verify

MAX_TREE_NODES = 256  # default cap on drafted nodes per round (verification cost grows with it)


@dataclass
class Sampling:
    """How tokens are chosen: temperature 0 = greedy; otherwise temperature → top-k → top-p (models/verify.py)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        verify.sampling_probs(torch.zeros(2), self.temperature, self.top_p, self.top_k)  # one-line errors

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """[..., V] logits → the processed distribution (the same for target and draft)."""
        return verify.sampling_probs(logits, self.temperature, self.top_p, self.top_k)


@dataclass
class Proposal:
    """What a proposer drafts for one round (batch size 1).

    ``tokens`` [N] target ids. Chain: ``parents`` None (node j follows node j-1). Tree: ``parents`` [N]
    (-1 = child of the root, parents[j] < j). ``q`` [N, V]: the draft distribution each token was *sampled*
    from (row j for node j); None = deterministic drafts (greedy / top-k / lookup), verified with the
    point-mass rule. ``depth`` [N] (1-based) and ``ancestors`` [N, N] bool ([i, j] = j is i or an ancestor
    of i) are optional tree layout a proposer may precompute (static trees); the engine derives them otherwise
    (models/tree.py).
    """

    tokens: Tensor
    parents: Tensor | None = None
    q: Tensor | None = None
    depth: Tensor | None = None
    ancestors: Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    @property
    def deterministic(self) -> bool:
        return self.q is None

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Proposal:
        return Proposal(tokens=torch.zeros(0, dtype=torch.long, device=device))


class Proposer(Protocol):
    """The protocol every proposer follows (see the module docstring for the context bookkeeping).

    ``layer_ids``: the target hidden states it consumes (models/target.py ids; empty for model-free or
    separate-model drafters); the engine requests exactly these in prefill and verification.
    """

    layer_ids: list[int]

    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        """tokens [1, P+1] = prompt + first generated token; hidden {id: [1, P, H]} for the prompt."""

    def propose(self, max_depth: int) -> Proposal:
        """Draft at most ``max_depth`` tokens deep (>= 1) after the newest token."""

    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        """tokens [1, r] new tokens; hidden {id: [1, r, H]} the target's states for the r tokens before them."""


# --------------------------------------------------------------------------------------------- helpers
def check_k(name: str, k: int) -> int:
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"{name} must be a positive integer, got {k}")
    return int(k)


def pick_token(logits: Tensor, sampling: Sampling, sample: bool, vocab_ids: Tensor | None,
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


def chain_proposal(tokens: list[Tensor], qs: list[Tensor | None], device: torch.device) -> Proposal:
    if not tokens:
        return Proposal.empty(device)
    q = None if qs[0] is None else torch.stack(qs)
    return Proposal(tokens=torch.cat(tokens).long(), q=q)
