"""Whether a benchmark ran on a quiet machine: a timing taken while another job shared the CPU is not a result.

Three signals, each recorded in results.json ``quiet`` with the thresholds it was held to; any one marks the run
``contended`` (the report says so at the top, and README/docs quote no such run):

- other processes' CPU use during the run: all cores' busy time (steal included: a hypervisor's neighbour is a
  neighbour too) minus this process's own, over the wall time, in cores. Above ``OTHER_CORES_MAX`` something else ran.
- drift of the baseline: AR's tokens/s across repetitions, and the target's one-token forward time t1 probed before
  the decoding and again after it, each more than ``DRIFT_MAX`` apart.
- a method faster than its own cost-model bound (efficiency = measured decode speedup / bound, the bound
  τ/(K·c + r·v + 1 − r) of eval/bench/benchmark.py) by more than ``EFFICIENCY_MAX``: the bound holds for a quiet
  machine, so exceeding it means AR was the one slowed down.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import psutil

OTHER_CORES_MAX = 0.10
DRIFT_MAX = 0.10
EFFICIENCY_MAX = 1.05


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_s() -> float:
    c = psutil.Process().cpu_times()
    return c.user + c.system + c.children_user + c.children_system


class CpuWatch:
    """Other processes' CPU use from construction to ``stop()``."""

    def __init__(self) -> None:
        self.wall0, self.busy0, self.own0 = time.monotonic(), _busy_s(), _own_s()
        self.load0 = os.getloadavg()

    def stop(self) -> dict:
        wall = max(time.monotonic() - self.wall0, 1e-9)
        other = max(0.0, (_busy_s() - self.busy0) - (_own_s() - self.own0)) / wall
        return {"other_cores": round(other, 3), "wall_s": round(wall, 1), "cpus": os.cpu_count(),
                "loadavg_start": [round(x, 2) for x in self.load0],
                "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def verdict(cpu: Mapping, ar_rates: Mapping[float, list[float]], t1_s: tuple[float, float],
            efficiency: Mapping[str, float]) -> dict:
    """The ``quiet`` entry: the signals, the thresholds and, when any is crossed, ``contended`` with why."""
    why = []
    if cpu["other_cores"] > OTHER_CORES_MAX:
        why.append(f"other processes used {cpu['other_cores']:.2f} cores on average (> {OTHER_CORES_MAX})")
    drift = {f"{t:g}": (max(r) / min(r) - 1 if len(r) > 1 and min(r) > 0 else 0.0) for t, r in ar_rates.items()}
    why += [f"AR's tokens/s at T={t} moved {d:.0%} across repetitions (> {DRIFT_MAX:.0%})"
            for t, d in drift.items() if d > DRIFT_MAX]
    t1_drift = abs(t1_s[1] / t1_s[0] - 1) if t1_s[0] > 0 else 0.0
    if t1_drift > DRIFT_MAX:
        why.append(f"the target's one-token forward took {t1_s[0] * 1e3:.1f} ms before decoding and "
                   f"{t1_s[1] * 1e3:.1f} ms after (> {DRIFT_MAX:.0%} apart)")
    why += [f"{name} ran at {e:.2f}x its cost-model bound (> {EFFICIENCY_MAX}): AR was slowed"
            for name, e in efficiency.items() if e == e and e > EFFICIENCY_MAX]
    return {"contended": bool(why), "reasons": why, **cpu, "ar_rate_drift": drift, "t1_s": list(t1_s),
            "t1_drift": t1_drift, "thresholds": {"other_cores": OTHER_CORES_MAX, "drift": DRIFT_MAX,
                                                 "efficiency": EFFICIENCY_MAX}}
