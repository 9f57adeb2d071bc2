"""scripts/profile_draft.py: the draft's milliseconds per drafted token and their split by operator come from a
real profiled speculative decode (a tiny EAGLE-3 on the conftest target)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import profile_draft as PD  # noqa: E402

from tests.test_export import _train  # noqa: E402


@pytest.fixture(scope="module")
def eagle3_ckpt(tmp_path_factory, target_dir):
    return _train(target_dir, tmp_path_factory.mktemp("e3") / "run", "eagle3")


@pytest.mark.parametrize("weights", [None, "bfloat16"])
def test_profile_reports_the_draft_cost_and_its_operators(eagle3_ckpt, target_dir, capsys, weights):
    args = ["--checkpoint", str(eagle3_ckpt), "--target", str(target_dir), "--n-prompts", "2",
            "--max-new-tokens", "12", "--k", "2", *(["--weights", weights] if weights else [])]
    assert PD.main(args) == 0
    out = capsys.readouterr().out
    m = re.search(r"draft: ([\d.]+) ms per drafted token \((\d+) drafted, ([\d.]+) ms\).*c = ([\d.]+)", out)
    assert m, out
    per, drafted, total, c = float(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert drafted > 0 and per == pytest.approx(total / drafted, rel=0.05, abs=0.01) and c > 0
    assert f"weights {weights or 'default'}" in out
    rows = re.findall(r"^  (\S+)\s+([\d.]+)\s+([\d.]+) %$", out, flags=re.M)
    assert rows and "draft" in {r[0] for r in rows}  # the proposer's own Python is a row of its own
    assert sum(float(r[2]) for r in rows) <= 100.5
