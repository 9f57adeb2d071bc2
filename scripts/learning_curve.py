"""A drafter run's learning curve, and what more data would cost: held-out slot-1 agreement and simulated τ against
target tokens trained on and CPU hours (from the run's val.jsonl and metrics.jsonl), a fit of each against the log
of the tokens seen, and the tokens and hours (this CPU's measured training rate; one GPU's from bench/gpu_cost/) at
which the fit reaches a goal.

    python scripts/learning_curve.py models/smollm2_drafters/eagle3_onpolicy --out bench/onpolicy_curve
    python scripts/learning_curve.py runs/eagle3_smollm2_onpolicy --goal-acc 0.6 --first-epoch
    python scripts/learning_curve.py eagle3=models/smollm2_drafters/eagle3_onpolicy dflash=runs/dflash_smollm2_onpolicy

Writes learning_curve.png, learning_curve.json and learning_curve.md under --out. Several runs (NAME=DIR) are
compared instead: each one's held-out numbers at the largest token count and CPU time every run reached, its best,
and its gain per doubling of tokens, with their curves in one plot. Tokens past one epoch
(``train_target_tokens`` in data_stats.json) are repeats of the same rows, not fresh data: ``--first-epoch`` fits the
points of the first epoch only, and the report says how many epochs each point had seen.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.bench.training import log_fit, read_records, x_for  # noqa: E402

# bench/gpu_cost/README.md: the GPU recipe's EAGLE-3 step on one H200, bf16 autocast, an 8B-shaped target; a bound
# for smaller targets, whose forward and drafter are cheaper
GPU_TOKENS_PER_S = 4396.0
# docs/throughput.md: regeneration on this CPU, two one-thread processes (fresh data has to be answered by the target)
CPU_REGEN_TOKENS_PER_S = 396.0  # the third tranche, bf16, refill, grouped prefill, whole job


class Refused(SystemExit):
    """A run this script cannot read: its message is one ``error:`` line, which main prints before exiting 2."""


def _records(path: Path) -> list[dict]:
    """A run's JSON-lines file; a torn line (a kill while writing) is skipped, a missing or unreadable file
    refused."""
    if not path.exists():
        raise Refused(f"error: {path}: missing (a run directory or shipped drafter has one)")
    try:
        return read_records(path)
    except (OSError, UnicodeDecodeError) as e:
        raise Refused(f"error: {path}: unreadable ({e})") from None


def _epoch_tokens(run: Path) -> int | None:
    """data_stats.json's train_target_tokens (None without the file)."""
    stats = run / "data_stats.json"
    if not stats.exists():
        return None
    try:
        return json.loads(stats.read_text()).get("train_target_tokens")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise Refused(f"error: {stats}: unreadable ({e})") from None


def held_out(run: Path) -> tuple[list[dict], int]:
    """The held-out records (step, tokens seen, CPU hours of training, slot-1 agreement, simulated τ), and how
    many were dropped for a value that is not a finite number (a NaN loss would otherwise poison every fit)."""
    if not run.is_dir():
        raise Refused(f"error: {run}: no such run directory")
    out, dropped = [], 0
    for r in _records(run / "val.jsonl"):
        if r.get("tokens_seen") is None or r.get("val/acc_0") is None:
            continue
        vals = [_finite(r.get(k)) for k in ("tokens_seen", "elapsed_s", "val/acc_0", "val/sim_tau")]
        if None in vals:
            dropped += 1
            continue
        tokens, elapsed, acc, tau = vals
        out.append({"step": r["step"], "tokens_seen": int(tokens), "cpu_hours": round(elapsed / 3600, 3),
                    "acc_0": round(acc, 4), "sim_tau": round(tau, 4)})
    if len(out) < 2:
        raise Refused(f"error: {run}/val.jsonl has {len(out)} held-out record(s) with tokens_seen and finite "
                         f"values ({dropped} non-finite dropped); a curve needs 2")
    return out, dropped


def curve(run: Path) -> list[dict]:
    return held_out(run)[0]


def _finite(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _dropped(n: int) -> str:
    return f"{n} held-out record(s) with a non-finite value dropped"


def cpu_rate(run: Path) -> float:
    """The run's median training rate (target tokens/s) over its logged steps."""
    rates = [float(r["tok_per_s"]) for r in _records(run / "metrics.jsonl") if r.get("tok_per_s")]
    if not rates:
        raise Refused(f"error: {run}/metrics.jsonl has no tok_per_s records")
    return statistics.median(rates)


def project(points: list[dict], goals: dict[str, float], cpu_tok_s: float, gpu_tok_s: float,
            regen_tok_s: float = CPU_REGEN_TOKENS_PER_S) -> dict:
    """Per metric: the fit and the tokens at which it reaches its goal, with the hours to train on them (this CPU,
    one GPU) and to regenerate them as fresh data on this CPU."""
    out = {}
    for metric, goal in goals.items():
        fit = log_fit(points, metric)
        tokens = x_for(fit, goal)
        done = math.isfinite(tokens)
        out[metric] = {"fit": fit, "goal": goal, "tokens": tokens if done else None,
                       "cpu_hours": tokens / cpu_tok_s / 3600 if done else None,
                       "gpu_hours": tokens / gpu_tok_s / 3600 if done else None,
                       "regen_cpu_hours": tokens / regen_tok_s / 3600 if done else None,
                       "per_doubling": fit["b"] * math.log(2)}
    return out


def markdown(points: list[dict], proj: dict, epoch_tokens: int | None, cpu_tok_s: float, gpu_tok_s: float,
             dropped: int = 0) -> str:
    lines = ["| step | target tokens seen | epochs | training hours | held-out slot-1 | sim. τ |",
             "|---|---|---|---|---|---|"]
    for p in points:
        ep = f"{p['tokens_seen'] / epoch_tokens:.2f}" if epoch_tokens else "–"
        lines.append(f"| {p['step']} | {p['tokens_seen']:,} | {ep} | {p['cpu_hours']:.2f} | {p['acc_0']:.3f} | "
                     f"{p['sim_tau']:.3f} |")
    lines += ["", f"Fit `y = a + b ln(tokens)` over {next(iter(proj.values()))['fit']['n']} points"
              f"{f' ({_dropped(dropped)})' if dropped else ''}; cost at "
              f"{cpu_tok_s:.0f} target tokens/s on this CPU (the run's median) and {gpu_tok_s:.0f} on one GPU; "
              f"regenerating that many fresh tokens here at {CPU_REGEN_TOKENS_PER_S:.0f}/s:", "",
              "| metric | a | b | r² | gain per doubling | goal | tokens to goal | train, CPU h | train, GPU h "
              "| regenerate, CPU h |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for metric, r in proj.items():
        f = r["fit"]
        tok = "never (not rising)" if r["tokens"] is None else f"{r['tokens']:.3g}"
        cpu = "–" if r["cpu_hours"] is None else f"{r['cpu_hours']:.3g}"
        gpu = "–" if r["gpu_hours"] is None else f"{r['gpu_hours']:.3g}"
        regen = "–" if r["regen_cpu_hours"] is None else f"{r['regen_cpu_hours']:.3g}"
        r2 = "undefined (flat)" if f["r2"] is None else f"{f['r2']:.3f}"
        lines.append(f"| {metric} | {f['a']:.3f} | {f['b']:.4f} | {r2} | {r['per_doubling']:+.3f} | "
                     f"{r['goal']} | {tok} | {cpu} | {gpu} | {regen} |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], proj: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = [p["tokens_seen"] for p in points]
    hi = max([*xs, *(r["tokens"] for r in proj.values() if r["tokens"] and r["tokens"] < 100 * max(xs))])
    grid = [min(xs) * (hi / min(xs)) ** (i / 50) for i in range(51)]
    for ax, (metric, title) in zip(axes, [("acc_0", "held-out slot-1 agreement"), ("sim_tau", "held-out sim. τ")]):
        ax.plot(xs, [p[metric] for p in points], "o", label="measured")
        if metric in proj:
            f = proj[metric]["fit"]
            ax.plot(grid, [f["a"] + f["b"] * math.log(g) for g in grid], "--", label="fit a + b ln(tokens)")
            ax.axhline(proj[metric]["goal"], color="grey", lw=0.8, label="goal")
        ax.set_xscale("log")
        ax.set_xlabel("target tokens trained on")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def at_most(points: list[dict], key: str, x: float) -> dict:
    """The last held-out record with ``key`` <= x (records are in step order): a measured point, not interpolated."""
    return [p for p in points if p[key] <= x][-1]


def compare(curves: dict[str, list[dict]]) -> tuple[str, dict]:
    """Runs side by side at the largest target-token count and CPU time that every one of them reached."""
    tokens = min(max(p["tokens_seen"] for p in c) for c in curves.values())
    hours = min(max(p["cpu_hours"] for p in c) for c in curves.values())
    rows = {}
    for name, c in curves.items():
        at_tok, at_h = at_most(c, "tokens_seen", tokens), at_most(c, "cpu_hours", hours)
        best = max(c, key=lambda p: p["acc_0"])
        rows[name] = {"at_tokens": at_tok, "at_hours": at_h, "best": best, "last": c[-1],
                      "acc_0_per_doubling": log_fit(c, "acc_0")["b"] * math.log(2)}
    lines = [f"Held-out numbers of each run at {tokens:,} target tokens and at {hours:.2f} training hours (the most "
             "that every run reached; the last record at or below it), at its best slot-1 step, and the fit's gain "
             "per doubling of tokens.", "",
             "| drafter | slot-1 @ tokens | sim. τ @ tokens | slot-1 @ hours | sim. τ @ hours | best slot-1 (step) "
             "| sim. τ there | gain per doubling | last step, tokens, hours |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        t, h, b, last = r["at_tokens"], r["at_hours"], r["best"], r["last"]
        lines.append(f"| {name} | {t['acc_0']:.3f} | {t['sim_tau']:.2f} | {h['acc_0']:.3f} | {h['sim_tau']:.2f} | "
                     f"{b['acc_0']:.3f} ({b['step']}) | {b['sim_tau']:.2f} | {r['acc_0_per_doubling']:+.3f} | "
                     f"{last['step']}, {last['tokens_seen']:,}, {last['cpu_hours']:.2f} |")
    return "\n".join(lines) + "\n", {"tokens": tokens, "hours": hours, "runs": rows}


def named_runs(args: list[str]) -> dict[str, Path]:
    """NAME=DIR (or DIR, named by its folder) -> {name: dir}."""
    out = {}
    for a in args:
        name, _, path = a.rpartition("=")
        path = Path(path)
        out[name or path.name] = path
    if len(out) < len(args):
        raise Refused(f"error: two runs share a name in {args}; name them NAME=DIR")
    return out


def main_compare(runs: dict[str, Path], out: Path | None) -> int:
    from eval.bench.training import plot as plot_runs
    from eval.bench.training import run_summary

    read = {name: held_out(run) for name, run in runs.items()}
    text, rep = compare({name: c for name, (c, _) in read.items()})
    text += "".join(f"\n{name}: {_dropped(d)}\n" for name, (_, d) in read.items() if d)
    rep["dropped_non_finite"] = {name: d for name, (_, d) in read.items()}
    print(text)
    if out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out.mkdir(parents=True, exist_ok=True)
        (out / "learning_curve.md").write_text(text)
        (out / "learning_curve.json").write_text(json.dumps({"runs": {n: str(r) for n, r in runs.items()}, **rep},
                                                            indent=1))
        try:
            summaries = {n: run_summary(r / "final") for n, r in runs.items()}
        except (OSError, UnicodeDecodeError, ValueError) as e:  # a damaged data_stats.json
            raise Refused(f"error: a run's training record is unreadable ({e})") from None
        plot_runs(summaries, out / "learning_curve.png", plt)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except Refused as e:
        print(e.code, file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="+", help="a run directory or a shipped drafter (val.jsonl, metrics.jsonl); "
                                           "several (NAME=DIR) are compared")
    ap.add_argument("--out", type=Path, help="where learning_curve.{png,json,md} go (default: print only)")
    ap.add_argument("--goal-acc", type=float, default=0.6,
                    help="held-out slot-1 agreement goal (0.6: the first-draft goal; a benchmark accepts less)")
    ap.add_argument("--goal-tau", type=float, default=2.5, help="simulated τ goal")
    ap.add_argument("--gpu-tok-s", type=float, default=GPU_TOKENS_PER_S)
    ap.add_argument("--first-epoch", action="store_true", help="fit only points within the first epoch")
    a = ap.parse_args(argv)
    if len(a.run) > 1:
        return main_compare(named_runs(a.run), a.out)
    a.run = Path(a.run[0])
    points, dropped = held_out(a.run)
    epoch = _epoch_tokens(a.run)
    fitted = [p for p in points if not (a.first_epoch and epoch and p["tokens_seen"] > epoch)]
    cpu_tok_s = cpu_rate(a.run)
    proj = project(fitted, {"acc_0": a.goal_acc, "sim_tau": a.goal_tau}, cpu_tok_s, a.gpu_tok_s)
    text = markdown(points, proj, epoch, cpu_tok_s, a.gpu_tok_s, dropped)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "learning_curve.md").write_text(text)
        (a.out / "learning_curve.json").write_text(json.dumps(
            {"run": str(a.run), "points": points, "epoch_tokens": epoch, "cpu_tokens_per_s": cpu_tok_s,
             "gpu_tokens_per_s": a.gpu_tok_s, "first_epoch_only": a.first_epoch, "dropped_non_finite": dropped,
             "projection": proj}, indent=1))
        plot(points, proj, a.out / "learning_curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
