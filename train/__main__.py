"""`python -m train +recipe=eagle3` — Hydra entry point; the recipe itself is train.loop.run.

Exit status: 0; 2 with one ``error:`` line for bad input (a setting out of range, an unusable data file, a
checkpoint made for another config, a diverged run, a full disk), like ``python -m eval`` and ``train.export``.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from train.checkpoint import NoSpaceError
from train.loop import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, NoSpaceError) as e:
        print(f"error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
