"""scripts/learning_curve.py and scripts/ablation.py --report on a run they cannot read (a missing directory, an
unreadable or damaged file, a root with no held-out record yet): one `error:` line naming what is wrong and exit
status 2, as the other scripts do, never a traceback, and a missing directory is not read as an empty run."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from tests.faults.fault_helpers import ROOT, one_error_line

sys.path.insert(0, str(ROOT / "scripts"))
import learning_curve as LC  # noqa: E402

_spec = importlib.util.spec_from_file_location("ablation", ROOT / "scripts" / "ablation.py")
ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)


def _val(n: int = 4) -> str:
    return "".join(json.dumps({"step": 100 * (i + 1), "elapsed_s": 60.0 * (i + 1), "tokens_seen": 1000 * 4 ** i,
                               "val/acc_0": 0.1 + 0.03 * math.log(1000 * 4 ** i), "val/sim_tau": 1.5}) + "\n"
                   for i in range(n))


def _run(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "val.jsonl").write_text(_val())
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "tok_per_s": 400.0, "elapsed_s": 60.0}) + "\n")
    return d


def _curve_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert LC.main([str(a) for a in argv]) == 2
    return one_error_line(capsys)


def test_learning_curve_refuses_a_missing_run_directory(tmp_path, capsys):
    line = _curve_error(capsys, tmp_path / "nowhere")
    assert f"{tmp_path / 'nowhere'}: no such run directory" in line, line
    line = _curve_error(capsys, f"a={_run(tmp_path / 'a')}", f"b={tmp_path / 'nowhere'}")
    assert "no such run directory" in line, line


@pytest.mark.parametrize("damage", ["directory", "bytes"])
@pytest.mark.parametrize("name", ["val.jsonl", "metrics.jsonl"])
def test_learning_curve_refuses_an_unreadable_file(tmp_path, capsys, name, damage):
    run = _run(tmp_path / "run")
    (run / name).unlink()
    if damage == "directory":
        (run / name).mkdir()
    else:
        (run / name).write_bytes(b"\xff\xfe\x00not utf-8\n")
    line = _curve_error(capsys, run, "--out", tmp_path / "out")
    assert f"{run / name}: unreadable" in line, line


@pytest.mark.parametrize("name", ["val.jsonl", "metrics.jsonl"])
def test_learning_curve_refuses_a_missing_file(tmp_path, capsys, name):
    run = _run(tmp_path / "run")
    (run / name).unlink()
    assert f"{run / name}: missing" in _curve_error(capsys, run)


def test_learning_curve_refuses_a_damaged_data_stats(tmp_path, capsys):
    run = _run(tmp_path / "run")
    (run / "data_stats.json").write_text('{"train_target_tokens": 1')
    assert f"{run / 'data_stats.json'}: unreadable" in _curve_error(capsys, run)


def test_learning_curve_too_few_records_exits_2(tmp_path, capsys):
    run = _run(tmp_path / "run")
    (run / "val.jsonl").write_text(_val(1))
    assert "has 1 held-out record(s)" in _curve_error(capsys, run)


def _ablation_error(capsys, root: Path) -> str:
    capsys.readouterr()
    assert ablation.main(["--report", "--root", str(root)]) == 2
    return one_error_line(capsys)


def test_ablation_report_refuses_a_missing_root(tmp_path, capsys):
    line = _ablation_error(capsys, tmp_path / "nowhere")
    assert f"{tmp_path / 'nowhere'}: no such directory" in line, line
    assert not (tmp_path / "nowhere").exists()


def test_ablation_report_refuses_a_root_without_held_out_records(tmp_path, capsys):
    assert "no variant" in _ablation_error(capsys, tmp_path)
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "val.jsonl").write_text("")  # killed before its first held-out evaluation
    (tmp_path / "ttt7").mkdir()
    (tmp_path / "ttt7" / "val.jsonl").write_text('{"step": 1, "elapsed_s"')  # killed while writing it
    assert "no variant" in _ablation_error(capsys, tmp_path)
    assert not (tmp_path / "results.md").exists()


def test_ablation_report_refuses_an_unreadable_val_jsonl(tmp_path, capsys):
    (tmp_path / "ours" / "val.jsonl").mkdir(parents=True)
    assert f"{tmp_path / 'ours' / 'val.jsonl'}: unreadable" in _ablation_error(capsys, tmp_path)


def test_ablation_report_lists_variants_still_without_a_record(tmp_path, capsys):
    _run(tmp_path / "ours")
    with open(tmp_path / "ours" / "val.jsonl", "a") as f:
        f.write('{"step": 500, "elapsed_s"')  # a torn last line: the record before it is the last one
    (tmp_path / "ttt7").mkdir()
    (tmp_path / "ttt7" / "val.jsonl").write_text("")
    assert ablation.main(["--report", "--root", str(tmp_path), "--only", "ours", "ttt7"]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| ours | (recipe) | 400 |" in md and "No held-out record yet: ttt7." in md, md
