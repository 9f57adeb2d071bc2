"""Every invalid value is one line naming the key, before anything is loaded or written; one run per directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.faults.fault_helpers import ROOT, cfg_for
from train import runlock
from train.checks import ConfigError
from train.loop import run

BAD = [
    ("train.steps=0", "train.steps"), ("train.steps=-5", "train.steps"), ("train.batch_size=0", "train.batch_size"),
    ("train.grad_accum=0", "train.grad_accum"), ("train.ckpt_every=0", "train.ckpt_every"),
    ("train.log_every=0", "train.log_every"), ("train.eval_every=0", "train.eval_every"),
    ("train.keep_ckpts=0", "train.keep_ckpts"), ("train.stop_after=0", "train.stop_after"),
    ("train.mode=sideways", "train.mode"), ("optim.optimizer.lr=0", "optim.optimizer.lr"),
    ("optim.optimizer.lr=-1e-4", "optim.optimizer.lr"), ("optim.optimizer.lr=nan", "optim.optimizer.lr"),
    ("optim.grad_clip=inf", "optim.grad_clip"), ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"), ("draft.config.ttt_steps=0", "draft.config.ttt_steps"),
    ("data.max_len=0", "data.max_len"), ("data.regen_temperature=inf", "data.regen_temperature"),
    ("data.regen_batch_size=0", "data.regen_batch_size"), ("train.batch_size=1.5", "train.batch_size"),
    ("data.regen_temperature=[]", "data.regen_temperature"),
    ("data.regen_temperature=[0,-1]", "data.regen_temperature"),
    ("data.regenerate=most", "data.regenerate"), ("data.regenerate=-1", "data.regenerate"),
    ("seed=abc", "seed"), ("seed=-1", "seed"), ("+train.stpes=10", "train.stpes"), ("+stpes=10", "stpes"),
    ("+data.max_lenn=8", "data.max_lenn"), ("target.dtype=int8", "target.dtype"),
    ("target.device=tpu", "target.device"),
]


@pytest.mark.parametrize("override,key", BAD, ids=[b[0] for b in BAD])
def test_invalid_value_is_one_line_naming_the_key(target_dir, tmp_path, override, key):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        run(cfg_for(target_dir, out, override))
    msg = str(e.value)
    assert msg.startswith(key + "=") and "\n" not in msg
    assert not out.exists()  # refused before anything was written


DEPTHS = [("eagle3", "draft.config.ttt_steps", 0), ("medusa", "draft.config.num_heads", 0),
          ("mtp", "draft.config.num_modules", 0), ("dflash", "draft.config.block_size", 1),
          ("peagle", "draft.config.num_depths", 0)]


@pytest.mark.parametrize("method,key,bad", DEPTHS, ids=[d[0] for d in DEPTHS])
def test_every_method_checks_its_depth(tmp_path, method, key, bad):
    """Each method's own check (MethodSpec.check_config), reached through the registry before anything loads."""
    from hydra import compose, initialize_config_dir

    from tests.faults.fault_helpers import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", [f"draft={method}", f"{key}={bad}", f"output_dir={tmp_path}/run", "tracking=none"])
    with pytest.raises(ConfigError) as e:
        run(cfg)
    assert str(e.value).startswith(f"{key}={bad}: must be an integer >= ") and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_every_trainable_method_declares_its_checks():
    from models import registry

    assert sorted(registry.trainable_methods()) == sorted(m for m, _, _ in DEPTHS)
    assert all(registry.method(m).check_config is not None for m in registry.trainable_methods())


def _lock_held_by(out, pid, host=None):
    out.mkdir(parents=True, exist_ok=True)
    (out / runlock.LOCK).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                "started": "earlier"}))


def test_second_run_on_a_directory_is_refused(target_dir, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_held_by(tmp_path, holder.pid)
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {holder.pid}"):
            run(cfg_for(target_dir, tmp_path))
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "final").exists()
    finally:
        holder.kill()
        holder.wait()


def test_lock_from_another_host_is_not_guessed_about(tmp_path):
    _lock_held_by(tmp_path, 1, host="some-other-host")
    with pytest.raises(ConfigError, match="some-other-host"):
        runlock.acquire(tmp_path)


def test_stale_lock_is_taken_over_with_a_warning(target_dir, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock_held_by(tmp_path, dead.pid)
    run(cfg_for(target_dir, tmp_path, "train.steps=2"))
    assert "taking over stale lock" in capsys.readouterr().err
    assert not (tmp_path / runlock.LOCK).exists()  # released at the end


def test_lock_exclusive_and_released_on_error(target_dir, tmp_path):
    lock = runlock.acquire(tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(ConfigError, match="in use"):
        runlock.acquire(tmp_path)
    lock.unlink()
    with pytest.raises(ValueError, match="out of range"):  # fails inside the run: the lock must still go
        run(cfg_for(target_dir, tmp_path, "draft.config.layer_ids=[1,2,9]"))
    assert not (tmp_path / runlock.LOCK).exists()


@pytest.mark.slow
def test_train_cli_prints_one_error_line_and_exits_2(target_dir, tmp_path):
    cmd = [sys.executable, "-m", "train", f"target.name_or_path={target_dir}", f"output_dir={tmp_path}",
           "tracking=none", "train.steps=0"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert lines == ["error: train.steps=0: must be an integer >= 1"], p.stderr


def test_typo_key_names_the_setting_it_meant(target_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^train.stpes=10: not a setting \(did you mean train.steps\?\)"):
        run(cfg_for(target_dir, tmp_path / "run", "+train.stpes=10"))


def test_dflash_block_longer_than_max_len_is_refused(target_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    from tests.faults.fault_helpers import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", ["+recipe=dflash", "draft.config.block_size=64", "data.max_len=32",
                                 f"output_dir={tmp_path}/run", "tracking=none"])
    with pytest.raises(ConfigError, match=r"draft.config.block_size=64 is longer than data.max_len=32"):
        run(cfg)
    assert not (tmp_path / "run").exists()
