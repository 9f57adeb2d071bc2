"""`python -m train +recipe=eagle3` — Hydra entry point; the recipe itself is train.loop.run.

Exit status: 0; 2 with one ``error:`` line for bad input (a setting out of range, an unusable data file, a
checkpoint made for another config, a diverged run, a full disk, a target that cannot be loaded), like
``python -m eval`` and ``train.export``.
"""

from __future__ import annotations

import sys

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig

from models.core.checkpoint import NoSpaceError
from models.core.cli import quote_non_ascii
from train.loop import run

USER_ERRORS = (ValueError, FileNotFoundError, NoSpaceError)


def user_error(e: BaseException) -> BaseException | None:
    """The user-fixable error behind ``e``: itself, or the one Hydra's ``instantiate`` wrapped ("Error in call to
    target ...", e.g. the target's loader refusing a path); None for a bug (its traceback is the report)."""
    if isinstance(e, InstantiationException) and isinstance(e.__cause__, USER_ERRORS):
        return e.__cause__
    return e if isinstance(e, USER_ERRORS) and not isinstance(e, InstantiationException) else None


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (*USER_ERRORS, InstantiationException) as e:
        err = user_error(e)
        if err is None:
            raise
        print(f"error: {(str(err).strip().splitlines() or [type(err).__name__])[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.argv[1:] = quote_non_ascii(sys.argv[1:])
    main()
