"""NaN/inf never trains "successfully": the guard stops at the step, nothing non-finite is saved, loaded,
validated or evaluated, and metrics.jsonl stays JSON."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from models.core.checkpoint import nonfinite_tensors
from models.core.target import FrozenTarget
from models.registry import load_drafter
from tests.faults.fault_helpers import cfg_for, metrics_steps, weights
from train import checkpoint as ckpt
from train.checks import ConfigError, NonFiniteError
from train.loop import run


@pytest.mark.parametrize("lr", ["1e30", "1e36"])
def test_diverging_lr_stops_naming_the_step_and_writes_nothing_non_finite(target_dir, tmp_path, lr):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"training diverged at step \d+"):
        run(cfg_for(target_dir, out, f"optim.optimizer.lr={lr}", "train.ckpt_every=1", "train.steps=6"))
    assert not (out / "final").exists()
    for c in ckpt.complete_checkpoints(out / "checkpoints"):
        assert not nonfinite_tensors(weights(c)), c
    metrics_steps(out)  # strict JSON, or this raises


def test_infinite_lr_is_a_config_error(target_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"optim.optimizer.lr=inf"):
        run(cfg_for(target_dir, tmp_path, "optim.optimizer.lr=inf"))


def test_metrics_non_finite_value_written_as_null(target_dir, tmp_path):
    assert ckpt.finite_or_none(float("nan")) is None and ckpt.finite_or_none(1.5) == 1.5
    assert ckpt.finite_or_none(math.inf) is None


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    run(cfg_for(target_dir, out, "train.steps=2"))
    return out


def _poison(src, dst):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    w = weights(src)
    k = next(k for k, v in w.items() if v.is_floating_point())
    w[k] = w[k].clone()
    w[k].view(-1)[0] = float("nan")
    save_file(w, str(dst / "model.safetensors"))
    return dst


def test_loader_refuses_nan_drafter(target_dir, trained, tmp_path):
    bad = _poison(trained / "final", tmp_path / "nan")
    target = FrozenTarget.from_pretrained(str(target_dir))
    with pytest.raises(ValueError, match="hold NaN/inf"):
        load_drafter(bad, target)


def test_save_refuses_nan_module(target_dir, trained, tmp_path):
    target = FrozenTarget.from_pretrained(str(target_dir))
    drafter, meta = load_drafter(trained / "final", target)
    with torch.no_grad():
        next(p for p in drafter.parameters() if p.requires_grad).fill_(float("inf"))
    with pytest.raises(ValueError, match="refusing to write"):
        ckpt.save_final(tmp_path / "final", drafter, meta)
    with pytest.raises(ValueError, match="refusing to checkpoint step 3"):
        ckpt.save_checkpoint(tmp_path / "ck", 3, drafter, meta, {})
    assert not (tmp_path / "final").exists() and not list((tmp_path / "ck").glob("step_*"))


def test_export_validator_refuses_nan_weights(target_dir, trained, tmp_path):
    from models.export.api import export
    from models.export.shared.common import ExportError
    from models.export.validate import validate

    target = FrozenTarget.from_pretrained(str(target_dir))
    drafter, meta = load_drafter(trained / "final", target)
    out = export(drafter, "eagle3", tmp_path / "exp", target, meta=meta)
    validate(out, None, target)
    w = weights(out)
    k = next(k for k, v in w.items() if v.is_floating_point())
    w[k].view(-1)[0] = float("nan")
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="hold NaN/inf"):
        validate(out, None, target)


def test_eval_refuses_nan_drafter(target_dir, trained, tmp_path):
    from eval.bench.setup import build_methods

    bad = _poison(trained / "final", tmp_path / "nan")
    target = FrozenTarget.from_pretrained(str(target_dir))
    with pytest.raises(ValueError, match="hold NaN/inf"):
        build_methods(target, ["ar", "eagle3"], {"eagle3": str(bad)})
