"""Counting host synchronisations, on any device, CPU included.

On a GPU a kernel launch returns at once and the host runs ahead; it waits (a *sync*) only where it reads a value the
device computes: ``.item()``, ``.tolist()``, ``bool(t)``/``int(t)``, a copy to the host, or an op whose output shape
depends on the data (``nonzero``, boolean-mask indexing, ``unique``). Every sync drains the launch queue, so a decode
round with many of them runs at the speed of Python, not of the kernels. On a CPU nothing waits, so the cost stays
hidden there; ``HostSyncCounter`` makes it visible by counting the calls that *would* sync, through a
``TorchFunctionMode`` (it sees tensor methods and torch functions alike), so a test on a CPU can fail when a round adds
one. ``torch.cuda.set_sync_debug_mode`` is the GPU's own check (scripts/gpu_check.py).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# tensor -> host value: the host waits for the device to produce it
HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"})
# output shape depends on the values, so the host must learn it before allocating
DATA_SHAPED = frozenset({"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "repeat_interleave"})


def _name(func) -> str:
    return getattr(func, "__name__", "") or str(func)


def _mask_index(args) -> bool:
    """``t[mask]`` with a bool tensor anywhere in the index: a data-dependent shape."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as c: ...`` then ``c.total`` / ``c.by_op``: the calls inside that would make a GPU
    host wait. Device-to-host copies (``.cpu()``, ``.to("cpu")``) are counted when the tensor is not already on the
    host, which on a CPU run is never: there, count host reads and data-shaped ops, which sync on any device."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.where: Counter[str] | None = Counter() if where else None  # "file:line op" of each, when asked

    def _count(self, op: str) -> None:
        self.by_op[op] += 1
        if self.where is not None:
            self.where[f"{_caller()} {op}"] += 1

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        if name in HOST_READS or name in DATA_SHAPED:
            if name != "repeat_interleave" or _tensor_repeats(args, kwargs):
                self._count(name)
        elif name == "__getitem__" and _mask_index(args):
            self._count("bool-mask index")
        elif name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            if name == "cpu" or _to_host(args, kwargs):
                self._count(f"{name} (device to host)")
        return func(*args, **(kwargs or {}))


def _tensor_repeats(args, kwargs) -> bool:
    """``repeat_interleave`` syncs only for tensor repeats without ``output_size`` (an int's output size is known)."""
    kwargs = kwargs or {}
    reps = kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None)
    return isinstance(reps, torch.Tensor) and kwargs.get("output_size") is None


def _to_host(args, kwargs) -> bool:
    dev = (kwargs or {}).get("device", args[1] if len(args) > 1 else None)
    return dev is not None and not isinstance(dev, torch.dtype) and torch.device(dev).type == "cpu"


_ROOT = Path(__file__).resolve().parents[2]


def _caller() -> str:
    """The innermost frame in this repository outside this file: where the sync is written."""
    f = sys._getframe(2)
    while f is not None:
        path = Path(f.f_code.co_filename)
        if path != Path(__file__) and _ROOT in path.parents and "site-packages" not in path.parts:
            return f"{path.relative_to(_ROOT)}:{f.f_lineno}"
        f = f.f_back
    return "?"
