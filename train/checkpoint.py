"""Atomic, resumable drafter checkpoints (never the frozen target).

Layout of ``OUTPUT_DIR/checkpoints/``::

    step_0000100/          one complete checkpoint, written as step_0000100.tmp then renamed
      config.json          method, draft config, target identity, layer ids, step  (self-describing)
      model.safetensors    trainable weights + buffers (e.g. d2t/t2d); weights copied from the
                           target and kept frozen (embedding, shared heads) are not stored
      trainer.pt           optimizer/scheduler/RNG/step — tensors and plain values only,
                           read back with torch.load(weights_only=True)
      ds/                  DeepSpeed's sharded engine state when DeepSpeed is on
    latest                 name of the newest complete checkpoint (replaced atomically)

A kill at any moment leaves either the previous ``latest`` or the new one, never a half
checkpoint: a stale ``*.tmp`` directory is ignored and removed by the next save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from models.checkpoint import CONFIG, WEIGHTS, load_trainable_state, read_meta, trainable_state

TRAINER = "trainer.pt"
__all__ = ["CONFIG", "WEIGHTS", "TRAINER", "trainable_state", "load_trainable_state", "read_meta", "rng_state",
           "set_rng_state", "save_drafter", "save_checkpoint", "latest_checkpoint", "check_compatible",
           "load_trainer_state"]


def rng_state() -> dict[str, Any]:
    _, keys, pos, _, _ = np.random.get_state()
    # numpy arrays are not allowed under weights_only loading: store the MT19937 keys as a tensor.
    return {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_pos": int(pos), "python": list(random.getstate()[1])}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(("MT19937", s["numpy"].numpy().astype(np.uint32), s["numpy_pos"], 0, 0.0))
    random.setstate((3, tuple(int(x) for x in s["python"]), None))


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def save_drafter(out: Path, module: nn.Module, meta: dict) -> None:
    """The self-describing drafter directory (config.json + model.safetensors)."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(trainable_state(module), str(out / WEIGHTS), metadata={"format": "pt"})
    _write_json(out / CONFIG, meta)


def save_checkpoint(root: Path, step: int, module: nn.Module, meta: dict, trainer_state: dict,
                    engine: Any = None, rank: int = 0, barrier=lambda: None, keep: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:07d}"
    tmp, final = root / (name + ".tmp"), root / name
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    if engine is not None:  # every rank writes its optimizer shard
        engine.save_checkpoint(str(tmp / "ds"), tag="ds", exclude_frozen_parameters=True)
    barrier()
    if rank == 0:
        save_drafter(tmp, module, {**meta, "step": step})
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / TRAINER)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the commit point
        latest = root / "latest"
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(name)
        os.replace(latest_tmp, latest)
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def latest_checkpoint(root: Path) -> Path | None:
    ptr = root / "latest"
    if not ptr.exists():
        return None
    path = root / ptr.read_text().strip()
    return path if (path / CONFIG).exists() and (path / WEIGHTS).exists() else None


def check_compatible(meta: dict, expected: dict, path: Path) -> None:
    """Refuse a checkpoint made for another target or another draft config (one line, with the fix)."""
    for key in ("method", "target", "draft"):
        if meta.get(key) != expected.get(key):
            raise ValueError(f"{path} was made for a different {key} ({meta.get(key)} != {expected.get(key)}); "
                             "use another train.output_dir or train.resume=false")


def load_trainer_state(path: Path) -> dict:
    # Our own file, but still no arbitrary unpickling: tensors and plain containers only.
    return torch.load(path / TRAINER, weights_only=True)
