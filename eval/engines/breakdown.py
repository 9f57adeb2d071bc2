"""Where a llama-server round's milliseconds go: draft forward, target verification, the rest.

A speculative round in llama-server is: the drafter drafts K tokens (``dur g`` in the server's trace statistics),
the target verifies K+1 positions in one batch, the sampler picks the accepted prefix and the server edits both KV
caches (``dur a``: the drafter's accept; ``dur b``: its refresh at a new request). The server times its round as a
whole (``predicted_ms``) and the drafter's parts; the target's forward at each width is timed alone by
``llama-bench`` on the same GGUF, threads and context depth. So a round splits into

    draft (g) + drafter bookkeeping (b + a) + verify (the forward at the round's width, in AR steps) + rest

where the rest is sampling the accepted prefix, the KV-cache edits and the server's loop: what speculation costs
beyond the forwards themselves.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from eval.engines.llamacpp import binary

TOOL = "llama-bench"


def available() -> bool:
    return binary(TOOL).exists()


def forward_ms(gguf: str | Path, widths: Iterable[int], depth: int, threads: int = 1, reps: int = 5,
               timeout: float = 900) -> dict[int, float]:
    """The target's forward over ``w`` new tokens after ``depth`` cached ones, in milliseconds (llama-bench's mean
    of ``reps``), for each width."""
    ws = sorted(set(int(w) for w in widths))
    cmd = [str(binary(TOOL)), "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, ws)), "-n", "0",
           "-d", str(depth), "-r", str(reps), "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{TOOL} failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    return parse(p.stdout)


def parse(stdout: str) -> dict[int, float]:
    """llama-bench's JSON (one entry per test) as {width: ms}."""
    return {int(t["n_prompt"]): float(t["avg_ns"]) / 1e6 for t in json.loads(stdout) if int(t["n_prompt"]) > 0}


def round_parts(row: dict, forward: dict[int, float], ar_step_ms: float | None) -> dict | None:
    """One served configuration's milliseconds per round (speculative) or per step (AR), medians over repetitions.
    The verify is llama-bench's forward at the round's mean width (1 + drafted tokens / rounds, interpolated),
    scaled by the server's AR step over llama-bench's width-1 forward: llama-bench rebuilds its graph every call
    where the server reuses it, so only its ratios across widths carry over. None when the row has no timings."""
    if row.get("round_ms_reps"):
        c = row["engine_counts"]
        rounds = max(c["rounds"], 1)
        per = lambda key: statistics.median(  # noqa: E731
            sum(s[key] for s in reps.values()) / rounds for reps in row["spec_ms_reps"])
        total = statistics.median(row["round_ms_reps"])
        width = 1 + c["draft_n"] / rounds
        parts = {"round_ms": total, "draft_ms": per("ms_g"), "bookkeeping_ms": per("ms_b") + per("ms_a"),
                 "verify_width": width}
    elif row.get("step_ms_reps"):
        total = statistics.median(row["step_ms_reps"])
        parts = {"round_ms": total, "draft_ms": 0.0, "bookkeeping_ms": 0.0, "verify_width": 1.0}
    else:
        return None
    if ar_step_ms and 1 in forward:
        parts["verify_ms"] = interpolate(forward, parts["verify_width"]) * ar_step_ms / forward[1]
        parts["rest_ms"] = total - parts["draft_ms"] - parts["bookkeeping_ms"] - parts["verify_ms"]
    return parts


def interpolate(forward: dict[int, float], width: float) -> float:
    """The forward's milliseconds at a fractional width, linear between the measured integer widths."""
    lo, hi = int(width), min(int(width) + 1, max(forward))
    if lo >= max(forward) or lo == hi:
        return forward[min(lo, max(forward))]
    return forward[lo] + (width - lo) * (forward[hi] - forward[lo])


def widths(rows: Sequence[dict]) -> set[int]:
    """Every width a breakdown needs: 1 to K+1 for the largest K served (a round's mean width lies between)."""
    return set(range(1, max((r.get("num_speculative_tokens") or 0 for r in rows), default=0) + 2))


def render(res: dict) -> list[str]:
    """The breakdown table's lines (empty when no row has one)."""
    rows = {n: r["breakdown"] for n, r in res["methods"].items() if r.get("breakdown")}
    if not rows:
        return []
    ar = rows.get("ar", {}).get("round_ms")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["", f"Per round (speculative) or step (AR), milliseconds, median of {res.get('repetitions', 1)} "
             "repetition(s). draft and bookkeeping: the server's own timers. verify: the target's forward at the "
             "round's mean width (1 + drafted/rounds), from llama-bench after "
             f"{res.get('breakdown_depth')} cached tokens, scaled so that width 1 costs the server's AR step "
             "(llama-bench's own ms by width: " + ", ".join(f"{w}: {v:.1f}" for w, v in
                                                             (res.get("forward_ms") or {}).items())
             + "). rest: what a round costs beyond draft, bookkeeping and the forward (sampling the accepted "
             "prefix, KV-cache edits, the server's loop).", "",
             "| method | round ms | in AR steps | draft (g) | drafter bookkeeping (b+a) | verify (width) | rest |",
             "|---|---|---|---|---|---|---|"]
    for n, b in rows.items():
        steps = b["round_ms"] / ar if ar else None
        lines.append(f"| {n} | {f(b['round_ms'])} | {f(steps)} | {f(b['draft_ms'])} | {f(b['bookkeeping_ms'])} | "
                     f"{f(b.get('verify_ms'))} ({b['verify_width']:.2f}) | {f(b.get('rest_ms'))} |")
    return lines
