"""scripts/learning_curve.py and eval.bench.training.log_fit on a held-out record that is not a finite number: one
NaN made every sum NaN, and the report read r² 1.000 and 'never (not rising)'. The record is dropped and the report
says how many were; r² of a flat curve is undefined (None), never 1."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import learning_curve as LC  # noqa: E402

from eval.bench.training import log_fit  # noqa: E402

TOKENS = [1_000, 4_000, 16_000, 64_000]
NOISE = [0.01, -0.01, 0.015, -0.005]


def _strict(text: str):
    def no_const(c):
        raise ValueError(f"non-JSON constant {c}")
    return json.loads(text, parse_constant=no_const)


def _run(tmp_path: Path, acc: list[float], bad: dict | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    val = [{"step": 100 * (i + 1), "elapsed_s": 60.0 * (i + 1), "tokens_seen": t, "val/acc_0": v,
            "val/sim_tau": 1 + 2 * v} for i, (t, v) in enumerate(zip(TOKENS, acc))]
    if bad is not None:
        val.insert(2, {"step": 250, "elapsed_s": 150.0, "tokens_seen": 8_000, "val/acc_0": 0.3, "val/sim_tau": 1.6,
                       **bad})
    (run / "val.jsonl").write_text("\n".join(json.dumps(r) for r in val) + "\n")  # json writes NaN as a bare NaN
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "tok_per_s": 400.0}) + "\n")
    return run


def _rising() -> list[float]:
    return [0.04 * math.log(t) - 0.1 + e for t, e in zip(TOKENS, NOISE)]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_log_fit_drops_non_finite_points(bad):
    good = [{"tokens_seen": t, "acc_0": v} for t, v in zip(TOKENS, _rising())]
    clean = log_fit(good)
    fit = log_fit(good + [{"tokens_seen": 8_000, "acc_0": bad}, {"tokens_seen": bad, "acc_0": 0.3}])
    assert fit["n"] == 4 and fit["dropped"] == 2 and clean["dropped"] == 0
    for k in ("a", "b", "r2"):
        assert fit[k] == pytest.approx(clean[k]) and math.isfinite(fit[k]), k
    assert fit["r2"] < 1


def test_log_fit_r2_of_a_flat_curve_is_undefined():
    fit = log_fit([{"tokens_seen": t, "acc_0": 0.25} for t in TOKENS])
    assert fit["r2"] is None and fit["b"] == pytest.approx(0.0)


@pytest.mark.parametrize("bad", [{"val/acc_0": math.nan}, {"val/sim_tau": math.inf}, {"tokens_seen": math.nan},
                                 {"elapsed_s": math.nan}], ids=["acc", "tau", "tokens", "elapsed"])
def test_report_drops_a_non_finite_record_and_says_so(tmp_path, bad):
    run, out = _run(tmp_path, _rising(), bad), tmp_path / "out"
    assert LC.main([str(run), "--out", str(out), "--goal-acc", "0.4"]) == 0
    md = (out / "learning_curve.md").read_text()
    assert "1 held-out record(s) with a non-finite value dropped" in md, md
    assert "nan" not in md.lower() and "never (not rising)" not in md, md
    rep = _strict((out / "learning_curve.json").read_text())
    assert rep["dropped_non_finite"] == 1 and len(rep["points"]) == 4
    fit = rep["projection"]["acc_0"]["fit"]
    assert fit["n"] == 4 and 0 < fit["r2"] < 1 and rep["projection"]["acc_0"]["tokens"] is not None
    assert f"| acc_0 | {fit['a']:.3f} | {fit['b']:.4f} | {fit['r2']:.3f} |" in md


def test_report_of_a_flat_curve_says_r2_is_undefined(tmp_path):
    run, out = _run(tmp_path, [0.25] * 4), tmp_path / "out"
    assert LC.main([str(run), "--out", str(out)]) == 0
    md = (out / "learning_curve.md").read_text()
    assert "| undefined (flat) |" in md and "| 1.000 |" not in md, md
    assert _strict((out / "learning_curve.json").read_text())["projection"]["acc_0"]["fit"]["r2"] is None


def test_compare_says_how_many_records_each_run_dropped(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _run(tmp_path / "a", _rising(), {"val/acc_0": math.nan}), _run(tmp_path / "b", _rising())
    out = tmp_path / "out"
    assert LC.main([f"a={a}", f"b={b}", "--out", str(out)]) == 0
    assert "a: 1 held-out record(s) with a non-finite value dropped" in capsys.readouterr().out
    assert _strict((out / "learning_curve.json").read_text())["dropped_non_finite"] == {"a": 1, "b": 0}
