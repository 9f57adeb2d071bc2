"""Build a drafter for a frozen target from the ``draft`` config group (one branch per method)."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from models.target import FrozenTarget

METHODS = ("eagle3", "medusa", "mtp")


def build_drafter(draft_cfg: DictConfig, target: FrozenTarget, train_rows: list[dict]) -> torch.nn.Module:
    method = draft_cfg.method
    cfg = instantiate(draft_cfg.config)
    tc = target.model.config
    if method == "eagle3":
        from models.eagle3 import Eagle3Drafter
        from models.vocab import build_draft_vocab, count_tokens

        if cfg.draft_vocab_size > target.vocab_size:
            raise ValueError(f"draft.config.draft_vocab_size={cfg.draft_vocab_size} is larger than the target's "
                             f"vocabulary ({target.vocab_size}); set it <= {target.vocab_size}")
        # Draft vocabulary: the most frequent tokens at loss-masked positions of the training data.
        d2t, t2d = build_draft_vocab(count_tokens(train_rows, target.vocab_size), cfg.draft_vocab_size)
        return Eagle3Drafter(cfg, tc, target.embed.weight.detach().clone(), d2t, t2d)
    if method == "medusa":
        from models.medusa import MedusaHeads

        # the heads' own projections are copies; a shared (frozen) head borrows the target's storage
        return MedusaHeads(cfg, tc, target.model.get_output_embeddings().weight.detach())
    if method == "mtp":
        from models.mtp import MTPDrafter

        return MTPDrafter.from_target(cfg, target)  # the target's own decoder-block class
    raise ValueError(f"draft.method={method!r}: use one of {METHODS}")
