"""The EAGLE-3 recipe decided by measurement: each variant trains on the same data and feature cache, and the table
and learning curves compare them at equal CPU minutes (held-out slot-1 agreement and simulated τ from each run's
val.jsonl, against training minutes and target tokens seen).

    python scripts/ablation.py --steps 200                      # every variant, resumable, on the on-policy recipe
    python scripts/ablation.py --steps 200 --lanes 2            # two at a time, one thread each (caches built first)
    python scripts/ablation.py --only ours speculators -- train.eval_rows=100   # Hydra overrides after --
    python scripts/ablation.py --report                         # the table and plot from what has run

The variants are what the peers do differently from us (docs: ../shared/design/drafter-training.md): the EAGLE/
SpecForge optimiser settings, more training-time-test steps, speculators' frozen target head with 3 equal steps and
hidden-state noise, and larger draft vocabularies. Output: runs/ablation/<variant>/, runs/ablation/results.md and
learning_curve.png.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "ours": [],  # the recipe as it stands: lr 2e-3, TTT 4 weighted 0.8^k, a new head, 4096-token draft vocabulary
    "eagle_lr": ["optim.optimizer.lr=1e-4"],  # EAGLE / SpecForge: AdamW 5e-5..1e-4, clip 0.5
    "ttt7": ["draft.config.ttt_steps=7"],  # EAGLE-3's 7 steps weighted 0.8^k
    "speculators": ["draft.config.lm_head=target_frozen", "draft.config.ttt_steps=3", "draft.config.step_weight=1.0",
                    "draft.config.hidden_noise=0.05", "optim.optimizer.lr=1e-3"],
    "vocab8k": ["draft.config.draft_vocab_size=8192"],
    "vocab16k": ["draft.config.draft_vocab_size=16384"],
}


def train_variant(name: str, recipe: str, steps: int, root: Path, extra: list[str], threads: int = 0) -> int:
    """One variant's run (resumable: a rerun continues it); its exit status. ``threads``: torch threads (0: all)."""
    import os

    pin = [f"train.threads={threads}"] if threads else []
    cmd = [sys.executable, "-m", "train", f"+recipe={recipe}", "tracking=none", f"output_dir={root / name}",
           f"train.steps={steps}", "train.keep_best=false", *pin, *VARIANTS[name], *extra]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    print("ablation:", " ".join(cmd), flush=True)
    log = open(root / f"{name}.log", "a") if threads else None  # lanes side by side: one log each, not interleaved
    if log:
        log.write("ablation: " + " ".join(cmd) + "\n")
        log.flush()
    try:
        return subprocess.run(cmd, env=env, stdout=log, stderr=log).returncode
    finally:
        if log:
            log.close()


def train_all(names: list[str], a: argparse.Namespace) -> list[str]:
    """Every variant, ``a.lanes`` at a time (each one-threaded when more than one: equal CPU per variant); the
    names that failed."""
    from concurrent.futures import ThreadPoolExecutor

    a.root.mkdir(parents=True, exist_ok=True)
    threads = 1 if a.lanes > 1 else 0
    with ThreadPoolExecutor(a.lanes) as pool:
        rcs = list(pool.map(lambda n: train_variant(n, a.recipe, a.steps, a.root, a.extra, threads), names))
    return [n for n, rc in zip(names, rcs) if rc != 0]


class Refused(Exception):
    """A report that cannot be made: main prints its one line and exits 2."""


def _last_record(path: Path) -> dict | None:
    """A variant's last held-out record in val.jsonl (a torn last line, from a kill while writing, is skipped)."""
    from eval.bench.training import read_records

    try:
        val = read_records(path)
    except (OSError, UnicodeDecodeError) as e:
        raise Refused(f"{path}: unreadable ({e})") from None
    keys = ("step", "elapsed_s", "val/acc_0", "val/sim_tau")
    val = [r for r in val if all(isinstance(r.get(k), (int, float)) for k in keys)]
    return val[-1] if val else None


def report(root: Path, names: list[str]) -> str:
    """results.md (last held-out record of each run, its minutes and tokens) and learning_curve.png."""
    from eval.bench.training import collect, plot

    if not root.is_dir():
        raise Refused(f"{root}: no such directory (train the variants first: without --report)")
    last = {n: _last_record(root / n / "val.jsonl") for n in names if (root / n / "val.jsonl").exists()}
    waiting = [n for n in names if last.get(n) is None]
    if len(waiting) == len(names):
        raise Refused(f"{root}: no variant of {names} has a held-out record yet (<variant>/val.jsonl); train them "
                      "first, or let train.eval_every steps pass")
    runs = [(n, str(root / n / "final")) for n in names if last.get(n) is not None]
    try:
        training = collect(runs)
    except (OSError, ValueError) as e:  # a damaged data_stats.json or metrics.jsonl
        raise Refused(f"{root}: a variant's training record is unreadable ({e})") from None
    lines = ["| variant | overrides | steps | CPU min | target tokens | held-out slot-1 | sim. τ |",
             "|---|---|---|---|---|---|---|"]
    for name, _ in runs:
        r = last[name]
        lines.append(f"| {name} | {' '.join(VARIANTS[name]) or '(recipe)'} | {r['step']} | "
                     f"{r['elapsed_s'] / 60:.1f} | {r.get('tokens_seen', '–')} | {r['val/acc_0']:.3f} | "
                     f"{r['val/sim_tau']:.2f} |")
    if waiting:
        lines += ["", f"No held-out record yet: {', '.join(waiting)}."]
    text = "\n".join(lines) + "\n"
    (root / "results.md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot(training, root / "learning_curve.png", plt)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="eagle3_smollm2_onpolicy")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="these variants (default: all)")
    ap.add_argument("--root", type=Path, default=Path("runs/ablation"))
    ap.add_argument("--report", action="store_true", help="only the table and plot from what has run")
    ap.add_argument("--lanes", type=int, default=1,
                    help="variants run side by side, one thread each (build the feature cache first: every lane "
                         "would build it)")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every variant (e.g. train.eval_every=50)")
    a = ap.parse_args(argv)
    names = a.only or list(VARIANTS)
    if not a.report:
        failed = train_all(names, a)
        if failed:
            print(f"error: variants {failed} failed (their logs: {a.root}/<name>.log with --lanes); rerun to resume",
                  file=sys.stderr)
            return 2
    try:
        print(report(a.root, names))
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
