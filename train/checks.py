"""Up-front validation of a training config: every bad value is one line naming the key, before any model loads.

Also the per-step finiteness guard: a NaN/inf loss, gradient norm or weight stops training at that step, before
the bad update (or a checkpoint of it) can be written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A bad setting; the message names the key and the fix."""


class NonFiniteError(ValueError):
    """Training diverged (NaN/inf); nothing from the bad step was applied or saved."""


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None)


def _int_at_least(cfg: DictConfig, key: str, lo: int, fix: str = "", optional: bool = False) -> None:
    v = _get(cfg, key)
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"{key}={v!r}: must be an integer >= {lo}" + (f"; {fix}" if fix else ""))


def _positive_finite(cfg: DictConfig, key: str, allow_zero: bool = False) -> None:
    v = _get(cfg, key)
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    ok = number and math.isfinite(v) and (v > 0 or allow_zero and v == 0)
    if not ok:
        raise ConfigError(f"{key}={v!r}: must be a finite number {'>=' if allow_zero else '>'} 0")


_TOP_KEYS = {"seed", "run_name", "output_dir", "train", "target", "data", "draft", "optim", "deepspeed", "tracking",
             "hydra"}


def _known_train_keys() -> set[str]:
    """The ``train:`` keys of conf/config.yaml (the one place they are declared)."""
    from pathlib import Path

    base = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "config.yaml")
    return set(base.train.keys())


def _unknown(node: DictConfig, known: set[str], prefix: str) -> None:
    import difflib

    for k in node.keys():
        if k not in known:
            close = difflib.get_close_matches(str(k), sorted(known), n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(sorted(known))}"
            value = OmegaConf.select(node, str(k), throw_on_resolution_failure=False)
            raise ConfigError(f"{prefix}{k}={value!r}: not a setting ({hint}); a `+key=value` override adds a key "
                              "that nothing reads")


def check_known_keys(cfg: DictConfig) -> None:
    """`+train.stpes=10` (Hydra's own suggestion for a typo) adds a key nothing reads: refuse it, naming the key."""
    import dataclasses

    from data.sources import DataConfig

    _unknown(cfg, _TOP_KEYS, "")
    if isinstance(cfg.get("train"), DictConfig):
        _unknown(cfg.train, _known_train_keys(), "train.")
    if isinstance(cfg.get("data"), DictConfig):
        _unknown(cfg.data, {f.name for f in dataclasses.fields(DataConfig)} | {"_target_"}, "data.")
    if isinstance(cfg.get("target"), DictConfig):
        _unknown(cfg.target, {"_target_", "name_or_path", "dtype", "trust_remote_code", "device", "gguf_file"},
                 "target.")


def check_target_settings(cfg: DictConfig) -> None:
    """target.dtype and target.device, before the target (maybe 16 GB) is loaded."""
    from models.core.target import dtype_names

    dtype = _get(cfg, "target.dtype")
    if dtype is not None and str(dtype) not in dtype_names():
        raise ConfigError(f"target.dtype={dtype!r}: use one of {dtype_names()} (the target's load precision; "
                          "weight-only int8 is an eval drafting option, options.eagle3.weights=int8)")
    device = str(_get(cfg, "target.device") or "cpu")
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"target.device={device!r}: this machine has no usable CUDA ({why}); use target.device=cpu")
    if kind == "cuda" and ":" in device:
        idx = device.split(":", 1)[1]
        if not idx.isdigit() or int(idx) >= torch.cuda.device_count():
            raise ConfigError(f"target.device={device!r}: there are {torch.cuda.device_count()} CUDA devices")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"target.device={device!r}: MPS is not available here; use target.device=cpu")
    if kind not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"target.device={device!r}: use cpu, cuda or cuda:N")


def validate_train_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first bad value (the checks are cheap and need no model)."""
    check_known_keys(cfg)
    _int_at_least(cfg, "seed", 0)
    check_target_settings(cfg)
    for key in ("train.steps", "train.batch_size", "train.grad_accum", "train.log_every", "train.eval_every",
                "train.ckpt_every", "train.keep_ckpts"):
        _int_at_least(cfg, key, 1)
    _int_at_least(cfg, "train.eval_rows", 0)
    _int_at_least(cfg, "train.threads", 0)
    _int_at_least(cfg, "train.length_bucket", 0, optional=True)
    _int_at_least(cfg, "train.stop_after", 1, optional=True)
    if _get(cfg, "train.mode") not in ("online", "offline"):
        raise ConfigError(f"train.mode={_get(cfg, 'train.mode')!r}: use 'online' or 'offline'")
    _positive_finite(cfg, "optim.optimizer.lr")
    _positive_finite(cfg, "optim.grad_clip")
    _int_at_least(cfg, "optim.warmup_steps", 0)
    r = _get(cfg, "optim.min_lr_ratio")
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 <= r <= 1:
        raise ConfigError(f"optim.min_lr_ratio={r!r}: must be a number in [0, 1]")
    for key in ("data.max_len", "data.val_rows", "data.regen_prompt_len", "data.regen_new_tokens",
                "data.regen_batch_size"):
        if _get(cfg, key) is not None:
            _int_at_least(cfg, key, 0 if key == "data.val_rows" else 1)
    _int_at_least(cfg, "data.max_rows", 1, optional=True)
    if _get(cfg, "data.kind") == "code":  # shorter windows are all dropped: "no training rows" named no setting
        from data.corpus import MIN_WINDOW

        _int_at_least(cfg, "data.max_len", MIN_WINDOW, fix=f"a code training window needs {MIN_WINDOW} tokens")
    if _get(cfg, "data.regenerate") != "all":
        _int_at_least(cfg, "data.regenerate", 0, fix="or 'all' (one continuation per training window)", optional=True)
    temps = _get(cfg, "data.regen_temperature")
    if isinstance(temps, (list, ListConfig)):
        if not temps:
            raise ConfigError("data.regen_temperature=[]: give one temperature or a non-empty list")
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ConfigError(f"data.regen_temperature={list(temps)}: every entry must be a number >= 0")
    elif temps is not None:
        _positive_finite(cfg, "data.regen_temperature", allow_zero=True)
    check_draft_config(cfg)


def check_draft_config(cfg: DictConfig) -> None:
    """The method's own up-front checks (``MethodSpec.check_config``: its depth and the like), on ``draft.config``
    as the yaml gives it. An unknown or untrainable method is refused later, when the drafter is built."""
    from models import registry

    spec = registry.METHODS.get(_get(cfg, "draft.method"))
    node = _get(cfg, "draft.config")
    if spec is None or spec.check_config is None or not isinstance(node, DictConfig):
        return
    fields = {}
    for k in node.keys():
        v = OmegaConf.select(node, str(k), default=None, throw_on_resolution_failure=False)
        fields[str(k)] = OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
    try:
        spec.check_config(fields, _get(cfg, "data.max_len"))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_resume_step(start: int, steps: int, path: Any) -> None:
    if start > steps:
        raise ConfigError(f"train.steps={steps} is below the step of the checkpoint being resumed ({start}, {path}); "
                          f"set train.steps >= {start}, or train.resume=false to start over (moves it aside)")


def check_step_finite(step: int, loss: float, grad_norm: float | torch.Tensor | None) -> None:
    """Before optimizer.step: a non-finite loss or gradient would poison every weight."""
    g = None if grad_norm is None else float(grad_norm)
    if not math.isfinite(loss) or (g is not None and not math.isfinite(g)):
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {g}"
        raise NonFiniteError(f"training diverged at step {step}: {what} (nothing from this step was applied or "
                             "saved); lower optim.optimizer.lr or raise optim.warmup_steps, and resume")


def check_weights_finite(step: int, params: Iterable[torch.Tensor]) -> None:
    """After optimizer.step: an infinite lr turns finite gradients into inf/NaN weights in one update."""
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise NonFiniteError(f"training diverged at step {step}: the optimizer step produced NaN/inf weights "
                             "(not saved); lower optim.optimizer.lr and resume from the last checkpoint")
