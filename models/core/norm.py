"""The draft heads' RMSNorm (one class for EAGLE-3, DFlash/DSpark and P-EAGLE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, scale by ``weight`` in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # same maths, one fused op (decode is op-bound)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
