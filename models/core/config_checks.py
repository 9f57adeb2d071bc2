"""The pieces of the methods' up-front draft-config checks (``MethodSpec.check_config``, models/core/spec.py).

train/checks.py runs a method's check on its ``draft.config`` before any model loads; each bad value is one
ValueError line naming the key as the training config spells it, ``draft.config.<field>=<value>: <fix>``. A field
the config does not set (None) is left to the config dataclass's default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

KEY = "draft.config."


def int_at_least(cfg: Mapping[str, Any], field: str, lo: int) -> None:
    v = cfg.get(field)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
        raise ValueError(f"{KEY}{field}={v!r}: must be an integer >= {lo}")


def positive_finite(cfg: Mapping[str, Any], field: str) -> None:
    v = cfg.get(field)
    if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
        raise ValueError(f"{KEY}{field}={v!r}: must be a finite number > 0")


def depth_check(depth: str, *positive: str) -> Callable[[Mapping[str, Any], int | None], None]:
    """The check of a method whose only up-front facts are its depth (how many tokens it drafts per round: an
    integer >= 1) and some finite positive weights."""

    def check(cfg: Mapping[str, Any], max_len: int | None = None) -> None:
        int_at_least(cfg, depth, 1)
        for field in positive:
            positive_finite(cfg, field)

    return check
