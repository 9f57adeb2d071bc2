"""train.warm_start verifies a shipped drafter's weights against the fp16_sha256 its manifest.json records
(scripts/ship_drafter.py): edited weights, or a manifest that no longer says which weights were shipped, are one
ValueError line naming the file, before any training; they used to be trained on silently."""

from __future__ import annotations

import importlib.util
import json

import pytest
from safetensors.torch import load_file, save_file

from tests.faults.fault_helpers import ROOT, cfg_for
from train.loop import run

_spec = importlib.util.spec_from_file_location("ship_drafter", ROOT / "scripts" / "ship_drafter.py")
ship_drafter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ship_drafter)

OVER = ("train.steps=4",)


@pytest.fixture
def shipped(trained, tmp_path, capsys):
    dest = tmp_path / "repo" / "eagle3"
    assert ship_drafter.main([str(trained), str(dest)]) == 0, capsys.readouterr().err
    return dest


def _refused(target_dir, out, shipped) -> str:
    with pytest.raises(ValueError) as e:
        run(cfg_for(target_dir, out, *OVER, f"train.warm_start={shipped}"))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()  # refused before any step
    return msg


def test_edited_shipped_weights_are_refused(target_dir, shipped, tmp_path):
    weights = shipped / "final" / "model.safetensors"
    state = load_file(str(weights))
    k = next(k for k, v in state.items() if v.is_floating_point())
    state[k].view(-1)[0] += 1
    save_file(state, str(weights))
    msg = _refused(target_dir, tmp_path / "fresh", shipped)
    want = json.loads((shipped / "manifest.json").read_text())["fp16_sha256"]
    assert str(weights) in msg and want in msg and ship_drafter.file_sha256(weights) in msg, msg


def test_a_manifest_without_fp16_sha256_is_refused(target_dir, shipped, tmp_path):
    m = json.loads((shipped / "manifest.json").read_text())
    del m["fp16_sha256"]
    (shipped / "manifest.json").write_text(json.dumps(m))
    msg = _refused(target_dir, tmp_path / "fresh", shipped)
    assert str(shipped / "manifest.json") in msg and "fp16_sha256" in msg, msg


def test_a_damaged_manifest_is_refused(target_dir, shipped, tmp_path):
    (shipped / "manifest.json").write_text('{"fp16_sha256": "')
    msg = _refused(target_dir, tmp_path / "fresh", shipped)
    assert str(shipped / "manifest.json") in msg and "unreadable" in msg, msg


def test_unedited_shipped_weights_warm_start(target_dir, shipped, tmp_path):
    out = tmp_path / "fresh"
    run(cfg_for(target_dir, out, *OVER, f"train.warm_start={shipped}"))
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps == [1, 2, 3, 4]
