"""What differs between the transformers releases this package supports (``transformers>=5.0,<6``), in one place."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from transformers import PretrainedConfig


def cache_kwargs(module: nn.Module, cache: Any) -> dict:
    """``{name: cache}`` for the keyword ``module.forward`` takes its KV cache by: ``cache`` (newer transformers 5.x)
    or ``past_key_values`` (earlier 5.x releases, remote-code models). A wrong name is no error there: it falls into
    ``**kwargs`` and the forward silently runs without the cache (seen with transformers 5.17)."""
    name = getattr(module, "_draftsmith_cache_kw", None)
    if name is None:
        name = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
        object.__setattr__(module, "_draftsmith_cache_kw", name)
    return {name: cache}


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The target's attention window when at least one layer uses it, else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    return int(window)
