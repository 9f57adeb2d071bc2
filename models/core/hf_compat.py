"""What differs between the transformers releases this package supports (``transformers>=5.0,<6``), in one place."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def cache_kwargs(module: nn.Module, cache: Any) -> dict:
    """``{name: cache}`` for the keyword ``module.forward`` takes its KV cache by: ``cache`` (newer transformers 5.x)
    or ``past_key_values`` (earlier 5.x releases, remote-code models). A wrong name is no error there: it falls into
    ``**kwargs`` and the forward silently runs without the cache (seen with transformers 5.17)."""
    name = getattr(module, "_draftsmith_cache_kw", None)
    if name is None:
        name = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
        object.__setattr__(module, "_draftsmith_cache_kw", name)
    return {name: cache}
