"""The CPU's SIMD flags that decide which kernels are fast here (models/core/kernels.py, models/core/gemv.py)."""

from __future__ import annotations

from pathlib import Path

import torch

_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_features() -> dict:
    """The CPU's SIMD flags that decide torch's kernels, and torch's own view of them."""
    flags: set[str] = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:  # not Linux: torch's capability string still says what it uses
        pass
    return {"cpu": model, "flags": [f for f in _FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
