"""speculators 0.9.0's trainer on a CPU without editing its files (scripts/peer_speculators.py ``train``): the three
device assumptions patched for the duration of one run, and its metric records kept as JSON lines."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation (X <- aX + (bA + cA^2)X, A = XX^T, on the wide orientation,
    spectral norm first scaled to <= 1) in fp32. torch.optim.Muon runs it in bf16, a GPU's fast dtype; on a CPU
    without a bf16 dot product that made the optimizer step 31 s of a 48 s step (SmolLM2 drafter, AVX2 EPYC)."""
    a, b, c = ns_coefficients
    x = grad.float()
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.T).to(grad.dtype)


@contextlib.contextmanager
def cpu_patches(metrics_file: Path):
    """speculators 0.9.0's trainer on a CPU, without editing it: its device is "cpu" (the int 0 it uses would
    mean cuda:0), its step timer's accelerator synchronize a no-op, its autocast on "cpu", and Muon's
    orthogonalisation in fp32 where the CPU has no bf16 dot product; its metric records also go to
    ``metrics_file`` (JSON lines). Everything is put back on exit."""
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    import torch.optim._muon as muon

    from models.core.kernels import native_bf16

    class CpuTrainer(trainer.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.device_type = "cpu"

    def metric_logger(*a, **k):
        setup(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(handler)

    handler = JsonLines(metrics_file)
    saved = (trainer.get_local_rank, torch.accelerator.synchronize, cli.Trainer, cli.setup_metric_logger,
             muon._zeropower_via_newtonschulz)
    setup = cli.setup_metric_logger
    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None
    cli.Trainer, cli.setup_metric_logger = CpuTrainer, metric_logger
    if not native_bf16():
        muon._zeropower_via_newtonschulz = newton_schulz_fp32
    try:
        yield
    finally:
        (trainer.get_local_rank, torch.accelerator.synchronize, cli.Trainer, cli.setup_metric_logger,
         muon._zeropower_via_newtonschulz) = saved
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
