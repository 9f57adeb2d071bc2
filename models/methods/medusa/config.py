"""Medusa's training config (``draft.config``).

Plain data read by the heads (net.py), the exporter (export.py) and ``SPEC``; kept apart so each of them
imports it without importing the others.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from models.core.config_checks import depth_check
from models.core.tree import tree_capacity

# the up-front draft.config check (SPEC.check_config; also run by MedusaConfig itself): the depth, the weights
check_config = depth_check("num_heads", "step_weight")


@dataclass
class MedusaConfig:
    num_heads: int = 4  # K: head k predicts token t+2+k
    num_layers: int = 1  # ResBlocks per head
    share_lm_head: bool = False  # True: every head ends in the target's frozen lm_head (one matmul for all)
    step_weight: float = 0.8  # head k's loss weighted step_weight^k
    distill: bool = True  # soft CE against the target's distribution; False → ground-truth tokens
    metric_top_k: int = 0  # >0: also report top{j}_{k} (target argmax within head k's top-j), j = 1..metric_top_k
    tree_nodes: int = 24  # static tree size saved with the final checkpoint (needs metric_top_k > 0)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_config(asdict(self))  # the up-front check train/checks.py runs on the yaml (SPEC.check_config)
        if self.num_layers < 0:
            raise ValueError(f"medusa num_layers must be >= 0, got {self.num_layers}")
        if self.num_layers == 0 and self.share_lm_head:
            raise ValueError("medusa num_layers=0 with share_lm_head=True leaves nothing to train")
        if self.metric_top_k < 0:
            raise ValueError(f"medusa metric_top_k must be >= 0, got {self.metric_top_k}")
        if self.metric_top_k > 0 and not 0 < self.tree_nodes <= tree_capacity(self.num_heads, self.metric_top_k):
            raise ValueError(f"medusa tree_nodes={self.tree_nodes}: {self.num_heads} heads x top-{self.metric_top_k} "
                             f"address 1..{tree_capacity(self.num_heads, self.metric_top_k)} nodes")
