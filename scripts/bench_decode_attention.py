"""`python scripts/bench_decode_attention.py [--out F.json]`: decoding attention at SmolLM2's shapes (9 query heads
over 3 KV heads, head dim 64, a 768-entry static cache), bf16, one thread: the native ``draftsmith::gqa_decode``
against the two grouped matmuls (models/core/attention.py), at a few filled lengths and query rows: what
NATIVE_ROWS there is chosen from.

Both run over the whole capacity with the mask hiding the unfilled columns, as a static cache's step calls them.
Each is the median of ``--calls`` calls, the two interleaved in ``--rounds`` rounds (this VM's speed drifts within
minutes). ``cpu.other_cores`` says whether anything else ran (eval/bench/quiet.py): run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (filled columns, query rows)
CASES = [(140, 1), (400, 1), (140, 5), (600, 5), (600, 8), (140, 16), (600, 16), (760, 16)]


def _time(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    from eval.bench.quiet import CpuWatch
    from models.core import attention, gemv
    from models.core.cpu import cpu_features

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if gemv.unavailable() is not None:
        sys.exit(f"bench_decode_attention: the native kernels cannot run here: {gemv.unavailable()}")
    watch, rows = CpuWatch(), []
    for filled, q in CASES:
        g = torch.Generator().manual_seed(filled + q)
        qh = torch.randn(1, 9, q, 64, generator=g).bfloat16()
        k, v = (torch.randn(1, 3, 768, 64, generator=g).bfloat16() for _ in range(2))
        mask = torch.zeros(1, 1, q, 768, dtype=torch.bool)
        mask[..., :filled] = True
        us: dict[str, list[float]] = {"native": [], "matmuls": []}
        for _ in range(a.rounds):
            us["native"].append(1e6 * _time(lambda: attention._native(qh, k, v, mask, 0.125), a.calls))
            gemv._state["why"] = "off for the comparison"  # gemv.ready() False: the matmul path
            try:
                us["matmuls"].append(1e6 * _time(lambda: attention.grouped_attention(qh, k, v, mask, 0.125),
                                                 a.calls))
            finally:
                gemv._state["why"] = None
        rows.append({"filled": filled, "query_rows": q, **{f"{n}_us": round(min(t), 1) for n, t in us.items()},
                     "rounds_us": {n: [round(x, 1) for x in t] for n, t in us.items()}})
        print(rows[-1])
    out = {"shapes": "SmolLM2: 9 query heads, 3 KV heads, head dim 64, capacity 768, bf16", "threads": 1,
           "calls": a.calls, "machine": cpu_features(), "cpu": watch.stop(), "cases": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
