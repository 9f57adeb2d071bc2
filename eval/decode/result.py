"""What a decoding run returns (``DecodeResult``) and the small checks and clocks the engine shares
(eval/decode/ladder.py, eval/decode/single.py, eval/decode/batch.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from models.core.proposal import Proposal
from models.core.tree import tree_layout


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

    def record_round(self, proposal: Proposal, path: list[int]) -> None:
        """One verification round that accepted ``path`` (node indices) of ``proposal``."""
        self.target_forwards += 1
        self.accepted.append(len(path))
        self.drafted.append(proposal.size)
        self._count(tree_tries(proposal, path), len(path))


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


def tree_tries(proposal: Proposal, path: list[int]) -> int:
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

