"""speculators 0.9.0's trainer on a CPU without editing its files (scripts/peer_speculators.py ``train``): the three
device assumptions patched for the duration of one run, and its metric records kept as JSON lines."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch


@contextlib.contextmanager
def cpu_patches(metrics_file: Path):
    """speculators 0.9.0's trainer on a CPU, without editing it: its device is "cpu" (the int 0 it uses would
    mean cuda:0), its step timer's accelerator synchronize a no-op, its autocast on "cpu"; its metric records
    also go to ``metrics_file`` (JSON lines). Everything is put back on exit."""
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer

    class CpuTrainer(trainer.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.device_type = "cpu"

    def metric_logger(*a, **k):
        setup(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(handler)

    handler = JsonLines(metrics_file)
    saved = (trainer.get_local_rank, torch.accelerator.synchronize, cli.Trainer, cli.setup_metric_logger)
    setup = cli.setup_metric_logger
    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None
    cli.Trainer, cli.setup_metric_logger = CpuTrainer, metric_logger
    try:
        yield
    finally:
        trainer.get_local_rank, torch.accelerator.synchronize, cli.Trainer, cli.setup_metric_logger = saved
        logging.getLogger("speculators.metrics").removeHandler(handler)


class JsonLines(logging.Handler):
    """speculators' train / val metric records (dicts) as JSON lines: loss, full_acc_k, tokens/s per step. The file
    is opened per record: speculators' later logging set-up closes every handler it finds."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        m = record.msg
        if isinstance(m, dict) and ("train" in m or "val" in m):
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"time": round(time.time(), 3), **m}, default=float) + "\n")
