"""`python -m eval.probe --target smollm2`: which dtype this machine runs the target fastest in (models/kernels.py),
as JSON: t(w) for widths 1..K+1 per dtype, t(w)/t(1), the CPU's SIMD flags and the choice ``target.dtype=auto``
would make."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from models.kernels import probe
from models.target import load_causal_lm


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m eval.probe --target smollm2 [--out probe.json]``: the probe alone, as JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m eval.probe", description=main.__doc__)
    ap.add_argument("--target", default="tiny-code")
    ap.add_argument("--prefix-len", type=int, default=128)
    ap.add_argument("--max-width", type=int, default=6, help="widths 1..this (K+1 of a chain of K drafts)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, _ = load_causal_lm(a.target)
    result = {"target": a.target, **probe(model, range(1, a.max_width + 1), a.prefix_len, a.reps)}
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
