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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.features import FeatureCache, resolve_compute_dtype
from data.sources import build_rows
from models import registry
from models.core.acceptance import chain_tau
from models.core.checkpoint import out_of_space_as_error
from models.core.kernels import native_bf16
from models.core.target import FrozenTarget, parse_dtype
from models.export.serving import training_serving
from train import checkpoint as ckpt
from train.batches import batch_indices, collate
from train.checks import check_step_finite, check_weights_finite, validate_train_config
from train.distributed import Dist, deepspeed_engine, init_distributed
from train.resume import resume
from train.runlock import hold_output_dir


class TrainStep(torch.nn.Module):
    """forward = the drafter's loss, so DDP and DeepSpeed wrap it like any model."""

    def __init__(self, drafter: torch.nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, loss_mask, hidden, target_logits):
        return self.drafter.training_loss(input_ids, loss_mask, hidden, target_logits)


def target_features(target: FrozenTarget, layer_ids: list[int], ids: torch.Tensor, rows: list[int],
                    cache: FeatureCache | None, draft_ids: torch.Tensor | None = None
                    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The target's hidden states and logits for a batch: from the feature cache (offline; with ``draft_ids``, a
    DraftVocabTeacher) or a target forward (online)."""
    if cache is not None:  # on the target's device, as the batch is
        return cache.batch(rows, ids.shape[1], draft_ids)
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
def evaluate(drafter, target: FrozenTarget, rows: list[dict], batch_size: int, pad_id: int,
             cache: FeatureCache | None = None, teacher_ids: torch.Tensor | None = None) -> dict[str, float | None]:
    """Held-out metrics, each step/head weighted by its number of scored positions; None for one with no scored
    position (e.g. a DFlash slot past every held-out row's trainable tokens: 0.0 would read as a perfect loss).
    ``cache``: the held-out rows' features (offline mode), read exactly as training reads its own; None runs the
    target on them."""
    drafter.eval()
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for b in range(0, len(rows), batch_size):
        chunk = rows[b : b + batch_size]
        ids, mask = (x.to(target.embed.weight.device) for x in collate(chunk, pad_id))
        idx = list(range(b, b + len(chunk)))
        hidden, logits = target_features(target, drafter.layer_ids, ids, idx, cache, teacher_ids)
        _, m = drafter.training_loss(ids, mask, hidden, logits)
        for k, v in m.items():
            if k.startswith("n_"):
                continue
            w = m.get("n_" + k.split("_")[-1], 1.0)
            sums[k] = sums.get(k, 0.0) + float(v) * w
            weights[k] = weights.get(k, 0.0) + w
    drafter.train()
    out: dict[str, float | None] = {k: sums[k] / weights[k] if weights[k] > 0 else None for k in sums}
    accs = [out[f"acc_{i}"] for i in range(len(out)) if f"acc_{i}" in out]
    out["sim_tau"] = chain_tau(accs)
    return out


def run(cfg: DictConfig) -> dict:
    """Validate the config, hold the output directory's lock, train."""
    validate_train_config(cfg)
    # every writer names its own path on a full disk; this catches the rest (metrics, data stats) by the run's
    with hold_output_dir(Path(cfg.output_dir)), out_of_space_as_error(cfg.output_dir, "free space"):
        return _train(cfg)


@dataclasses.dataclass
class Training:
    """What the steps of one training run share (built by ``_train``'s first steps, used by the later ones)."""

    cfg: DictConfig
    d: Dist
    log: Callable[..., None]
    out_dir: Path
    ck_root: Path
    target: FrozenTarget | None = None
    train_rows: list[dict] = dataclasses.field(default_factory=list)
    val_rows: list[dict] = dataclasses.field(default_factory=list)
    drafter: torch.nn.Module | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    trainable: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    optimizer: Any = None
    sched: Any = None
    engine: Any = None  # DeepSpeed's, when enabled
    forward: Any = None  # the step module, DDP- or DeepSpeed-wrapped
    cache: FeatureCache | None = None  # offline mode's target features
    val_cache: FeatureCache | None = None  # offline mode: the held-out rows' features (rank 0, which evaluates)
    row_lengths: tuple[int, ...] | None = None  # train rows' token counts (train.length_bucket)
    teacher_ids: torch.Tensor | None = None  # offline, reduced-vocabulary drafter: the cache gives DraftVocabTeacher
    pad_id: int = 0
    tracker: Any = None
    metrics_file: Any = None  # rank 0's metrics.jsonl, open while the steps run
    val_file: Any = None  # rank 0's val.jsonl (held-out records with their training time)
    val_steps: set[int] = dataclasses.field(default_factory=set)  # steps val.jsonl holds: each is logged once
    device: torch.device = torch.device("cpu")  # the target's (target.device): the drafter and every batch go there
    autocast: tuple = ("cpu", None)  # (device type, dtype or None): train.autocast, resolved by build_optimizer
    skipped_batches: int = 0  # micro-batches with nothing to score (counted in metrics.jsonl, said at the end)
    elapsed_before: float = 0.0  # training seconds of the runs this one resumes (their last ``elapsed_s``)
    tokens_before: int = 0  # target tokens those runs trained on (their last ``tokens_seen``)
    tokens_run: int = 0  # target tokens this process has trained on, all ranks
    target_before: float = 0.0  # of the resumed runs' training seconds, those spent on the target's features
    target_run: float = 0.0  # the same in this process (online: the target's forward; offline: the cache's reads)
    t0: float = 0.0  # when this process's steps began

    def elapsed(self) -> float:
        """Training seconds so far, across resumed runs (the learning curve's x axis)."""
        return self.elapsed_before + time.time() - self.t0


def _train(cfg: DictConfig) -> dict:
    """The recipe as a ladder of named steps (each documented where it is defined)."""
    d = init_distributed(cfg.target.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.output_dir)
    log = (lambda *a: print(*a, flush=True)) if d.is_main else (lambda *a: None)
    t = Training(cfg, d, log, out_dir, out_dir / "checkpoints")
    set_aside_previous_run(t)
    load_target_and_data(t)
    build_drafter_and_meta(t)
    build_optimizer(t)
    start = resume(t)
    build_feature_cache(t)
    stopped = train_steps(t, start)
    return stopped if stopped is not None else finish(t)


def set_aside_previous_run(t: Training) -> None:
    """0. train.resume=false: the previous run's checkpoints, metrics, data stats and final/ go to previous_<time>/
    before anything of this run is written (eval and export must never read the old drafter as this run's)."""
    if not t.cfg.train.resume and t.d.is_main:
        aside = ckpt.set_aside_previous_run(t.out_dir, t.ck_root)
        if aside:
            t.log(f"train.resume=false: moved the previous run's checkpoints, metrics and final/ to {aside}")
    t.d.barrier()


def load_target_and_data(t: Training) -> None:
    """1. The frozen target and the data (rank 0 regenerates first; the others then read its cache)."""
    cfg, d = t.cfg, t.d
    t.target = instantiate(cfg.target)
    t.device = t.target.embed.weight.device
    tok = t.target.tokenizer
    data_cfg = instantiate(cfg.data)
    if not d.is_main:
        d.barrier()
    stats: dict = {}
    t.train_rows, val_rows = build_rows(data_cfg, tok, t.target.model, stats)
    if d.is_main:
        d.barrier()
    t.val_rows = val_rows[: cfg.train.eval_rows]
    t.row_lengths = tuple(len(r["input_ids"]) for r in t.train_rows)
    t.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    n_tok = sum(sum(r["loss_mask"]) for r in t.train_rows)
    t.log(f"data: {len(t.train_rows)} train rows ({n_tok} target tokens), {len(t.val_rows)} val rows")
    for g in stats.get("regenerated", []):
        rate = f", {g['items_per_s']} continuations/s" if g["items_per_s"] else ""
        t.log(f"data: {g['continuations']} target continuations at T={g['temperature']:g} ({g['from_cache']} from "
              f"cache, {g['generated_now']} generated in {g['seconds']:.0f} s{rate})")
    if d.is_main:  # what the data cost, for the benchmark's training table (eval/bench/report.py)
        t.out_dir.mkdir(parents=True, exist_ok=True)
        path = t.out_dir / "data_stats.json"
        prev = json.loads(path.read_text()) if path.exists() else {}
        # seconds spent generating, summed over the runs that generated (a resumed run reads its cache)
        spent = sum(g["seconds"] for g in stats.get("regenerated", []) if g["generated_now"])
        spent += prev.get("regen_seconds_total", 0.0)
        ckpt.write_json(path, {
            "train_rows": len(t.train_rows), "train_target_tokens": n_tok, "val_rows": len(t.val_rows),
            "regenerated": stats.get("regenerated", []), "regen_seconds_total": round(spent, 1),
            **({"skipped": stats["skipped"]} if "skipped" in stats else {})})


def build_drafter_and_meta(t: Training) -> None:
    """2. The drafter, and what a checkpoint must match to be resumed or evaluated."""
    cfg, target = t.cfg, t.target
    t.drafter = build_drafter(cfg.draft, target, t.train_rows).to(t.device)
    # the load dtype sits beside identity(), which keys the data and feature caches and stays dtype-free
    t.meta = {"method": cfg.draft.method, "target": target.identity(), "draft": t.drafter.config_dict(),
              "target_dtype": str(target.model.dtype).replace("torch.", ""),
              "layer_ids": list(t.drafter.layer_ids), "layer_id_convention": "hf_output_hidden_states_index",
              # the serving mode the drafter is trained for (exports record it; --check compares it)
              "serving": training_serving(target, cfg.data.get("chat_template"), cfg.data.get("enable_thinking"),
                                          cfg.data.get("kind"))}
    t.trainable = [p for p in t.drafter.parameters() if p.requires_grad]
    t.log(f"drafter: {cfg.draft.method}, {sum(p.numel() for p in t.trainable) / 1e6:.2f} M trainable params, "
          f"layer ids {list(t.drafter.layer_ids)} of {target.num_layers}")
    t2d = getattr(t.drafter, "t2d", None)
    if t2d is not None and int(t2d.sum()) < target.vocab_size:  # a reduced draft vocabulary: what it can cover
        from models.core.vocab import count_tokens, coverage

        sizes = sorted({int(t2d.sum()), 1024, 2048, 4096, 8192, 16384, 32768} & set(range(1, target.vocab_size)))
        cov = coverage(count_tokens(t.train_rows, target.vocab_size), sizes)
        t.meta["draft_vocab_coverage"] = {str(n): round(v, 4) for n, v in cov.items()}
        t.log("draft vocab: " + ", ".join(f"{n}: {v:.3f}" for n, v in cov.items())
              + f" of the training tokens (this drafter: {int(t2d.sum())})")


def autocast_dtype(setting: str | None, device: str) -> torch.dtype | None:
    """``train.autocast``: null trains in fp32; ``bfloat16``; ``auto``: bf16 where the hardware has a bf16 dot product
    (a CPU with AVX-512 BF16 or AMX, a GPU that supports it), where it runs the drafter's GEMMs at ~2x fp32's speed."""
    if setting is None:
        return None
    if setting == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
        return torch.bfloat16 if native_bf16() else None
    return parse_dtype(setting)


def build_optimizer(t: Training) -> None:
    """3. Optimizer and schedule (torch AdamW; DeepSpeed wraps the same objects)."""
    cfg, d = t.cfg, t.d
    t.optimizer = instantiate(cfg.optim.optimizer)(params=t.trainable)
    t.sched = torch.optim.lr_scheduler.LambdaLR(
        t.optimizer, lr_lambda(cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio))
    t.autocast = (torch.device(cfg.target.device).type, autocast_dtype(cfg.train.get("autocast"), cfg.target.device))
    if t.autocast[1] is not None:
        t.log(f"train.autocast: the drafter's forward and backward in {t.autocast[1]} (weights, optimizer in fp32)")
    step_module = TrainStep(t.drafter)
    if cfg.deepspeed.enabled:
        ds_cfg = OmegaConf.to_container(cfg.deepspeed.config, resolve=True)
        t.engine = deepspeed_engine(step_module, t.optimizer, t.sched, ds_cfg, cfg.train.batch_size,
                                    cfg.train.grad_accum, d.world_size, cfg.target.device)
        t.forward = t.engine
    elif d.world_size > 1:
        t.forward = torch.nn.parallel.DistributedDataParallel(step_module)
    else:
        t.forward = step_module


def build_feature_cache(t: Training) -> None:
    """5. Offline mode: the target's features once, to disk (resumable), then train from them."""
    cfg, d = t.cfg, t.d
    if cfg.train.mode == "offline":
        compute = resolve_compute_dtype(cfg.train.get("cache_compute_dtype"))
        t.cache = FeatureCache(Path(cfg.train.feature_cache), t.target, t.train_rows, list(t.drafter.layer_ids),
                               dtype=cfg.train.feature_dtype, store_layer_ids=cfg.train.get("feature_layers"),
                               compute_dtype=compute)
        if d.is_main:
            m = t.cache.build()
            t.log(f"feature cache: {m['bytes'] / 1e6:.1f} MB, {m['bytes_per_token']:.0f} bytes/token")
            if t.val_rows:  # once, beside it: every evaluation then reads features instead of running the target
                t.val_cache = FeatureCache(Path(cfg.train.feature_cache) / f"heldout_{len(t.val_rows)}", t.target,
                                           t.val_rows, list(t.drafter.layer_ids), dtype=cfg.train.feature_dtype,
                                           store_layer_ids=cfg.train.get("feature_layers"), compute_dtype=compute)
                t.val_cache.build(show_progress=False)
        d.barrier()
        if getattr(t.drafter, "reads_draft_vocab_teacher", False) and cfg.train.get("draft_vocab_teacher", True):
            if t.cache.has_top():
                t.teacher_ids = t.drafter.draft_ids
            else:
                t.log(f"feature cache {t.cache.root} predates the stored target argmax: every step runs the "
                      "full-vocabulary lm_head (rebuild the cache in a new directory to train faster)")
    elif cfg.train.mode != "online":
        raise ValueError(f"train.mode={cfg.train.mode!r}: use 'online' or 'offline'")


def train_steps(t: Training, start: int) -> dict | None:
    """6. The steps: each one ``optimizer_step``, then logging, periodic validation and checkpoints. Returns the
    early-stop summary when train.stop_after ends the run before its last step, else None."""
    cfg, d = t.cfg, t.d
    t.tracker = tracker = instantiate(cfg.tracking)
    tracker.start(OmegaConf.to_container(cfg, resolve=True), d.rank)
    t.out_dir.mkdir(parents=True, exist_ok=True)
    if d.is_main:
        for name in ("metrics.jsonl", "val.jsonl"):  # a killed run's records past `start` are redone
            ckpt.truncate_metrics(t.out_dir / name, start)
    # a rerun of a finished run (start == steps) evaluates final/ again; its record is there already
    t.val_steps = logged_steps(t.out_dir / "val.jsonl") if d.is_main else set()
    t.elapsed_before = last_elapsed(t.out_dir / "metrics.jsonl") if d.is_main else 0.0
    t.tokens_before = int(last_elapsed(t.out_dir / "metrics.jsonl", "tokens_seen")) if d.is_main else 0
    t.target_before = last_elapsed(t.out_dir / "metrics.jsonl", "target_s") if d.is_main else 0.0
    t.metrics_file = open(t.out_dir / "metrics.jsonl", "a") if d.is_main else None
    t.val_file = open(t.out_dir / "val.jsonl", "a") if d.is_main else None
    stop = cfg.train.stop_after
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps, desc=cfg.draft.method,
               disable=not d.is_main, mininterval=5)
    t0, toks = time.time(), 0
    t.t0 = t0
    t.drafter.train()
    for step in bar:
        agg, n = optimizer_step(t, step)
        toks += n
        t.tokens_run += n * d.world_size
        done = step + 1
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            rec = {"step": done, "elapsed_s": round(t.elapsed(), 3), "tokens_seen": t.tokens_before + t.tokens_run,
                   "target_s": round(t.target_before + t.target_run, 3), "lr": t.sched.get_last_lr()[0],
                   "tok_per_s": toks * d.world_size / (time.time() - t0),
                   **{f"train/{k}": v for k, v in agg.items() if not k.startswith("n_")}}
            tracker.log(rec, done)
            if t.metrics_file:
                t.metrics_file.write(json.dumps({k: ckpt.finite_or_none(v) for k, v in rec.items()}, allow_nan=False)
                                     + "\n")
                t.metrics_file.flush()
            bar.set_postfix(loss=f"{agg['loss']:.3f}", acc0=f"{agg.get('acc_0', 0):.2f}")
        if d.is_main and t.val_rows and done % cfg.train.eval_every == 0 and done != cfg.train.steps:
            ev = evaluate(t.drafter, t.target, t.val_rows, cfg.train.batch_size, t.pad_id, t.val_cache, t.teacher_ids)
            tracker.log({f"val/{k}": v for k, v in ev.items() if v is not None}, done)
            log_val(t, done, ev)
            keep_if_best(t, done, ev)
        if done % cfg.train.ckpt_every == 0 or done == cfg.train.steps:
            trainer_state = {} if t.engine is not None else {"optimizer": t.optimizer.state_dict(),
                                                            "scheduler": t.sched.state_dict()}
            ckpt.save_checkpoint(t.ck_root, done, t.drafter, t.meta, trainer_state, engine=t.engine, rank=d.rank,
                                 barrier=d.barrier, keep=cfg.train.keep_ckpts)
        if stop is not None and done >= stop and done < cfg.train.steps:
            t.log(f"stopping after step {done} (train.stop_after)")
            tracker.finish()
            return {"stopped_at": done, "output_dir": str(t.out_dir)}
    return None


def last_elapsed(path: Path, key: str = "elapsed_s") -> float:
    """Training seconds (or another cumulative ``key``, e.g. ``tokens_seen``) logged so far: the last record's value;
    0 for a fresh run or older metrics."""
    if not path.exists():
        return 0.0
    last = 0.0
    for line in path.read_text().splitlines():
        try:
            last = float(json.loads(line).get(key, last))
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError):
            continue
    return last


def logged_steps(path: Path) -> set[int]:
    """The steps a records file (val.jsonl) holds; torn lines are not records."""
    steps = set()
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            steps.add(rec["step"])
    return steps


def log_val(t: Training, step: int, ev: dict) -> None:
    """A held-out record in val.jsonl (the learning curve: agreement and simulated τ vs training time), once per
    step."""
    if t.val_file and step not in t.val_steps:
        t.val_steps.add(step)
        rec = {"step": step, "elapsed_s": round(t.elapsed(), 3), "tokens_seen": t.tokens_before + t.tokens_run,
               **{f"val/{k}": v for k, v in ev.items()}}
        t.val_file.write(json.dumps({k: ckpt.finite_or_none(v) for k, v in rec.items()}, allow_nan=False) + "\n")
        t.val_file.flush()


def keep_if_best(t: Training, step: int, ev: dict) -> None:
    """train.keep_best: ``OUTPUT_DIR/best/`` (a drafter directory like ``final/``, plus ``eval.json`` with its step)
    holds the drafter of the held-out evaluation with the highest simulated τ so far, across resumed runs, so a
    long run done in pieces can ship its best drafter at any point."""
    if not t.cfg.train.get("keep_best", False):
        return
    best = t.out_dir / "best"
    record = best / "eval.json"
    prev = json.loads(record.read_text()).get("sim_tau", float("-inf")) if record.exists() else float("-inf")
    if not ev["sim_tau"] > prev:
        return
    ckpt.save_final(best, t.drafter, {**t.meta, "step": step})
    with out_of_space_as_error(record, "free space"):
        record.write_text(json.dumps({**ev, "step": step, "tokens_seen": t.tokens_before + t.tokens_run}, indent=1))
    t.log(f"held-out simulated tau {ev['sim_tau']:.3f} at step {step}: the best so far, kept in {best}")


def optimizer_step(t: Training, step: int) -> tuple[dict[str, float], int]:
    """One optimizer step over train.grad_accum micro-batches → (metrics averaged over them, tokens seen)."""
    cfg, d = t.cfg, t.d
    agg: dict[str, float] = {}
    toks = 0
    for micro in range(cfg.train.grad_accum):
        idx = batch_indices(len(t.train_rows), step, micro, cfg.train.batch_size, cfg.train.grad_accum, d, cfg.seed,
                            t.row_lengths, cfg.train.get("length_bucket", 0))
        ids, mask = (x.to(t.device) for x in collate([t.train_rows[i] for i in idx], t.pad_id))
        began = time.perf_counter()  # the drafter's own cost is elapsed_s - target_s (peer comparisons, profiles)
        hidden, logits = target_features(t.target, list(t.drafter.layer_ids), ids, idx, t.cache, t.teacher_ids)
        t.target_run += time.perf_counter() - began
        with torch.autocast(t.autocast[0], dtype=t.autocast[1] or torch.float32, enabled=t.autocast[1] is not None):
            loss, m = t.forward(ids, mask, hidden, logits)
        skipped = not loss.requires_grad  # nothing scored (e.g. DFlash found no trainable block in these rows)
        if skipped:  # zero gradients through every trainable weight: DDP/DeepSpeed ranks still all reduce
            loss = loss + 0.0 * sum(p.sum() for p in t.trainable)
            agg["skipped_batches"] = agg.get("skipped_batches", 0.0) + 1.0
        if t.engine is not None:
            t.engine.backward(loss)
        else:
            (loss / cfg.train.grad_accum).backward()
        toks += int(mask.sum())
        m = {**m, "loss": loss.item()}  # the optimised total, whatever the method reports
        for k, v in m.items():
            agg[k] = agg.get(k, 0.0) + float(v) / cfg.train.grad_accum
    if "skipped_batches" in agg:
        t.skipped_batches += int(agg["skipped_batches"])
    if t.engine is not None:
        check_step_finite(step + 1, agg["loss"], None)
        t.engine.step()  # clips, steps optimizer and scheduler
    else:
        if d.world_size > 1 and not isinstance(t.forward, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError("multi-process training needs DDP or DeepSpeed")
        grad_norm = torch.nn.utils.clip_grad_norm_(t.trainable, cfg.optim.grad_clip)
        check_step_finite(step + 1, agg["loss"], grad_norm)
        t.optimizer.step()
        check_weights_finite(step + 1, t.trainable)
        t.sched.step()
        t.optimizer.zero_grad(set_to_none=True)
    return agg, toks


def finish(t: Training) -> dict:
    """7. The final, self-describing drafter directory and its held-out numbers."""
    cfg, d, out_dir = t.cfg, t.d, t.out_dir
    summary: dict = {"output_dir": str(out_dir), "steps": cfg.train.steps, "method": cfg.draft.method}
    if d.is_main:
        ckpt.save_final(out_dir / "final", t.drafter, {**t.meta, "step": cfg.train.steps})
        if t.val_rows:
            ev = evaluate(t.drafter, t.target, t.val_rows, cfg.train.batch_size, t.pad_id, t.val_cache, t.teacher_ids)
            summary["val"] = ev
            t.tracker.log({f"val/{k}": v for k, v in ev.items() if v is not None}, cfg.train.steps)
            log_val(t, cfg.train.steps, ev)
            keep_if_best(t, cfg.train.steps, ev)
            with out_of_space_as_error(out_dir / "final" / "eval.json", "free space"):
                (out_dir / "final" / "eval.json").write_text(json.dumps(ev, indent=1))
            accs = ["–" if ev[f"acc_{i}"] is None else f"{ev[f'acc_{i}']:.3f}" for i in range(64) if f"acc_{i}" in ev]
            t.log(f"held-out top-1 agreement with the target by position: {' '.join(accs)}")
            t.log(f"held-out simulated tau (greedy chain): {ev['sim_tau']:.2f}")
            # e.g. Medusa builds its static draft tree from these held-out numbers
            after = registry.method(cfg.draft.method).after_training
            with out_of_space_as_error(out_dir / "final", "free space"):
                made = after(t.drafter, out_dir / "final", ev) if after is not None else None
            if made is not None:
                t.log(f"{cfg.draft.method}: wrote {made} from the held-out metrics")
        if t.skipped_batches:
            t.log(f"{t.skipped_batches} micro-batches had nothing to score (e.g. DFlash: no block of trainable "
                  "tokens) and were skipped (train/skipped_batches in metrics.jsonl)")
        t.log(f"drafter written to {out_dir / 'final'}")
    t.tracker.finish()
    for f in (t.metrics_file, t.val_file):
        if f:
            f.close()
    d.barrier()
    return summary
