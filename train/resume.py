"""4. Where a run starts: its own newest checkpoint, or (train.warm_start) a shipped drafter on a machine that has
none of the run's checkpoints, or step 0. ``t`` is train.loop.Training (its optimizer, schedule, drafter and
meta)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import train.checkpoint as ckpt
from models.core.checkpoint import WEIGHTS, file_sha256, load_trainable_state, read_meta
from train.checks import check_resume_step


def resume(t: Any) -> int:
    """4. Resume from the newest complete checkpoint → the step to start from (0: a fresh run)."""
    cfg = t.cfg
    if cfg.train.resume:
        ckpt.check_own_checkpoints(t.ck_root)
    last = ckpt.latest_checkpoint(t.ck_root) if cfg.train.resume else None
    if last is None:
        return warm_start(t, Path(cfg.train.warm_start)) if cfg.train.get("warm_start") else 0
    ckpt.check_compatible(read_meta(last), t.meta, last)
    load_trainable_state(t.drafter, last / WEIGHTS)
    state = ckpt.load_trainer_state(last)
    if t.engine is not None:
        t.engine.load_checkpoint(str(last / "ds"), tag="ds", load_module_strict=False,
                                 load_optimizer_states=True, load_lr_scheduler_states=True)
    else:
        t.optimizer.load_state_dict(state["optimizer"])
        t.sched.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"])
    start = state["step"]
    check_resume_step(start, cfg.train.steps, last)
    t.log(f"resumed from {last} at step {start}")
    return start


def warm_start(t: Any, src: Path) -> int:
    """4b. train.warm_start: a run with no checkpoint of its own continues a drafter shipped by
    scripts/ship_drafter.py (fp16 weights + its training record) at the step it was shipped, on any machine: the
    batches (a pure function of the step) and the schedule go on from there, the record's target tokens and seconds
    carry on (the learning curve), and its drafter is the best/ to beat. The optimizer's moments and RNG state are not
    shipped (12 bytes per trainable weight): Adam restarts its estimates. → the step to start from."""
    final = src / "final"
    if not (final / WEIGHTS).exists():
        raise ValueError(f"train.warm_start={src}: no {final / WEIGHTS} (a drafter directory that "
                         "scripts/ship_drafter.py wrote)")
    meta = read_meta(final)
    ckpt.check_compatible(meta, t.meta, final)
    manifest = shipped_manifest(src, final)
    load_trainable_state(t.drafter, final / WEIGHTS)
    start = int(meta.get("step") or manifest.get("steps") or 0)
    check_resume_step(start, t.cfg.train.steps, final)
    if t.d.is_main:
        t.out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "val.jsonl"):  # records past `start` are dropped by train_steps
            if (src / name).exists():
                shutil.copyfile(src / name, t.out_dir / name)
        if t.cfg.train.get("keep_best", False) and not (t.out_dir / "best").exists():
            shutil.copytree(final, t.out_dir / "best")
    with warnings.catch_warnings():  # stepping a schedule before its optimizer: intended, the schedule catches up
        warnings.simplefilter("ignore")
        for _ in range(start):
            t.sched.step()
    t.log(f"warm start from {src} at step {start} (weights and record; fresh optimizer moments)")
    return start


def shipped_manifest(src: Path, final: Path) -> dict:
    """``src/manifest.json`` (scripts/ship_drafter.py's; {} for a drafter directory without one), after checking
    that ``final``'s weights are the ones it shipped: its fp16_sha256 is what makes an edited or damaged file
    refused here rather than trained on."""
    path = src / "manifest.json"
    if not path.exists():
        return {}
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"train.warm_start: {path} is unreadable ({e}); ship the drafter again") from None
    want = m.get("fp16_sha256") if isinstance(m, dict) else None
    if not isinstance(want, str):
        raise ValueError(f"train.warm_start: {path} records no fp16_sha256, so {final / WEIGHTS} cannot be checked "
                         "against it; ship the drafter again (scripts/ship_drafter.py)")
    have = file_sha256(final / WEIGHTS)
    if have != want:
        raise ValueError(f"train.warm_start: {final / WEIGHTS} has sha256 {have}, but {path} records fp16_sha256 "
                         f"{want}: the weights changed after they were shipped; restore them, or ship the drafter "
                         "again (scripts/ship_drafter.py --replace)")
    return m


