"""The built wheel is enough on its own: configs (conf/), the embedded target (models/tiny_code/) and every module
ship as package data, so a non-editable install trains. The wheel is unpacked outside the checkout and put first on
the path, and a two-step run starts from a directory with no checkout in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_alone_composes_its_configs_and_trains(tmp_path):
    # built from a copy of the tracked files: an in-tree build writes build/ and *.egg-info into the checkout, and a
    # stale egg-info there makes setuptools package whatever it listed before
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(wheels)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = wheels.glob("draftsmith-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    assert "conf/config.yaml" in names and "models/tiny_code/model.safetensors" in names
    assert not any(n.startswith("tests/") or "smollm2_drafters" in n for n in names)  # the library only
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", "import train; print(train.__file__)"], env=env, cwd=work,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(site))  # the wheel's code, not the checkout's
    r = subprocess.run([sys.executable, "-m", "train", "+recipe=eagle3", "tracking=none", "train.steps=2",
                        "train.eval_every=100", "train.eval_rows=4", "data.max_rows=8", "data.regenerate=0",
                        "data.val_rows=4", "output_dir=run"], env=env, cwd=work, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (work / "run" / "final" / "model.safetensors").exists()
