"""Resumable generation records: one JSON line per finished item (``{"index": i, ...}``), appended a batch per
write, and a throughput ledger beside them.

A kill leaves whole lines and at most a torn last one, which ``load_done`` cuts off; a rerun checks that the stored
items still answer the inputs (``check_done``) and generates only the missing ones. data/regenerate.py runs its
fixed batches through ``run_resumable`` and its continuous batching through the same files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from models.core.checkpoint import out_of_space_as_error


def load_done(out_path: Path, repair: bool = True) -> dict[int, dict]:
    """Finished items by index. A torn last line (crash mid-write) is cut off so appends stay valid jsonl
    (``repair=False``: only skipped, for a reader beside a running writer)."""
    done: dict[int, dict] = {}
    if not out_path.exists():
        return done
    raw = out_path.read_bytes()
    good_end = 0
    pos = 0
    for line in raw.splitlines(keepends=True):
        start, pos = pos, pos + len(line)
        if not line.strip():
            good_end = pos
            continue
        try:
            rec = json.loads(line)
            complete = line.endswith(b"\n")
        except json.JSONDecodeError:
            rec, complete = None, False
        if rec is None or not complete:
            if pos < len(raw):  # not the last line: the file is corrupt, not merely torn
                raise ValueError(f"{out_path}: line starting at byte {start} is not valid JSON; "
                                 "fix or delete the file to regenerate")
            break
        if not isinstance(rec, dict) or not isinstance(rec.get("index"), int):
            raise ValueError(f"{out_path}: record at byte {start} has no integer 'index'")
        done[rec["index"]] = rec
        good_end = pos
    if repair and good_end < len(raw):
        with open(out_path, "r+b") as fh:
            fh.truncate(good_end)
    return done


def append(out_path: Path, records: list[dict]) -> None:
    """One batch's records in a single write (a kill leaves all of them or a torn tail that load_done cuts)."""
    if not records:
        return
    data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode()
    with out_of_space_as_error(out_path, "free space, or set data.cache_dir on a larger disk"):
        fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # a regular file takes it in one call; loop only for a short write
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)



def batch_seed(seed: int, first_index: int) -> int:
    return (seed * 1_000_003 + first_index) % (2**62)



def run_resumable(
    items: Sequence[Any],
    out_path: Path,
    batch_size: int,
    same_input: Callable[[Any, dict], bool],
    process_batch: Callable[[list[int]], list[dict]],
    desc: str,
    stats: dict | None = None,
) -> dict[int, dict]:
    """Items in fixed batches (``range(b, b + batch_size)``), each seeded by its first index: a batch the cache
    holds only part of (a kill between its records) is generated again whole, so every item's sample is the one
    an uninterrupted run draws, however far an earlier run got. ``stats`` gets ``generated`` / ``from_cache``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = load_done(out_path)
    check_done(items, done, out_path, same_input)
    batches = [list(range(b, min(b + batch_size, len(items)))) for b in range(0, len(items), batch_size)]
    todo = [idx for idx in batches if not all(i in done for i in idx)]
    n_todo = sum(len(idx) for idx in todo)
    if stats is not None:
        stats.update(generated=n_todo, from_cache=len(items) - n_todo)
    ledger = ledger_path(out_path)
    with tqdm(total=len(items), initial=len(items) - n_todo, desc=desc, unit="item") as bar:
        for idx in todo:
            t0 = time.time()
            records = process_batch(idx)
            append(out_path, records)
            # the throughput ledger: what each batch generated and how long it took, across resumed runs
            append(ledger, [{"first": idx[0], "items": len(idx), "seconds": round(time.time() - t0, 2),
                              "new_tokens": sum(r.get("new_tokens", 0) for r in records),
                              "threads": torch.get_num_threads()}])
            for rec in records:
                done[rec["index"]] = rec
            bar.update(len(idx))
    return done


def check_done(items: Sequence[Any], done: dict[int, dict], out_path: Path,
                same_input: Callable[[Any, dict], bool]) -> None:
    for i, rec in done.items():
        if i >= len(items) or not same_input(items[i], rec):
            raise ValueError(f"{out_path}: stored item {i} does not match input item {i}; the file was written for "
                             "other inputs — use another out_path or delete it")


def ledger_path(out_path: Path) -> Path:
    """The per-batch throughput records beside a regeneration file (``ledger_<its name>``: a glob for the cache
    files, ``regen_*.jsonl``, does not take it for one)."""
    out_path = Path(out_path)
    return out_path.with_name("ledger_" + out_path.name)
