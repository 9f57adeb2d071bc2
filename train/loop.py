"""The training recipe, top to bottom: target → data → drafter → optimizer → (DeepSpeed) → steps.

``run(cfg)`` takes a composed Hydra config (train/__main__.py adds @hydra.main); tests call it
directly. Every batch is a pure function of (seed, step, micro-step, rank), so resuming from a
checkpoint needs only the step count and reproduces an uninterrupted run exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.features import FeatureCache, pad_ids
from data.sources import build_rows
from models import registry
from models.drafter import simulated_tau
from models.target import FrozenTarget
from train import checkpoint as ckpt
from train.checks import check_resume_step, check_step_finite, check_weights_finite, validate_train_config
from train.distributed import Dist, deepspeed_engine, init_distributed
from train.runlock import hold_output_dir


class TrainStep(torch.nn.Module):
    """forward = the drafter's loss, so DDP and DeepSpeed wrap it like any model."""

    def __init__(self, drafter: torch.nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, loss_mask, hidden, target_logits):
        return self.drafter.training_loss(input_ids, loss_mask, hidden, target_logits)


def batch_indices(n_rows: int, step: int, micro: int, batch_size: int, grad_accum: int, d: Dist,
                  seed: int) -> list[int]:
    """Rows of one micro-batch: epochs are seeded permutations; ranks take disjoint slices."""
    per_step = batch_size * grad_accum * d.world_size
    start = step * per_step + (micro * d.world_size + d.rank) * batch_size
    out = []
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, n_rows)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n_rows)[i]))
    return out


def collate(rows: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = pad_ids([r["input_ids"] for r in rows], pad_id)
    mask = torch.zeros_like(ids)
    for j, r in enumerate(rows):
        mask[j, : len(r["loss_mask"])] = torch.tensor(r["loss_mask"])
    return ids, mask


def target_features(target: FrozenTarget, layer_ids: list[int], ids: torch.Tensor, rows: list[int],
                    cache: FeatureCache | None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    if cache is not None:
        return cache.batch(rows, ids.shape[1])
    out = target(ids, layer_ids=layer_ids)
    return {k: v.float() for k, v in out.hidden.items()}, out.logits.float()


def build_drafter(draft_cfg: DictConfig, target: FrozenTarget, train_rows: list[dict]) -> torch.nn.Module:
    """The ``draft`` config group → a new drafter (its ``config`` is instantiated: the method's dataclass)."""
    spec = registry.method(draft_cfg.method)
    known = {f.name for f in dataclasses.fields(spec.config)} if spec.config else set()
    extra = sorted(k for k in draft_cfg.config if k != "_target_" and k not in known)
    if extra:  # e.g. `+recipe=eagle3 draft=mtp`: the recipe's EAGLE-3 fields merged into the MTP group
        raise ValueError(f"draft.config has {extra}, which draft.method={draft_cfg.method} does not take; "
                         f"a recipe for another method? use +recipe={draft_cfg.method} or drop those keys")
    return registry.build_drafter(draft_cfg.method, instantiate(draft_cfg.config), target, train_rows)


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return f


@torch.no_grad()
def evaluate(drafter, target: FrozenTarget, rows: list[dict], batch_size: int, pad_id: int) -> dict[str, float]:
    """Held-out metrics, each step/head weighted by its number of scored positions."""
    drafter.eval()
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for b in range(0, len(rows), batch_size):
        chunk = rows[b : b + batch_size]
        ids, mask = collate(chunk, pad_id)
        hidden, logits = target_features(target, drafter.layer_ids, ids, [], None)
        _, m = drafter.training_loss(ids, mask, hidden, logits)
        for k, v in m.items():
            if k.startswith("n_"):
                continue
            w = m.get("n_" + k.split("_")[-1], 1.0)
            sums[k] = sums.get(k, 0.0) + float(v) * w
            weights[k] = weights.get(k, 0.0) + w
    drafter.train()
    out = {k: sums[k] / max(weights[k], 1e-9) for k in sums}
    accs = [out[f"acc_{i}"] for i in range(len(out)) if f"acc_{i}" in out]
    out["sim_tau"] = simulated_tau(accs)
    return out


def run(cfg: DictConfig) -> dict:
    """Validate the config, hold the output directory's lock, train."""
    validate_train_config(cfg)
    with hold_output_dir(Path(cfg.output_dir)):
        return _train(cfg)


def _train(cfg: DictConfig) -> dict:
    d = init_distributed(cfg.target.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.output_dir)
    ck_root = out_dir / "checkpoints"
    log = (lambda *a: print(*a, flush=True)) if d.is_main else (lambda *a: None)

    # 1. The frozen target and the data (rank 0 regenerates first; the others then read its cache).
    target: FrozenTarget = instantiate(cfg.target)
    tok = target.tokenizer
    data_cfg = instantiate(cfg.data)
    if not d.is_main:
        d.barrier()
    train_rows, val_rows = build_rows(data_cfg, tok, target.model)
    if d.is_main:
        d.barrier()
    val_rows = val_rows[: cfg.train.eval_rows]
    n_tok = sum(sum(r["loss_mask"]) for r in train_rows)
    log(f"data: {len(train_rows)} train rows ({n_tok} target tokens), {len(val_rows)} val rows")

    # 2. The drafter, and what a checkpoint must match to be resumed or evaluated.
    drafter = build_drafter(cfg.draft, target, train_rows)
    meta = {"method": cfg.draft.method, "target": target.identity(), "draft": drafter.config_dict(),
            "layer_ids": list(drafter.layer_ids), "layer_id_convention": "hf_output_hidden_states_index"}
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    log(f"drafter: {cfg.draft.method}, {sum(p.numel() for p in trainable) / 1e6:.2f} M trainable params, "
        f"layer ids {list(drafter.layer_ids)} of {target.num_layers}")

    # 3. Optimizer and schedule (torch AdamW; DeepSpeed wraps the same objects).
    optimizer = instantiate(cfg.optim.optimizer)(params=trainable)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio))
    step_module = TrainStep(drafter)
    engine = None
    if cfg.deepspeed.enabled:
        ds_cfg = OmegaConf.to_container(cfg.deepspeed.config, resolve=True)
        engine = deepspeed_engine(step_module, optimizer, sched, ds_cfg, cfg.train.batch_size,
                                  cfg.train.grad_accum, d.world_size, cfg.target.device)
        forward = engine
    elif d.world_size > 1:
        forward = torch.nn.parallel.DistributedDataParallel(step_module)
    else:
        forward = step_module

    # 4. Resume from the newest complete checkpoint.
    start = 0
    if not cfg.train.resume and d.is_main:
        aside = ckpt.set_aside_previous_run(out_dir, ck_root)
        if aside:
            log(f"train.resume=false: moved the previous run's checkpoints and metrics to {aside}")
    d.barrier()
    last = ckpt.latest_checkpoint(ck_root) if cfg.train.resume else None
    if last is not None:
        ckpt.check_compatible(ckpt.read_meta(last), meta, last)
        ckpt.load_trainable_state(drafter, last / ckpt.WEIGHTS)
        state = ckpt.load_trainer_state(last)
        if engine is not None:
            engine.load_checkpoint(str(last / "ds"), tag="ds", load_module_strict=False,
                                   load_optimizer_states=True, load_lr_scheduler_states=True)
        else:
            optimizer.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        start = state["step"]
        check_resume_step(start, cfg.train.steps, last)
        log(f"resumed from {last} at step {start}")

    # 5. Offline mode: the target's features once, to disk (resumable), then train from them.
    cache = None
    if cfg.train.mode == "offline":
        cache = FeatureCache(Path(cfg.train.feature_cache), target, train_rows, list(drafter.layer_ids),
                             dtype=cfg.train.feature_dtype)
        if d.is_main:
            m = cache.build()
            log(f"feature cache: {m['bytes'] / 1e6:.1f} MB, {m['bytes_per_token']:.0f} bytes/token")
        d.barrier()
    elif cfg.train.mode != "online":
        raise ValueError(f"train.mode={cfg.train.mode!r}: use 'online' or 'offline'")

    # 6. The steps.
    tracker = instantiate(cfg.tracking)
    tracker.start(OmegaConf.to_container(cfg, resolve=True), d.rank)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    out_dir.mkdir(parents=True, exist_ok=True)
    if d.is_main:
        ckpt.truncate_metrics(out_dir / "metrics.jsonl", start)  # a killed run's records past `start` are redone
    metrics_file = open(out_dir / "metrics.jsonl", "a") if d.is_main else None
    stop = cfg.train.stop_after
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps, desc=cfg.draft.method,
               disable=not d.is_main, mininterval=5)
    t0, toks = time.time(), 0
    drafter.train()
    for step in bar:
        agg: dict[str, float] = {}
        for micro in range(cfg.train.grad_accum):
            idx = batch_indices(len(train_rows), step, micro, cfg.train.batch_size, cfg.train.grad_accum, d, cfg.seed)
            ids, mask = collate([train_rows[i] for i in idx], pad_id)
            hidden, logits = target_features(target, list(drafter.layer_ids), ids, idx, cache)
            loss, m = forward(ids, mask, hidden, logits)
            if engine is not None:
                engine.backward(loss)
            else:
                (loss / cfg.train.grad_accum).backward()
            toks += int(mask.sum())
            m = {**m, "loss": loss.item()}  # the optimised total, whatever the method reports
            for k, v in m.items():
                agg[k] = agg.get(k, 0.0) + float(v) / cfg.train.grad_accum
        if engine is not None:
            check_step_finite(step + 1, agg["loss"], None)
            engine.step()  # clips, steps optimizer and scheduler
        else:
            if d.world_size > 1 and not isinstance(forward, torch.nn.parallel.DistributedDataParallel):
                raise RuntimeError("multi-process training needs DDP or DeepSpeed")
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.grad_clip)
            check_step_finite(step + 1, agg["loss"], grad_norm)
            optimizer.step()
            check_weights_finite(step + 1, trainable)
            sched.step()
            optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            rec = {"step": done, "lr": sched.get_last_lr()[0], "tok_per_s": toks * d.world_size / (time.time() - t0),
                   **{f"train/{k}": v for k, v in agg.items() if not k.startswith("n_")}}
            tracker.log(rec, done)
            if metrics_file:
                metrics_file.write(json.dumps({k: ckpt.finite_or_none(v) for k, v in rec.items()}, allow_nan=False)
                                   + "\n")
                metrics_file.flush()
            bar.set_postfix(loss=f"{agg['loss']:.3f}", acc0=f"{agg.get('acc_0', 0):.2f}")
        if d.is_main and val_rows and done % cfg.train.eval_every == 0 and done != cfg.train.steps:
            ev = evaluate(drafter, target, val_rows, cfg.train.batch_size, pad_id)
            tracker.log({f"val/{k}": v for k, v in ev.items()}, done)
        if done % cfg.train.ckpt_every == 0 or done == cfg.train.steps:
            trainer_state = {} if engine is not None else {"optimizer": optimizer.state_dict(),
                                                          "scheduler": sched.state_dict()}
            ckpt.save_checkpoint(ck_root, done, drafter, meta, trainer_state, engine=engine, rank=d.rank,
                                 barrier=d.barrier, keep=cfg.train.keep_ckpts)
        if stop is not None and done >= stop and done < cfg.train.steps:
            log(f"stopping after step {done} (train.stop_after)")
            tracker.finish()
            return {"stopped_at": done, "output_dir": str(out_dir)}

    # 7. The final, self-describing drafter directory and its held-out numbers.
    summary: dict = {"output_dir": str(out_dir), "steps": cfg.train.steps, "method": cfg.draft.method}
    if d.is_main:
        ckpt.save_final(out_dir / "final", drafter, {**meta, "step": cfg.train.steps})
        if val_rows:
            ev = evaluate(drafter, target, val_rows, cfg.train.batch_size, pad_id)
            summary["val"] = ev
            tracker.log({f"val/{k}": v for k, v in ev.items()}, cfg.train.steps)
            (out_dir / "final" / "eval.json").write_text(json.dumps(ev, indent=1))
            accs = [f"{ev[f'acc_{i}']:.3f}" for i in range(64) if f"acc_{i}" in ev]
            log(f"held-out top-1 agreement with the target by position: {' '.join(accs)}")
            log(f"held-out simulated tau (greedy chain): {ev['sim_tau']:.2f}")
            # e.g. Medusa builds its static draft tree from these held-out numbers
            after = registry.method(cfg.draft.method).after_training
            made = after(drafter, out_dir / "final", ev) if after is not None else None
            if made is not None:
                log(f"{cfg.draft.method}: wrote {made} from the held-out metrics")
        log(f"drafter written to {out_dir / 'final'}")
    tracker.finish()
    if metrics_file:
        metrics_file.close()
    d.barrier()
    return summary
