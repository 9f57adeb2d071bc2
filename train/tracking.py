"""Experiment tracking: W&B on rank 0 (offline without an API key), or nothing.

Every run also appends its metrics to ``OUTPUT_DIR/metrics.jsonl`` (train/loop.py), so plots
and reports never depend on a tracker being reachable.
"""

from __future__ import annotations

import os
from typing import Any, Protocol


class Tracker(Protocol):
    def start(self, config: dict, rank: int) -> None: ...

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


class NullTracker:
    def start(self, config: dict, rank: int) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    """W&B on rank 0. ``mode=None`` → online when WANDB_API_KEY is set, else offline, so a run
    on a machine without network never blocks on a login or a connection."""

    def __init__(self, project: str = "draftsmith", name: str | None = None, dir: str = ".",
                 mode: str | None = None):
        self.project, self.name, self.dir, self.mode = project, name, dir, mode
        self.run: Any = None

    def start(self, config: dict, rank: int) -> None:
        if rank != 0:
            return
        mode = self.mode or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if mode == "disabled":
            return
        import wandb

        os.makedirs(self.dir, exist_ok=True)
        self.run = wandb.init(project=self.project, name=self.name, dir=self.dir, mode=mode, config=config,
                              settings=wandb.Settings(init_timeout=60, console="off", silent=True))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
