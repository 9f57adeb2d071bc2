"""Build a drafter for a frozen target from the ``draft`` config group (one branch per method)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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


def _fields(cls, d: dict) -> dict:
    return {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}


def check_same_target(meta: dict, target: FrozenTarget, path: Path) -> None:
    """Refuse a drafter trained for another target (shape or weights), naming what differs."""
    want, have = meta.get("target", {}), target.identity()
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "embed_fingerprint"):
        if want.get(key) != have.get(key) and not (key == "embed_fingerprint"
                                                   and want.get(key) == target.legacy_fingerprint()):
            raise ValueError(f"{path} was trained for another target ({key}: {want.get(key)} != {have.get(key)}; "
                             f"trained on {want.get('name_or_path')!r}); load it with that target")


def load_drafter(path: str | Path, target: FrozenTarget) -> tuple[torch.nn.Module, dict]:
    """Rebuild a drafter from a checkpoint directory written by train/ (config.json + model.safetensors)."""
    from train.checkpoint import WEIGHTS, load_trainable_state, read_meta

    path = Path(path)
    if not (path / WEIGHTS).exists():
        raise FileNotFoundError(f"{path} is not a drafter checkpoint (no {WEIGHTS}); pass OUTPUT_DIR/final")
    meta = read_meta(path)
    check_same_target(meta, target, path)
    method, d, tc = meta["method"], meta["draft"], target.model.config
    if method == "eagle3":
        from models.eagle3 import Eagle3Config, Eagle3Drafter

        cfg = Eagle3Config(**_fields(Eagle3Config, d))
        vd = cfg.draft_vocab_size
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[:vd] = True  # placeholder mapping; the checkpoint's d2t/t2d buffers replace it below
        module = Eagle3Drafter(cfg, tc, target.embed.weight.detach().clone(), torch.zeros(vd, dtype=torch.long), t2d)
    elif method == "medusa":
        from models.medusa import MedusaConfig, MedusaHeads

        module = MedusaHeads(MedusaConfig(**_fields(MedusaConfig, d)), tc,
                             target.model.get_output_embeddings().weight.detach())
    elif method == "mtp":
        from models.mtp import MTPConfig, MTPDrafter

        module = MTPDrafter.from_target(MTPConfig(**_fields(MTPConfig, d)), target)
    else:
        raise ValueError(f"{path}: unknown method {method!r}; expected one of {METHODS}")
    load_trainable_state(module, path / WEIGHTS)
    return module.eval(), meta
