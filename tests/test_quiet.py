"""eval/bench/quiet.py: a run that shared the CPU is marked contended, with the reason, and the report says so."""

from __future__ import annotations

import subprocess
import sys
import time

from eval.bench.quiet import DRIFT_MAX, EFFICIENCY_MAX, verdict

QUIET_CPU = {"other_cores": 0.0, "wall_s": 10.0, "cpus": 2, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}


def test_another_process_spinning_is_seen_as_other_cores():
    """The watch runs in a child while this process spins a core: the child counts it as another process's use."""
    code = ("import time, json; from eval.bench.quiet import CpuWatch; w = CpuWatch(); time.sleep(1.5); "
            "print(json.dumps(w.stop()))")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        pass
    out = child.communicate(timeout=60)[0]
    import json

    got = json.loads(out)
    assert got["other_cores"] > 0.5 and got["cpus"] >= 1
    assert verdict(got, {0.0: [10.0]}, (1.0, 1.0), {})["contended"] is True


def test_quiet_signals_within_bounds_pass_and_each_crossing_is_named():
    ok = verdict(QUIET_CPU, {0.0: [20.0, 21.0]}, (0.05, 0.051), {"eagle3 T=0": 0.9})
    assert ok["contended"] is False and ok["reasons"] == []
    drift = verdict(QUIET_CPU, {0.0: [20.0, 20.0 * (1 + DRIFT_MAX) + 0.5]}, (0.05, 0.05), {})
    assert drift["contended"] and "AR's tokens/s at T=0 moved" in drift["reasons"][0]
    probe = verdict(QUIET_CPU, {0.0: [20.0]}, (0.05, 0.07), {})
    assert probe["contended"] and "one-token forward" in probe["reasons"][0]
    eff = verdict(QUIET_CPU, {0.0: [20.0]}, (0.05, 0.05), {"mtp T=0": EFFICIENCY_MAX + 0.1, "x T=0": float("nan")})
    assert eff["contended"] and eff["reasons"] == [f"mtp T=0 ran at {EFFICIENCY_MAX + 0.1:.2f}x its cost-model "
                                                   f"bound (> {EFFICIENCY_MAX}): AR was slowed"]
