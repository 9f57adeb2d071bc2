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
checkpoint: a stale ``*.tmp`` directory is ignored and removed by the next save. Weights holding
NaN/inf are never written (``check_finite``, also called by every loader and the export validator).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from models import registry
from models.core.checkpoint import (
    CONFIG,
    WEIGHTS,
    check_finite,
    out_of_space_as_error,
    trainable_state,
    write_atomic,
)

TRAINER = "trainer.pt"


def finite_or_none(x: Any) -> Any:
    """A metric for JSON: non-finite floats become null (bare NaN is not JSON)."""
    return x if not isinstance(x, float) or math.isfinite(x) else None


def rng_state() -> dict[str, Any]:
    _, keys, pos, _, _ = np.random.get_state()
    # numpy arrays are not allowed under weights_only loading: store the MT19937 keys as a tensor.
    return {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_pos": int(pos), "python": list(random.getstate()[1])}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(("MT19937", s["numpy"].numpy().astype(np.uint32), s["numpy_pos"], 0, 0.0))
    random.setstate((3, tuple(int(x) for x in s["python"]), None))


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=1))


def save_drafter(out: Path, module: nn.Module, meta: dict) -> None:
    """The self-describing drafter directory (config.json + model.safetensors); refuses NaN/inf weights."""
    state = trainable_state(module)
    check_finite(state, f"refusing to write {out}")
    with out_of_space_as_error(out):
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
        write_json(out / CONFIG, meta)


def final_files() -> set[str]:
    """What training writes into final/, replaced freely: the drafter, its held-out metrics and whatever a
    method's after-training step adds (``MethodSpec.final_files``, e.g. Medusa's static tree)."""
    return {CONFIG, WEIGHTS, "eval.json", *(f for spec in registry.METHODS.values() for f in spec.final_files)}


def save_final(out: Path, module: nn.Module, meta: dict) -> None:
    """``final/`` written as final.tmp and swapped in: a kill leaves the old final/ or the new one, never half."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter(tmp, module, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written drafter must not fill the disk further
        raise
    if out.exists():
        ours = final_files()
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours or not p.is_file())
        if foreign:  # someone put files there (an export, notes): keep them, never delete what we did not write
            kept = out.with_name(f"{out.name}.kept_{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(out, kept)
            print(f"warning: {out} held {foreign[:4]}, which training does not write; the previous final/ is kept "
                  f"as {kept}", file=sys.stderr, flush=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints, oldest first (zero-padded step names: name order is step order)."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.is_symlink() and not p.name.endswith(".tmp")
                  and all((p / f).exists() for f in (CONFIG, WEIGHTS, TRAINER)))


def check_own_checkpoints(root: Path) -> None:
    """Refuse a ``step_*`` symlink (e.g. to another run's checkpoint): resuming from it would continue that run's
    steps here, and rotation by step number would then prune every checkpoint this run writes."""
    links = sorted(p for p in root.glob("step_*") if p.is_symlink()) if root.is_dir() else []
    if links:
        raise ValueError(f"{links[0]} is a symlink (to {os.readlink(links[0])}): a run resumes only from its own "
                         "checkpoints; remove the link, or copy that checkpoint in as a directory")


def _prune(root: Path, keep: int, protect: Path | None) -> None:
    """Remove the oldest checkpoints until at most ``keep`` remain, never ``protect``."""
    done = complete_checkpoints(root)
    excess = len(done) - max(keep, 1 if protect in done else 0)
    for old in [p for p in done if p != protect][: max(0, excess)]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(root: Path, step: int, module: nn.Module, meta: dict, trainer_state: dict,
                    engine: Any = None, rank: int = 0, barrier=lambda: None, keep: int = 2) -> Path:
    name = f"step_{step:07d}"
    tmp, final = root / (name + ".tmp"), root / name
    if rank == 0:
        check_finite(trainable_state(module, packed=False), f"refusing to checkpoint step {step}")
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):  # a kill mid-write leaves these; they are never read
            shutil.rmtree(stale, ignore_errors=True)
        # Make room first (a full disk must not block the save that lowering keep_ckpts should allow), but never
        # remove the checkpoint `latest` names before the new one is committed.
        _prune(root, keep - 1, protect=latest_checkpoint(root))
        tmp.mkdir()
    barrier()
    try:
        with out_of_space_as_error(tmp):
            if engine is not None:  # every rank writes its optimizer shard
                engine.save_checkpoint(str(tmp / "ds"), tag="ds", exclude_frozen_parameters=True)
            barrier()
            if rank == 0:
                save_drafter(tmp, module, {**meta, "step": step})
                torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / TRAINER)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # do not leave a half checkpoint filling the disk
        raise
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the commit point
        latest_tmp = root / "latest.tmp"
        with out_of_space_as_error(latest_tmp):  # latest_checkpoint() falls back to the newest complete one
            latest_tmp.write_text(name)
        os.replace(latest_tmp, root / "latest")
        _prune(root, keep, protect=final)
    barrier()
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``latest`` names, if complete; else the newest complete one (a kill between the commit
    rename and the pointer update leaves the pointer one behind)."""
    ptr = root / "latest"
    done = complete_checkpoints(root) if root.is_dir() else []
    if ptr.exists():
        path = root / ptr.read_text().strip()
        if path in done and path == done[-1]:
            return path
    return done[-1] if done else None


def set_aside_previous_run(out_dir: Path, ck_root: Path) -> Path | None:
    """A fresh run (train.resume=false) moves an earlier run's checkpoints, metrics, data stats and final drafter
    into ``previous_<time>/`` instead of mixing its step numbers with them (or pruning them by name), and so that
    until the new run finishes no ``final/`` claims to be its drafter."""
    old = [p for p in ck_root.glob("*")] if ck_root.is_dir() else []
    files = [out_dir / n for n in ("metrics.jsonl", "val.jsonl", "data_stats.json", "final", "final.tmp")]
    if not old and not any(f.exists() for f in files):
        return None
    aside = out_dir / f"previous_{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while aside.exists():
        n += 1
        aside = out_dir / f"previous_{time.strftime('%Y%m%d-%H%M%S')}_{n}"
    aside.mkdir(parents=True)
    if old:
        os.replace(ck_root, aside / ck_root.name)
    for f in files:
        if f.exists():
            os.replace(f, aside / f.name)
    return aside


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the records up to ``step`` (the resumed checkpoint): what a killed run logged after it is redone
    and would otherwise appear twice. Torn lines are dropped. Returns the number of records removed."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_bytes().splitlines():
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            dropped += 1
            continue
        keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(x + b"\n" for x in keep))
        os.replace(tmp, path)
    return dropped


def _diff(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in _diff(a.get(k), b.get(k), f"{where}.{k}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def check_compatible(meta: dict, expected: dict, path: Path) -> None:
    """Refuse a checkpoint made for another target, another draft config or another target dtype (the states it
    was trained on differ by the dtype's rounding): one line naming what differs. A checkpoint that records no
    target dtype (written before checkpoints did) is not checked for it."""
    keys = ("method", "target", "draft")
    diffs = [d for key in keys for d in _diff(meta.get(key), expected.get(key), key)]
    if diffs:
        which = "/".join(k for k in keys if meta.get(k) != expected.get(k))
        more = f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else ""
        raise ValueError(f"{path} was made for a different {which} ({'; '.join(diffs[:4])}{more}); resume with the "
                         "same settings, use another output_dir, or train.resume=false (moves it aside)")
    had, now = meta.get("target_dtype"), expected.get("target_dtype")
    if had is not None and now is not None and had != now:
        raise ValueError(f"{path} was trained against the target in {had}, but this run loads it in {now}; resume "
                         f"with target.dtype={had}, use another output_dir, or train.resume=false (moves it aside)")


def load_trainer_state(path: Path) -> dict:
    # Our own file, but still no arbitrary unpickling: tensors and plain containers only.
    try:
        return torch.load(path / TRAINER, weights_only=True)
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path / TRAINER}: unreadable ({type(e).__name__}: {str(e)[:200]}); move {path} aside "
                         "to resume from the previous checkpoint") from None
