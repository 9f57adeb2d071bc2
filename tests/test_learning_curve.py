"""scripts/learning_curve.py: the fit of held-out agreement against ln(tokens seen), the tokens at which it reaches
a goal, and what training and regenerating them costs at the given rates."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import learning_curve as LC  # noqa: E402

from eval.bench.training import log_fit, x_for  # noqa: E402


def _run(tmp_path: Path, tokens: list[int], a: float, b: float, epoch: int | None = None,
         noise: list[float] | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    noise = noise or [0.0] * len(tokens)
    val = [{"step": 100 * (i + 1), "elapsed_s": 60.0 * (i + 1), "tokens_seen": t,
            "val/acc_0": a + b * math.log(t) + e, "val/sim_tau": 1 + 2 * (a + b * math.log(t))}
           for i, (t, e) in enumerate(zip(tokens, noise))]
    (run / "val.jsonl").write_text("\n".join(json.dumps(r) for r in val) + "\n")
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "tok_per_s": r})
                                                 for s, r in [(1, 300.0), (2, 400.0), (3, 500.0)]) + "\n")
    if epoch:
        (run / "data_stats.json").write_text(json.dumps({"train_target_tokens": epoch}))
    return run


def test_fit_recovers_the_curve_and_the_tokens_to_a_goal(tmp_path):
    run = _run(tmp_path, [1_000, 4_000, 16_000, 64_000], a=-0.1, b=0.04)
    fit = log_fit(LC.curve(run))
    assert fit["a"] == pytest.approx(-0.1, abs=1e-3) and fit["b"] == pytest.approx(0.04, abs=1e-4)
    assert fit["r2"] == pytest.approx(1.0) and fit["n"] == 4
    need = x_for(fit, 0.6)
    assert need == pytest.approx(math.exp(0.7 / 0.04), rel=1e-2)
    proj = LC.project(LC.curve(run), {"acc_0": 0.6}, cpu_tok_s=400.0, gpu_tok_s=4000.0, regen_tok_s=200.0)["acc_0"]
    assert proj["cpu_hours"] == pytest.approx(proj["tokens"] / 400 / 3600)
    assert proj["gpu_hours"] == pytest.approx(proj["cpu_hours"] / 10)
    assert proj["regen_cpu_hours"] == pytest.approx(proj["cpu_hours"] * 2)
    assert proj["per_doubling"] == pytest.approx(0.04 * math.log(2), abs=1e-4)


def test_a_flat_or_falling_curve_never_reaches_its_goal(tmp_path):
    run = _run(tmp_path, [1_000, 2_000, 4_000], a=0.5, b=-0.01)
    proj = LC.project(LC.curve(run), {"acc_0": 0.6}, 400.0, 4000.0)["acc_0"]
    assert proj["tokens"] is None and proj["cpu_hours"] is None
    assert "never (not rising)" in LC.markdown(LC.curve(run), {"acc_0": proj}, None, 400.0, 4000.0)


def test_the_cli_writes_its_report_and_fits_the_first_epoch_only_when_asked(tmp_path):
    # the points past one epoch (2 x 10k tokens) are repeats that flatten: the first-epoch fit ignores them
    run = _run(tmp_path, [1_000, 3_000, 10_000, 20_000, 40_000], a=0.0, b=0.05, epoch=10_000,
               noise=[0, 0, 0, -0.05, -0.1])
    out = tmp_path / "out"
    assert LC.main([str(run), "--out", str(out), "--first-epoch"]) == 0
    rep = json.loads((out / "learning_curve.json").read_text())
    assert rep["projection"]["acc_0"]["fit"]["n"] == 3
    assert rep["projection"]["acc_0"]["fit"]["b"] == pytest.approx(0.05, abs=1e-4)
    assert rep["cpu_tokens_per_s"] == 400.0  # the median of the run's logged rates
    md = (out / "learning_curve.md").read_text()
    assert "| 40000 |" not in md and "| 40,000 | 4.00 |" in md  # every point listed, with its epochs
    assert (out / "learning_curve.png").stat().st_size > 0
    LC.main([str(run), "--out", str(out)])
    assert json.loads((out / "learning_curve.json").read_text())["projection"]["acc_0"]["fit"]["n"] == 5


def test_a_run_without_two_held_out_records_is_refused(tmp_path):
    run = _run(tmp_path, [1_000], a=0.1, b=0.01)
    with pytest.raises(SystemExit, match="has 1 held-out record"):
        LC.curve(run)


def test_runs_are_compared_at_the_tokens_and_hours_every_one_reached(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fast = _run(tmp_path / "a", [1_000, 2_000, 4_000, 8_000], a=0.0, b=0.05)   # 1, 2, 3, 4 minutes
    slow = _run(tmp_path / "b", [1_000, 3_000], a=-0.1, b=0.05)                 # 1, 2 minutes, 3k tokens
    text, rep = LC.compare({"fast": LC.curve(fast), "slow": LC.curve(slow)})
    assert rep["tokens"] == 3_000 and rep["hours"] == pytest.approx(2 / 60, abs=1e-3)
    f = rep["runs"]["fast"]
    assert f["at_tokens"]["tokens_seen"] == 2_000  # the last measured point at or below 3k, not an interpolation
    assert f["at_hours"]["step"] == 200 and f["best"]["step"] == 400 and f["last"]["tokens_seen"] == 8_000
    assert f["acc_0_per_doubling"] == pytest.approx(0.05 * math.log(2), abs=1e-4)
    assert rep["runs"]["slow"]["at_tokens"]["tokens_seen"] == 3_000
    assert "| slow | " in text and "| fast | " in text
    out = tmp_path / "out"
    assert LC.main([f"fast={fast}", f"slow={slow}", "--out", str(out)]) == 0
    assert json.loads((out / "learning_curve.json").read_text())["tokens"] == 3_000
    assert (out / "learning_curve.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="share a name"):
        LC.named_runs([str(fast), str(fast)])
