"""Subprocess driver for the kill -9 tests: train with the fault suite's config, SIGKILL-ing itself at a chosen
point inside a checkpoint write (``--kill-in NAME --at-step N``) — deterministic, unlike a timer.

    python tests/faults/kill_driver.py TARGET_DIR OUT [--kill-in save_file|torch_save|commit|latest] [--at-step N]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("WANDB_MODE", "disabled")

from tests.faults.fault_helpers import cfg_for  # noqa: E402
from train import checkpoint as ckpt  # noqa: E402
from train.loop import run  # noqa: E402


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--kill-in")
    ap.add_argument("--at-step", type=int, default=0)
    a, rest = ap.parse_known_args()
    a.overrides = [x for x in rest if x != "--"]
    step_name = f"step_{a.at_step:07d}"
    if a.kill_in == "save_file":  # half a weights file on disk, then death
        real = ckpt.save_file

        def save_file(tensors, path, **k):
            real(tensors, path, **k)
            if step_name in path:
                with open(path, "r+b") as fh:
                    fh.truncate(os.path.getsize(path) // 2)
                die()
        ckpt.save_file = save_file
    elif a.kill_in == "torch_save":
        real_save = ckpt.torch.save

        def torch_save(obj, path, *x, **k):
            if step_name in str(path):
                Path(path).write_bytes(b"PK\x03\x04 torn")
                die()
            return real_save(obj, path, *x, **k)
        ckpt.torch.save = torch_save
    elif a.kill_in in ("commit", "latest"):
        real_replace = os.replace

        def replace(src, dst):
            is_commit = Path(dst).name == step_name
            if a.kill_in == "commit" and is_commit:
                die()  # everything written, not yet renamed into place
            real_replace(src, dst)
            if a.kill_in == "latest" and is_commit:
                die()  # committed, `latest` not yet updated
        ckpt.os.replace = replace
    run(cfg_for(a.target, a.out, *a.overrides))


if __name__ == "__main__":
    main()
