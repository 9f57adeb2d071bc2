"""Every tiny-code drafter the engine tier serves (vLLM and llama.cpp), in one table, trained once per session.

The tier's cost is mostly these eight small training runs. Each is one-threaded (``OMP_NUM_THREADS=1``), so they
run side by side, one per core (``DRAFTSMITH_ENGINE_JOBS``, default: the machine's cores, at most 4), each
starting as soon as what it needs exists:
- a warm start (DSpark from its DFlash) needs that drafter's ``final/``;
- the recipes that regenerate share one data cache ({runs}/data_cache), which the first of them (``dflash``)
  writes alone before the others read it.
``DRAFTSMITH_ENGINE_CACHE=DIR`` keeps the runs across sessions (a drafter with a ``final/`` is not retrained).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = ["tracking=none", "train.ckpt_every=100000", "train.eval_every=100000", "train.log_every=50"]
REGEN = ["data.regenerate=256", "data.max_rows=1024", "data.cache_dir={runs}/data_cache"]
FULL = "draft.config.draft_vocab_size=null"  # llama.cpp's DFlash converter has no draft vocabulary

# Small step counts (CPU minutes), enough for acceptance at later slots: DFlash and P-EAGLE need the target's own
# continuations (data.regenerate) for slots >= 2 (conf/recipe/dflash.yaml).
# name -> (recipe, overrides, needs); {runs}: the runs directory.
DRAFTERS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "dflash": ("dflash", ["train.steps=150", *REGEN], ()),
    "eagle3": ("eagle3", ["train.steps=60", "data.regenerate=0", "data.max_len=128"], ()),
    "medusa": ("medusa", ["train.steps=20", "data.regenerate=0", "data.max_len=128", "draft.config.num_heads=3"], ()),
    "mtp": ("mtp", ["train.steps=2", "data.regenerate=0", "data.max_len=64", "draft.config.num_modules=1"], ()),
    "peagle": ("peagle", ["train.steps=150", *REGEN], ("dflash",)),
    "dflash_full": ("dflash", ["train.steps=150", *REGEN, FULL], ("dflash",)),
    "dspark": ("dspark", ["train.steps=40", *REGEN, "draft.config.warm_start={runs}/dflash/final"], ("dflash",)),
    "dspark_full": ("dspark", ["train.steps=60", *REGEN, FULL, "draft.config.warm_start={runs}/dflash_full/final"],
                    ("dflash_full",)),
}


def final(runs: Path, name: str) -> Path:
    return runs / name / "final"


def train_one(name: str, runs: Path) -> float:
    """``python -m train +recipe=…`` as a user runs it; the seconds it took."""
    recipe, over, _ = DRAFTERS[name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "train", f"+recipe={recipe}", f"output_dir={runs / name}", *COMMON,
           *[a.format(runs=runs) for a in over]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training {name} (+recipe={recipe}) failed: {proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def train_all(runs: Path, jobs: int | None = None) -> dict[str, float]:
    """Train every drafter that has no ``final/`` yet, ``jobs`` at a time in table order as their needs are met;
    name -> seconds for those trained here. The first failure stops the launching and is raised."""
    todo = [n for n in DRAFTERS if not (final(runs, n) / "model.safetensors").exists()]
    jobs = jobs or int(os.environ.get("DRAFTSMITH_ENGINE_JOBS") or min(4, os.cpu_count() or 1))
    running: dict[Future, str] = {}
    took: dict[str, float] = {}
    with ThreadPoolExecutor(jobs) as pool:
        while todo or running:
            busy = set(todo) | set(running.values())
            ready = [n for n in todo if not busy & set(DRAFTERS[n][2])]
            for n in ready[: jobs - len(running)]:
                todo.remove(n)
                running[pool.submit(train_one, n, runs)] = n
            if not running:
                raise RuntimeError(f"engine tier: {todo} wait on drafters that are not in the table")
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                took[running.pop(fut)] = round(fut.result(), 1)  # raises the first failure
    return took
