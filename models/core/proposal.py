"""What a proposer is and what it hands the verifier (core: every method and the engine import this).

``Sampling`` (how tokens are chosen, the same for target and draft), ``Proposal`` (one round's drafted
chain or tree), the ``Proposer`` protocol the engine drives (eval/decode/single.py docstring: context bookkeeping),
and the small helpers proposers share. A tree's depth and ancestors: ``models.core.tree.tree_layout``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from models.core import verify

MAX_TREE_NODES = 256  # default cap on drafted nodes per round (verification cost grows with it)


@dataclass
class Sampling:
    """How tokens are chosen: temperature 0 = greedy; otherwise temperature → top-k → top-p (models/core/verify.py)."""

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
    (models/core/tree.py).
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

    ``layer_ids``: the target hidden states it consumes (models/core/target.py ids; empty for model-free or
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
    try:
        ok = not isinstance(k, (bool, str)) and int(k) == k and k >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a positive integer, got {k!r}")
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


# --------------------------------------------------------------------------------------------- batched
class BatchProposer(Protocol):
    """The batched form the engine drives (eval/decode/ladder.py): one object drafts for every active row of a batch.

    Rows are ragged: ``begin`` gets each row's prompt + first token and the prompts' hidden states right-padded
    into one tensor; each round ``propose`` gets one depth budget per active row and returns one ``Proposal``
    per row; ``accept`` gets each row's new tokens and their hidden states (right-padded, as for ``begin``);
    ``retain`` drops the rows that finished. A real batched proposer runs ONE drafter forward per round for
    all rows; ``PerRowProposers`` adapts any B=1 ``Proposer`` (one forward per row).
    """

    layer_ids: list[int]

    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        """tokens[b] [P_b+1] = row b's prompt + first generated token; hidden {id: [B, T, H]}, row b's first P_b
        rows are its prompt's states (the rest padding)."""

    def propose(self, max_depth: list[int]) -> list[Proposal]:
        """One proposal per active row, at most max_depth[a] tokens deep (0 → an empty proposal)."""

    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        """tokens[a] [r_a] row a's new tokens; hidden {id: [A, R, H]}: row a's first r_a rows are the target's
        states for the r_a tokens before them (the rest padding)."""

    def retain(self, rows: list[int]) -> None:
        """Keep only these active rows (ascending indices into the current batch): finished rows leave."""


class PerRowProposers:
    """The batched protocol over one B=1 ``Proposer`` per row: each row drafts on its own, one after another
    (so any method works batched; at B=1 it hands the proposer exactly what the B=1 engine always did)."""

    def __init__(self, rows: list[Proposer]):
        self.rows = list(rows)
        self.layer_ids = sorted({k for p in self.rows for k in p.layer_ids})

    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        for b, (p, t) in enumerate(zip(self.rows, tokens)):
            n = t.shape[0] - 1
            p.begin(t[None], {k: v[b : b + 1, :n] for k, v in hidden.items()}, sampling)

    def propose(self, max_depth: list[int]) -> list[Proposal]:
        return [p.propose(d) if d > 0 else Proposal.empty() for p, d in zip(self.rows, max_depth)]

    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        for a, (p, t) in enumerate(zip(self.rows, tokens)):
            r = t.shape[0]
            p.accept(t[None], {k: v[a : a + 1, :r] for k, v in hidden.items()})

    def retain(self, rows: list[int]) -> None:
        self.rows = [self.rows[a] for a in rows]


def batch_proposer(proposers: list[Proposer], batched: Callable[[list], BatchProposer] | None = None
                   ) -> BatchProposer:
    """One batched proposer for these per-row ones: ``batched(rows)`` (the method's batched form, declared as its
    ``ProposerSpec.batched``: one drafter forward per round for all rows) when given, else ``PerRowProposers`` —
    and for a single row, which the batched forms' padding and masks only slow down (the batch sweep at B=1:
    EAGLE-3 1.26× over batched AR through its batched form, 1.43× row by row)."""
    if batched is not None and len(proposers) > 1:
        return batched(list(proposers))
    return PerRowProposers(list(proposers))


def right_pad(rows: list[Tensor], fill: int) -> tuple[Tensor, Tensor]:
    """rows [n_b] → (padded [B, max n_b] filled with ``fill``, lengths [B])."""
    device = rows[0].device
    lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.long, device=device)
    out = torch.full((len(rows), int(lens.max()) if rows else 0), fill, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out, lens
