"""Two benchmark runs side by side: ``python scripts/compare_results.py OLD/results.json NEW/results.json``.

Per method present in both: τ and speedup at each temperature (batch 1), then the batch sweep's fixed-K speedups
per batch size. Prints markdown (what a closing note or README pastes); ``--out FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.bench.report import is_baseline


def _runs(r: dict) -> dict[tuple[str, float], dict]:
    return {(e["method"], float(e["temperature"])): e for e in r["runs"]}


def _f(x, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def compare(old: dict, new: dict, names: tuple[str, str] = ("old", "new")) -> str:
    a, b = _runs(old), _runs(new)
    keys = [k for k in b if k in a and not is_baseline(b[k])]
    lines = [f"| method | T | τ {names[0]} | τ {names[1]} | speedup {names[0]} | speedup {names[1]} | "
             f"tokens/s {names[0]} | tokens/s {names[1]} |", "|---|---|---|---|---|---|---|---|"]
    for k in keys:
        x, y = a[k], b[k]
        lines.append(f"| {k[0]} | {k[1]:g} | {_f(x['tau'])} | {_f(y['tau'])} | {_f(x['speedup']['median'])} | "
                     f"{_f(y['speedup']['median'])} | {_f(x['tokens_per_s']['median'], 1)} | "
                     f"{_f(y['tokens_per_s']['median'], 1)} |")
    ba, bb = (old.get("batch") or {}).get("methods", {}), (new.get("batch") or {}).get("methods", {})
    common = [m for m in bb if m in ba]
    if common:
        sizes = [s for s in new["batch"]["batch_sizes"] if s in old["batch"]["batch_sizes"]]
        lines += ["", "Batch sweep (T=0, fixed K): speedup over batched AR, " + f"{names[0]} → {names[1]}", "",
                  "| method | " + " | ".join(f"B={s}" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for m in common:
            ra = {row["batch_size"]: row for row in ba[m]["by_batch"]}
            rb = {row["batch_size"]: row for row in bb[m]["by_batch"]}
            cells = [f"{_f(ra[s]['speedup']['median'])} → {_f(rb[s]['speedup']['median'])}" for s in sizes]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--names", default="old,new", help="column labels, comma-separated")
    p.add_argument("--out")
    a = p.parse_args(argv)
    md = compare(json.loads(Path(a.old).read_text()), json.loads(Path(a.new).read_text()),
                 tuple(a.names.split(",", 1)))
    print(md, end="")
    if a.out:
        Path(a.out).write_text(md)


if __name__ == "__main__":
    main()
