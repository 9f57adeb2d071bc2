"""`python -m eval.bench.probe --target smollm2`: which dtype this machine runs the target fastest in
(models/core/kernels.py), as JSON: t(w) for widths 1..K+1 per dtype, t(w)/t(1), the CPU's SIMD flags, the
choice ``target.dtype=auto`` would make, and the memory-bandwidth bound of plain decoding (``bandwidth``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from models.core.kernels import bandwidth_bound, probe
from models.core.target import load_causal_lm


def gemm_table(model, reps: int, rows: Sequence[int] = (1, 2, 4, 8, 16, 64)) -> dict:
    """ms of ``F.linear(x[rows, H], W)`` for the first MLP's gate weight [I, H] and the lm_head [V, H], fp32 and
    bf16, of the same weight pre-packed for oneDNN (``packed``, models/core/packed.py: what the target runs
    on a CPU) and, in bf16 where it runs, streamed by the GEMV (``gemv``, models/core/gemv.py: what a compiled step
    that chose it runs): the kernels behind decoding's few rows (a flat bf16 row means a native bf16 dot product).
    Each weight is timed repeatedly, so a small one sits in cache: the lm_head row is the one read from memory."""
    import time

    import torch.nn.functional as F

    from models.core import gemv
    from models.core.packed import PackedLinear, available, packs

    weights = {"mlp_gate": model.model.layers[0].mlp.gate_proj.weight,
               "lm_head": model.get_output_embeddings().weight}
    out: dict = {}
    for name, w32 in weights.items():
        for dt in (torch.float32, torch.bfloat16):
            w = w32.detach().to(dt)
            kernels = {"": lambda x, w=w: F.linear(x, w)}
            if available() and packs(dt):
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight = torch.nn.Parameter(w, requires_grad=False)
                kernels[" packed"] = PackedLinear(lin)
            if dt == torch.bfloat16 and gemv.unavailable() is None:
                blocked = gemv.block(w)
                kernels[" gemv"] = lambda x, b=blocked, n=w.shape[0]: torch.ops.draftsmith.bf16_linear(
                    x, b, None, n, False)
            for label, fn in kernels.items():
                row = {}
                for n in rows:
                    x = torch.randn(n, w.shape[1]).to(dt)
                    best = float("inf")
                    with torch.no_grad():
                        for _ in range(reps + 1):
                            t = time.perf_counter()
                            fn(x)
                            best = min(best, time.perf_counter() - t)
                    row[n] = round(best * 1e3, 3)
                out[f"{name} {list(w.shape)} {str(dt).replace('torch.', '')}{label}"] = row
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m eval.bench.probe --target smollm2 [--out probe.json]``: the probe alone, as JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m eval.bench.probe", description=main.__doc__)
    ap.add_argument("--target", default="tiny-code")
    ap.add_argument("--prefix-len", type=int, default=128)
    ap.add_argument("--max-width", type=int, default=6, help="widths 1..this (K+1 of a chain of K drafts)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--gemm", action="store_true",
                    help="also time F.linear (and the packed linear) on the target's MLP and lm_head weights at "
                         "1..64 rows per dtype")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, _ = load_causal_lm(a.target)
    result = {"target": a.target, **probe(model, range(1, a.max_width + 1), a.prefix_len, a.reps),
              "bandwidth": bandwidth_bound(model, a.reps)}
    if a.gemm:
        result["gemm_ms"] = gemm_table(model, a.reps)
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
