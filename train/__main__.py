"""`python -m train +recipe=eagle3` — Hydra entry point; the recipe itself is train.loop.run."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from train.loop import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
