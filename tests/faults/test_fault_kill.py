"""kill -9 anywhere, including inside checkpoint writes: the rerun resumes and ends bit-identical to an
uninterrupted run; two processes on one directory: the second is refused, the first finishes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.faults.fault_helpers import ROOT, assert_same_weights, cfg_for, metrics_steps
from train.checks import ConfigError
from train.loop import run

DRIVER = ROOT / "tests" / "faults" / "kill_driver.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
STEPS = ["train.steps=6", "train.ckpt_every=1", "train.keep_ckpts=2"]


def _drive(target_dir, out, *args, timeout=300):
    return subprocess.run([sys.executable, str(DRIVER), str(target_dir), str(out), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    run(cfg_for(target_dir, out, *STEPS))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_in,step", [("save_file", 3), ("torch_save", 4), ("commit", 2), ("latest", 5)])
def test_kill_inside_checkpoint_write_then_resume_is_exact(target_dir, tmp_path, reference, kill_in, step):
    p = _drive(target_dir, tmp_path, "--kill-in", kill_in, "--at-step", str(step), "--", *STEPS)
    assert p.returncode == -9, p.stderr[-2000:]
    assert not (tmp_path / "final").exists()
    p = _drive(target_dir, tmp_path, "--", *STEPS)  # the stale lock of the killed run is taken over
    assert p.returncode == 0, p.stderr[-2000:]
    assert "taking over stale lock" in p.stderr
    assert_same_weights(reference / "final", tmp_path / "final")
    assert metrics_steps(tmp_path) == list(range(1, 7))


@pytest.mark.slow
def test_kill_at_a_random_moment_then_resume_is_exact(target_dir, tmp_path, reference):
    slow = [*STEPS[:-2], "train.steps=40", "train.ckpt_every=1", "train.keep_ckpts=2"]
    ref = tmp_path / "ref"
    run(cfg_for(target_dir, ref, *slow))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(target_dir), str(out), "--", *slow], cwd=ROOT,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((out / "checkpoints").glob("step_*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    p = _drive(target_dir, out, "--", *slow)
    assert p.returncode == 0, p.stderr[-2000:]
    assert_same_weights(ref / "final", out / "final")


@pytest.mark.slow
def test_concurrent_run_on_one_directory_is_refused(target_dir, tmp_path):
    args = ["train.steps=300", "train.ckpt_every=50"]
    first = subprocess.Popen([sys.executable, str(DRIVER), str(target_dir), str(tmp_path), "--", *args], cwd=ROOT,
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "train.lock").exists() and time.time() < deadline:
        time.sleep(0.05)
    with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {first.pid}"):
        run(cfg_for(target_dir, tmp_path, *args))  # in-process: starts within ms, while the first one trains
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert (tmp_path / "final" / "model.safetensors").exists() and not (tmp_path / "train.lock").exists()
