"""Rerunning the command of a finished run (what the README says to do after a kill, so also what is done when in
doubt) writes final/ again but appends nothing to its records: val.jsonl and metrics.jsonl hold each step once."""

from __future__ import annotations

import json

from tests.faults.fault_helpers import cfg_for, metrics_steps
from train.loop import run


def _val_steps(out) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "val.jsonl").read_text().splitlines() if x.strip()]


def test_rerun_of_a_finished_run_appends_no_records(target_dir, tmp_path):
    out = tmp_path / "run"
    cfg = cfg_for(target_dir, out, "train.eval_every=2")
    first = run(cfg)
    assert _val_steps(out) == [2, 4] and metrics_steps(out) == [1, 2, 3, 4]
    metrics, val = (out / "metrics.jsonl").read_bytes(), (out / "val.jsonl").read_bytes()
    again = run(cfg)
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert (out / "val.jsonl").read_bytes() == val
    assert again["val"] == first["val"]  # final/ evaluated again, the same drafter


def test_rerun_after_a_kill_before_the_final_record_writes_it_once(target_dir, tmp_path):
    """Killed after the last checkpoint, before finish() logged the held-out record: the rerun logs it."""
    out = tmp_path / "run"
    cfg = cfg_for(target_dir, out, "train.eval_every=2")
    run(cfg)
    lines = (out / "val.jsonl").read_text().splitlines(keepends=True)
    (out / "val.jsonl").write_text("".join(lines[:-1]))
    run(cfg)
    assert _val_steps(out) == [2, 4] and metrics_steps(out) == [1, 2, 3, 4]
