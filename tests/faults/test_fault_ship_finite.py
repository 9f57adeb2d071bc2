"""scripts/ship_drafter.py refuses a drafter whose weights are not finite, with or without --target (the finiteness
check used to run only in the --target load, and fp16's range test is False for a NaN): one `error:` line naming
the file and the first non-finite tensor, exit 2, nothing shipped. fp16's range message is for finite weights that
exceed it, never for an inf."""

from __future__ import annotations

import importlib.util
import math
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.faults.fault_helpers import ROOT, one_error_line

_spec = importlib.util.spec_from_file_location("ship_drafter", ROOT / "scripts" / "ship_drafter.py")
ship_drafter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ship_drafter)


def _poisoned(trained, tmp_path, values: dict[int, float]):
    """A copy of the trained run whose i-th floating tensor (load order) has its first value set to values[i];
    the names of the tensors edited, in load order."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    path = run / "final" / "model.safetensors"
    state = load_file(str(path))
    floats = [k for k, v in state.items() if v.is_floating_point()]
    for i, x in values.items():
        state[floats[i]].view(-1)[0] = x
    save_file(state, str(path))
    return run, path, [floats[i] for i in sorted(values)]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_refused_without_target(trained, tmp_path, capsys, bad):
    run, path, names = _poisoned(trained, tmp_path, {3: bad, 5: math.nan})
    dest = tmp_path / "repo" / "eagle3"
    capsys.readouterr()
    assert ship_drafter.main([str(run), str(dest)]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and f"{names[0]}:" in line and "not finite" in line, line
    assert names[1] not in line and "fp16's range" not in line, line
    assert not dest.exists() and not list((tmp_path / "repo").glob(".ship_*"))


def test_finite_weights_out_of_fp16_range_say_so(trained, tmp_path, capsys):
    run, path, names = _poisoned(trained, tmp_path, {2: 1e6})
    dest = tmp_path / "repo" / "eagle3"
    capsys.readouterr()
    assert ship_drafter.main([str(run), str(dest)]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and f"{names[0]}: a weight exceeds fp16's range" in line, line
    assert not dest.exists()


def test_a_finite_drafter_still_ships_without_target(trained, tmp_path, capsys):
    dest = tmp_path / "repo" / "eagle3"
    assert ship_drafter.main([str(trained), str(dest)]) == 0, capsys.readouterr().err
    assert (dest / "final" / "model.safetensors").is_file()
