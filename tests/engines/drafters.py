"""Every tiny-code drafter the engine tier serves (vLLM and llama.cpp), in one table, trained once per session.

The tier's cost is mostly these eight small training runs. Each is one-threaded (``OMP_NUM_THREADS=1``), so they
run side by side, one per core (``DRAFTSMITH_ENGINE_JOBS``, default: the machine's cores, at most 4), each
starting as soon as what it needs exists:
- the recipes that regenerate share one data cache ({runs}/data_cache), written first by ``python -m
  train.regenerate`` (the ``data`` job, seconds) so that none of them waits on another's training;
- a warm start needs that drafter's ``final/``: both DSparks start from the DFlash, and the full-vocabulary ones
  (llama.cpp's converters take no draft vocabulary) widen its reduced vocabulary instead of training from scratch.
``DRAFTSMITH_ENGINE_CACHE=DIR`` keeps the runs across sessions (a drafter with a ``final/`` is not retrained).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = ["tracking=none", "train.ckpt_every=100000", "train.eval_every=100000", "train.log_every=50"]
REGEN = ["data.regenerate=256", "data.max_rows=1024", "data.cache_dir={runs}/data_cache"]
DATA = "data"  # the job that writes REGEN's cache (python -m train.regenerate)
VOCAB = json.loads((REPO / "models" / "tiny_code" / "config.json").read_text())["vocab_size"]
WIDE = f"draft.config.draft_vocab_size={VOCAB}"  # a reduced-vocabulary warm start widened to the whole vocabulary

# Small step counts (CPU minutes), enough for acceptance at later slots: DFlash and P-EAGLE need the target's own
# continuations (data.regenerate) for slots >= 2 (conf/recipe/dflash.yaml). Table order is launch priority: the
# longest chain (data → dflash → dspark_full) first.
# name -> (recipe, overrides, needs); {runs}: the runs directory.
DRAFTERS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "dflash": ("dflash", ["train.steps=150", *REGEN], (DATA,)),
    "eagle3": ("eagle3", ["train.steps=60", "data.regenerate=0", "data.max_len=128"], ()),
    "peagle": ("peagle", ["train.steps=100", *REGEN], (DATA,)),
    "dflash_full": ("dflash", ["train.steps=50", *REGEN, WIDE, "draft.config.warm_start={runs}/dflash/final"],
                    ("dflash",)),
    "dspark_full": ("dspark", ["train.steps=60", *REGEN, WIDE, "draft.config.warm_start={runs}/dflash/final"],
                    ("dflash",)),
    "dspark": ("dspark", ["train.steps=40", *REGEN, "draft.config.warm_start={runs}/dflash/final"], ("dflash",)),
    "medusa": ("medusa", ["train.steps=20", "data.regenerate=0", "data.max_len=128", "draft.config.num_heads=3"], ()),
    "mtp": ("mtp", ["train.steps=2", "data.regenerate=0", "data.max_len=64", "draft.config.num_modules=1"], ()),
}


def final(runs: Path, name: str) -> Path:
    return runs / name / "final"


def command(name: str, runs: Path) -> list[str]:
    """The job's command line, as a user runs it: ``python -m train +recipe=…``, or for ``data`` the regeneration
    alone."""
    if name == DATA:
        return [sys.executable, "-m", "train.regenerate", "+recipe=dflash", *[a.format(runs=runs) for a in REGEN]]
    recipe, over, _ = DRAFTERS[name]
    return [sys.executable, "-m", "train", f"+recipe={recipe}", f"output_dir={runs / name}", *COMMON,
            *[a.format(runs=runs) for a in over]]


def train_one(name: str, runs: Path) -> float:
    """One job, one-threaded; the seconds it took."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(command(name, runs), cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"engine tier job {name} ({' '.join(command(name, runs)[2:4])}) failed: "
                           f"{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def job_count() -> int:
    """How many one-threaded jobs the tier runs at once: DRAFTSMITH_ENGINE_JOBS, else the cores (at most 4)."""
    return int(os.environ.get("DRAFTSMITH_ENGINE_JOBS") or min(4, os.cpu_count() or 1))


def train_all(runs: Path, jobs: int | None = None) -> dict[str, float]:
    """Train every drafter that has no ``final/`` yet, ``jobs`` at a time in table order as their needs are met
    (the data job first when one of them reads it); name -> seconds for the jobs run here. The first failure stops
    the launching and is raised."""
    todo = [n for n in DRAFTERS if not (final(runs, n) / "model.safetensors").exists()]
    if any(DATA in DRAFTERS[n][2] for n in todo):
        todo.insert(0, DATA)
    needs = {n: DRAFTERS[n][2] if n in DRAFTERS else () for n in todo}
    jobs = jobs or job_count()
    running: dict[Future, str] = {}
    took: dict[str, float] = {}
    with ThreadPoolExecutor(jobs) as pool:
        while todo or running:
            busy = set(todo) | set(running.values())
            ready = [n for n in todo if not busy & set(needs[n])]
            for n in ready[: jobs - len(running)]:
                todo.remove(n)
                running[pool.submit(train_one, n, runs)] = n
            if not running:
                raise RuntimeError(f"engine tier: {todo} wait on drafters that are not in the table")
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                took[running.pop(fut)] = round(fut.result(), 1)  # raises the first failure
    return took
