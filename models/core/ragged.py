"""Per-row KV caches of different lengths in one padded tensor (core: batched proposers share it).

A drafter's cache for A rows: per layer (K, V) [A, heads, C, d] with C = max n_a; row a's entries sit at
0..n_a−1, zeros past them. ``extend`` writes each row's new entries at n_a.. (one call for all rows, ragged
counts), ``retain`` drops rows, ``visible`` is the bool key mask hiding each row's padding (None when no row
has any), so a drafter runs ONE forward over all rows whatever their context lengths.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RaggedKV:
    """Padded per-row KV cache of ``layers`` layers (models/methods/dflash's batched proposer uses it)."""

    def __init__(self, rows: int, device: torch.device | str = "cpu"):
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.n = torch.zeros(rows, dtype=torch.long, device=device)  # valid entries per row

    @property
    def length(self) -> int:
        return 0 if self.kv is None else int(self.kv[0][0].shape[2])

    def extend(self, new: list[tuple[Tensor, Tensor]], r: Tensor) -> None:
        """new: per layer (K, V) [A, heads, R, d] whose first r[a] entries along R are row a's next ones."""
        width = new[0][0].shape[2]
        if width == 0 or int(r.max()) == 0:
            return
        length = max(int((self.n + r).max()), self.length)
        a, j = (torch.arange(width, device=r.device)[None] < r[:, None]).nonzero(as_tuple=True)
        dst = self.n[a] + j
        grown = []
        for layer, (k1, v1) in enumerate(new):
            if self.kv is None:
                k0, v0 = (x.new_zeros(x.shape[0], x.shape[1], length, x.shape[3]) for x in (k1, v1))
            else:
                k0, v0 = (grow(x, length) for x in self.kv[layer])
            k0[a, :, dst] = k1[a, :, j]
            v0[a, :, dst] = v1[a, :, j]
            grown.append((k0, v0))
        self.kv = grown
        self.n = self.n + r

    def retain(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.n.device)
        self.n = self.n[idx]
        if self.kv is not None:
            self.kv = [(k[idx], v[idx]) for k, v in self.kv]

    def visible(self) -> Tensor | None:
        """[A, C] bool: cache entry c is row a's (c < n_a); None when every row fills the cache."""
        if not bool((self.n != self.length).any()):
            return None
        return torch.arange(self.length, device=self.n.device)[None] < self.n[:, None]


def grow(x: Tensor, length: int) -> Tensor:
    """[A, h, C, d] → [A, h, length, d], zero-padded along C."""
    pad = length - x.shape[2]
    return x if pad <= 0 else torch.cat([x, x.new_zeros(*x.shape[:2], pad, x.shape[3])], 2)
