"""What each benchmarked drafter cost to train, and its learning curve (read from its run directory).

A checkpoint ``RUN/final`` written by ``python -m train`` sits beside ``RUN/metrics.jsonl`` (per logged step:
``elapsed_s``, the training seconds across resumed runs), ``RUN/val.jsonl`` (held-out agreement by position
and the simulated greedy-chain τ at each ``train.eval_every``) and ``RUN/data_stats.json`` (rows, and what
regenerating the target's continuations cost). ``collect`` turns those into ``results["training"]``: per method
the steps, training minutes, regeneration minutes and the curve; ``plot`` draws τ and slot-1 agreement against
training minutes, so a reader sees where more training stops paying. Runs without these files (older ones,
or a hand-made checkpoint) are reported with what exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def read_records(path: Path) -> list[dict]:
    """A JSON-lines record file's dict records; a torn line (a run killed while writing it) is not a record."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def run_summary(checkpoint: str | Path) -> dict[str, Any] | None:
    """The training record of the run that wrote ``checkpoint`` (its parent directory), or None if there is none."""
    run = Path(checkpoint).parent
    metrics, val = read_records(run / "metrics.jsonl"), read_records(run / "val.jsonl")
    if not metrics and not val:
        return None
    data = json.loads((run / "data_stats.json").read_text()) if (run / "data_stats.json").exists() else {}
    elapsed = [float(r["elapsed_s"]) for r in metrics + val if isinstance(r.get("elapsed_s"), (int, float))]
    steps = max((int(r["step"]) for r in metrics if isinstance(r.get("step"), int)), default=None)
    curve = [{"step": r["step"], "minutes": round(float(r["elapsed_s"]) / 60, 2), "tokens_seen": r.get("tokens_seen"),
              "sim_tau": r.get("val/sim_tau"), "acc_0": r.get("val/acc_0")}
             for r in val if isinstance(r.get("elapsed_s"), (int, float))]
    return {"run_dir": str(run), "steps": steps,
            "train_minutes": round(max(elapsed) / 60, 1) if elapsed else None,
            "regen_minutes": round(data["regen_seconds_total"] / 60, 1) if "regen_seconds_total" in data else None,
            "train_rows": data.get("train_rows"), "regenerated": data.get("regenerated", []), "curve": curve}


def collect(checkpoints: Iterable[tuple[str, str | None]]) -> dict[str, dict]:
    """{method: run_summary} for (method, checkpoint dir) pairs, each checkpoint once (eagle3 and eagle3_tree
    share one drafter: reported under the first name)."""
    out: dict[str, dict] = {}
    seen: set[str] = set()
    for name, ckpt in checkpoints:
        if not ckpt or str(ckpt) in seen:
            continue
        seen.add(str(ckpt))
        s = run_summary(ckpt)
        if s is not None:
            out[name] = s
    return out


def markdown(training: Mapping[str, dict]) -> list[str]:
    if not training:
        return []
    lines = ["", "## Training cost and learning curve", "",
             "CPU minutes of each drafter's run (the machine above; training steps only, then the target's "
             "regenerated continuations), and its held-out numbers at the end (learning_curve.png: τ and slot-1 "
             "agreement against training minutes).", "",
             "| drafter | steps | train min | regen min | regenerated continuations | held-out τ (sim) "
             "| slot-1 agreement |",
             "|---|---|---|---|---|---|---|"]
    for name, t in training.items():
        last = t["curve"][-1] if t["curve"] else {}
        regen = ", ".join(f"{g['continuations']} at T={g['temperature']:g}" for g in t["regenerated"]) or "–"
        lines.append(f"| {name} | {t['steps'] or '–'} | {_n(t['train_minutes'])} | {_n(t['regen_minutes'])} | "
                     f"{regen} | {_n(last.get('sim_tau'), 2)} | {_n(last.get('acc_0'), 2)} |")
    return lines


def _n(x: Any, nd: int = 1) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def plot(training: Mapping[str, dict], path: Path, plt) -> Path | None:
    """learning_curve.png: held-out simulated τ and slot-1 agreement vs training minutes, one line per drafter, and
    (a second row, for runs that log it) vs target tokens seen."""
    curves = {n: t["curve"] for n, t in training.items() if len(t["curve"]) >= 1}
    if not curves:
        return None
    by_tokens = any(p.get("tokens_seen") is not None for c in curves.values() for p in c)
    rows = 2 if by_tokens else 1
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.8 * rows), squeeze=False)
    for r, (key, label) in enumerate([("minutes", "training minutes (CPU)"),
                                      ("tokens_seen", "target tokens trained on")][:rows]):
        for i, (name, c) in enumerate(curves.items()):
            pts = [p for p in c if p.get(key) is not None]
            xs = [p[key] for p in pts]
            for j, metric in enumerate(("sim_tau", "acc_0")):
                axes[r][j].plot(xs, [p[metric] if p[metric] is not None else float("nan") for p in pts],
                                marker="o", color=f"C{i}", label=name)
        axes[r][0].set_title("held-out simulated τ (greedy chain)")
        axes[r][1].set_title("held-out slot-1 agreement with the target")
        for ax in axes[r]:
            ax.set_xlabel(label)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_fit(curve: Iterable[Mapping[str, Any]], metric: str = "acc_0", x: str = "tokens_seen") -> dict[str, Any]:
    """Least-squares ``metric = a + b ln(x)`` over the curve's points (held-out agreement grows about linearly in
    the log of the data seen over the range a run covers); a, b, r², the number of points fitted and of points
    ``dropped`` for a non-finite x or metric (one NaN would make every sum NaN). r² is None when the fitted values
    are all equal: it is undefined there, and 1 would read as a perfect fit. Needs two points with distinct x."""
    import math

    pts, dropped = [], 0
    for p in curve:
        if not p.get(x) or p.get(metric) is None:
            continue
        u, v = float(p[x]), float(p[metric])
        if not (math.isfinite(u) and math.isfinite(v)):
            dropped += 1
        elif u > 0:
            pts.append((math.log(u), v))
    if len({u for u, _ in pts}) < 2:
        raise ValueError(f"a fit of {metric} against ln {x} needs two points with distinct finite {x}; have "
                         f"{len(pts)} ({dropped} non-finite dropped)")
    n = len(pts)
    mu, mv = sum(u for u, _ in pts) / n, sum(v for _, v in pts) / n
    suu = sum((u - mu) ** 2 for u, _ in pts)
    b = sum((u - mu) * (v - mv) for u, v in pts) / suu
    a = mv - b * mu
    ss_res = sum((v - a - b * u) ** 2 for u, v in pts)
    ss_tot = sum((v - mv) ** 2 for _, v in pts)
    return {"a": a, "b": b, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else None, "n": n, "dropped": dropped}


def x_for(fit: Mapping[str, float], y: float) -> float:
    """The x at which the fitted ``a + b ln x`` reaches ``y`` (inf when the fit does not rise)."""
    import math

    if fit["b"] <= 0:
        return math.inf
    return math.exp((y - fit["a"]) / fit["b"])
