"""`train.export --check` on an EAGLE-3 speculators export: vLLM serves proposal_methods[0].speculative_tokens as
K, so --check refuses one that is not a positive integer or differs from the K draftsmith.json records (a 0 used to
pass). One `error:` line naming the value, exit 2."""

from __future__ import annotations

import json

import pytest

from tests.faults.fault_helpers import one_error_line
from tests.test_export import _train
from train.export import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, target_dir):
    return _train(target_dir, tmp_path_factory.mktemp("e3") / "run", "eagle3")


@pytest.fixture
def speculators_export(ckpt, tmp_path, capsys):
    out = tmp_path / "s"
    assert main([str(ckpt), "--format", "eagle3-speculators", "--out", str(out)]) == 0
    assert main(["--check", str(out)]) == 0
    capsys.readouterr()
    return out


def _set_k(export, k):
    p = export / "config.json"
    cfg = json.loads(p.read_text())
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("k, says", [
    (0, ["speculative_tokens=0", ">= 1"]),
    (-2, ["speculative_tokens=-2", ">= 1"]),
    (True, ["speculative_tokens=True", ">= 1"]),
    (2.0, ["speculative_tokens=2.0", ">= 1"]),
], ids=["zero", "negative", "bool", "float"])
def test_speculators_k_must_be_a_positive_integer(speculators_export, capsys, k, says):
    _set_k(speculators_export, k)
    assert main(["--check", str(speculators_export)]) == 2
    line = one_error_line(capsys)
    assert all(s in line for s in says), line


def test_speculators_k_must_match_draftsmith_json(speculators_export, capsys):
    want = json.loads((speculators_export / "draftsmith.json").read_text())["num_speculative_tokens"]
    _set_k(speculators_export, want + 1)
    assert main(["--check", str(speculators_export)]) == 2
    line = one_error_line(capsys)
    assert f"speculative_tokens={want + 1}" in line and f"num_speculative_tokens={want}" in line, line
