"""The frozen target's linear layers with oneDNN's pre-packed weights (CPU inference).

``F.linear`` on a CPU re-lays out its weight for the GEMM kernel on every call; at decoding's few rows that
costs more than the arithmetic. oneDNN can lay the weight out once (``mkldnn._reorder_linear_weight``) and run
``mkldnn._linear_pointwise`` on it (the same sums, another order: equal to rounding). SmolLM2's shapes, one
thread, Zen 5 with two regeneration processes beside it (``python -m eval.bench.probe --target smollm2 --threads 1
--gemm`` times both on any machine), ms:

| weight | dtype | rows | F.linear | packed |
|---|---|---|---|---|
| MLP 1536×576 | bf16 | 1 / 4 | 0.085 / 0.206 | 0.045-0.066 / 0.056-0.064 |
| lm_head 49152×576 | bf16 | 1 / 4 | 10.8 / 11.4 | 2.4-5.3 / 3.6-4.0 |
| lm_head 49152×576 | fp32 | 1 / 4 | 14.9 / 24.6 | 9.2-10.1 / 6.8-7.6 |

The packed op has no autograd: a call that needs gradients, a weight on another device, or a CPU without oneDNN
takes ``F.linear``. The parameters stay what they were (same names, same tensors: tied embeddings and readers of
``.weight`` see no difference); the packed copy follows them (re-packed when the weight changes) and is never
saved or deep-copied.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

BATCH_HINT = 8  # the row count oneDNN lays the weight out for: decoding's rows (best of 1 / 8 / 64 measured)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed: tuple[tuple, torch.Tensor] | None = None

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), BATCH_HINT))
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (w.device.type != "cpu" or x.dtype != w.dtype or not packs(w.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, self.bias)
        b = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), b, "none", [], "")

    def __getstate__(self):  # deepcopy / pickling: the packed copy is rebuilt on first use
        state = self.__dict__.copy()
        state["_packed"] = None
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs this dtype's packed linear on this CPU: fp32 always, bf16 where oneDNN says it has a bf16
    path (an AVX2-only CPU has none, and the op would fail there)."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_linears(model: nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` (a frozen target on the CPU) → ``PackedLinear``, in place; how many."""
    if not available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
