"""scripts/ship_drafter.py on a run whose files are damaged (a truncated or non-safetensors model.safetensors, a cut
or non-UTF-8 config.json, a torn metrics.jsonl line): one `error:` line naming the file and the fix, exit status 2,
nothing shipped, never safetensors' own traceback or a JSON decode error that names no file."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file

from tests.faults.fault_helpers import ROOT, one_error_line

_spec = importlib.util.spec_from_file_location("ship_drafter", ROOT / "scripts" / "ship_drafter.py")
ship_drafter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ship_drafter)


def _run(tmp_path):
    """A run directory shaped as train/ writes it (no target load: ship without --target)."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    save_file({"fc.weight": torch.ones(4, 4)}, str(run / "final" / "model.safetensors"))
    (run / "final" / "config.json").write_text(json.dumps({"method": "eagle3"}))  # no "step": metrics.jsonl's
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n")
    return run


def _refused(run, tmp_path, capsys) -> str:
    dest = tmp_path / "shipped" / "eagle3"
    assert ship_drafter.main([str(run), str(dest)]) == 2
    assert not dest.exists() and not list((tmp_path / "shipped").glob(".ship_*"))
    return one_error_line(capsys)


def test_an_intact_run_ships(tmp_path, capsys):
    assert ship_drafter.main([str(_run(tmp_path)), str(tmp_path / "shipped" / "eagle3")]) == 0, capsys.readouterr()
    assert json.loads((tmp_path / "shipped" / "eagle3" / "manifest.json").read_text())["steps"] == 2


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors", "empty"])
def test_a_damaged_model_safetensors_is_one_line_naming_it(tmp_path, capsys, damage):
    run = _run(tmp_path)
    weights = run / "final" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "not_safetensors": b"<html>not found</html>",
                         "empty": b""}[damage])
    line = _refused(run, tmp_path, capsys)
    assert f"{weights}: unreadable safetensors file" in line and "restore it, retrain" in line


@pytest.mark.parametrize("damage", [b'{"method": "eag', b"", b'{"method": "\xff\xfe"}'])
def test_an_undecodable_config_json_is_one_line_naming_it(tmp_path, capsys, damage):
    run = _run(tmp_path)
    (run / "final" / "config.json").write_bytes(damage)
    line = _refused(run, tmp_path, capsys)
    assert f"{run / 'final' / 'config.json'}:" in line and "restore it, retrain" in line


def test_a_torn_metrics_line_is_one_line_naming_the_file_and_the_line(tmp_path, capsys):
    run = _run(tmp_path)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "lo')  # a kill while appending
    line = _refused(run, tmp_path, capsys)
    assert f"{run / 'metrics.jsonl'}: line 3 is not valid JSON" in line and "restore it, retrain" in line
