"""A drafter directory on disk (core: training writes it, eval and export read it).

``config.json`` is self-describing (method, draft config, target identity, layer ids, step) and
``model.safetensors`` holds the trainable weights and buffers; weights copied from the frozen target
(embedding, shared heads) are never stored. train/checkpoint.py adds the resumable trainer state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters and all buffers; frozen parameters (copied from the target) are skipped."""
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items() if k not in frozen}


def load_trainable_state(module: nn.Module, path: Path) -> None:
    """Load ``model.safetensors``; every trainable weight and buffer must be present, nothing extra."""
    state = load_file(str(path))
    expected = set(trainable_state(module))
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(f"{path}: weights do not match the drafter (missing {missing[:5]}, unexpected {extra[:5]})")
    own = module.state_dict()
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, the drafter expects {tuple(own[k].shape)}")
    module.load_state_dict(state, strict=False)


def read_meta(path: Path) -> dict:
    return json.loads((path / CONFIG).read_text())
