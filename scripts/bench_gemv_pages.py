"""`python scripts/bench_gemv_pages.py [--target smollm2] [--out F.json]`: where the GEMV's weights live, and what it
costs a decoding step: the target's laid-out bf16 linears (models/core/gemv.py), called in a step's order for one
row, each weight in its own allocation, or all in one buffer on small pages, or in one buffer on 2 MiB pages
(``gemv.pooled``, what ``prepare_gemv`` does). One thread; the three interleaved in ``--rounds`` rounds (this VM's
speed drifts within minutes), and ``torch.sum`` over as many bytes in each round for the machine's read rate.
``cpu.other_cores`` says whether anything else ran (eval/bench/quiet.py): run it alone.
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


def main() -> None:
    from eval.bench.quiet import CpuWatch
    from models.core import gemv
    from models.core.cpu import cpu_features
    from models.core.packed import Fp32Head, PackedLinear, fp32_logits
    from models.core.target import FrozenTarget

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if gemv.unavailable() is not None:
        sys.exit(f"bench_gemv_pages: the GEMV cannot run here: {gemv.unavailable()}")
    target = FrozenTarget.from_pretrained(a.target, dtype="bfloat16")
    fp32_logits(target.model)  # the harness's head: fp32 logits from the bf16 weight
    mods = [m for m in target.model.modules() if isinstance(m, (PackedLinear, Fp32Head))
            and m.weight.dtype == torch.bfloat16 and not (isinstance(m, PackedLinear) and m.out_features ==
                                                           target.model.config.vocab_size)]  # the head once
    calls = [(gemv.block(m.weight), m.weight.shape[0], isinstance(m, Fp32Head)) for m in mods]
    weights = {"separate": [w for w, _, _ in calls], "pooled_small_pages": gemv.pooled(
        [w for w, _, _ in calls], gemv.MADV_NOHUGEPAGE), "pooled_huge_pages": gemv.pooled([w for w, _, _ in calls])}
    nbytes = sum(w.numel() * 2 for w, _, _ in calls)
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {2 * w.shape[1] for w, _, _ in calls}}
    flat = torch.randn(nbytes // 2, dtype=torch.bfloat16)

    def step(ws):
        for w, (_, n, fp32) in zip(ws, calls):
            torch.ops.draftsmith.bf16_linear(xs[2 * w.shape[1]], w, None, n, fp32)
    runs = {**{k: (lambda ws=ws: step(ws)) for k, ws in weights.items()}, "torch_sum": lambda: flat.sum()}
    watch, ms = CpuWatch(), {k: [] for k in runs}
    for fn in runs.values():
        fn()
    for r in range(a.rounds):
        order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
        for k in order:
            t = time.perf_counter()
            runs[k]()
            ms[k].append(1e3 * (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in ms.items()}
    out = {"target": a.target, "weights": f"{len(calls)} laid-out bf16 linears, {nbytes / 1e6:.1f} MB, one row",
           "threads": 1, "rounds": a.rounds, "machine": cpu_features(), "cpu": watch.stop(),
           "ms_median": {k: round(v, 2) for k, v in med.items()},
           "gb_per_s": {k: round(nbytes / v / 1e6, 1) for k, v in med.items()},
           "vs_separate": {k: round(med[k] / med["separate"], 3) for k in weights},
           "rounds_ms": {k: [round(x, 2) for x in v] for k, v in ms.items()}}
    print(json.dumps({k: out[k] for k in ("ms_median", "gb_per_s", "vs_separate", "cpu")}, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
