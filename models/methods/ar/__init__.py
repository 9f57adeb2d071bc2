"""AR, plain autoregressive decoding, as a method whose proposer drafts nothing (module-free: source "none").

It is the benchmark's baseline (``ProposerSpec.baseline``): eval times it with eval/decode/single.py ``decode_ar`` — a
lean loop without proposer overhead — and checks every other method's T=0 tokens against it. Its proposers here
make the same decoding available through the speculative engine (every round verifies the root alone, so the
output is AR's): ``NoDraftProposer`` for one sequence, ``NoDrafts`` for a batch (eval/decode/batch.py
``decode_ar_batch``: the batched engine with empty drafts).
"""

from __future__ import annotations

from torch import Tensor

from models.core.proposal import Proposal, Sampling
from models.core.spec import MethodSpec, ProposerSpec


class NoDraftProposer:
    """The B=1 ``Proposer`` that drafts nothing: each round emits the target's own next token."""

    layer_ids: list[int] = []

    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        pass

    def propose(self, max_depth: int) -> Proposal:
        return Proposal.empty()

    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        pass


class NoDrafts:
    """Drafts nothing for any row (the ``BatchProposer`` form): the batched engine then is plain batched
    autoregressive decoding."""

    layer_ids: list[int] = []

    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        pass

    def propose(self, max_depth: list[int]) -> list[Proposal]:
        return [Proposal.empty() for _ in max_depth]

    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        pass

    def retain(self, rows: list[int]) -> None:
        pass


SPEC = MethodSpec(
    name="ar", source="none",
    proposers=(ProposerSpec("ar", lambda _model, _target: NoDraftProposer(), {}, chain=False,
                            batched=lambda rows: NoDrafts(), baseline=True),),
)
