"""scripts/ship_drafter.py: a trained run copied into the repo in fp16 loads back as the same drafter, carries its
training record, and refuses to overwrite or to ship what is not a finished run."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.core.target import FrozenTarget
from models.registry import load_drafter
from tests.test_train_loop import cfg_for, final_weights
from train.loop import run

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ship_drafter", ROOT / "scripts" / "ship_drafter.py")
ship_drafter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ship_drafter)


def test_shipped_drafter_is_fp16_loads_and_keeps_its_record(target_dir, tmp_path, capsys):
    run(cfg_for(target_dir, tmp_path / "run", "train.steps=2", method="dflash"))
    dest = tmp_path / "repo" / "dflash"
    assert ship_drafter.main([str(tmp_path / "run"), str(dest), "--recipe", "dflash", "--target",
                              str(target_dir)]) == 0
    src, got = (load_file(str(p / "final" / "model.safetensors")) for p in (tmp_path / "run", dest))
    assert set(src) == set(got)
    for k, v in src.items():
        if v.is_floating_point():
            assert got[k].dtype == torch.float16
            torch.testing.assert_close(got[k].float(), v, rtol=1e-3, atol=1e-4)
        else:
            assert torch.equal(got[k], v)  # vocabulary maps stay exact
    m = json.loads((dest / "manifest.json").read_text())
    assert m["method"] == "dflash" and m["steps"] == 2 and m["recipe"] == "dflash"
    assert m["fp16_sha256"] == ship_drafter.file_sha256(dest / "final" / "model.safetensors")
    assert (dest / "metrics.jsonl").exists() and (dest / "val.jsonl").exists()
    drafter, meta = load_drafter(dest / "final", FrozenTarget.from_pretrained(str(target_dir)))
    assert meta["method"] == "dflash"
    # never over what exists; not a finished run; nothing left behind by a refusal
    capsys.readouterr()
    assert ship_drafter.main([str(tmp_path / "run"), str(dest)]) == 2
    assert "exists" in capsys.readouterr().err
    assert ship_drafter.main([str(tmp_path / "nothing"), str(tmp_path / "repo" / "x")]) == 2
    assert "not a finished run" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["dflash"]


def test_fp16_refuses_weights_out_of_range():
    with pytest.raises(ValueError, match="fp16's range"):
        ship_drafter.to_fp16({"w": torch.tensor([1e6])})


def test_best_drafter_ships_and_replaces_an_earlier_shipped_copy(target_dir, tmp_path, capsys):
    """--best ships the run's best/ (train.keep_best), with its own step; --replace swaps an earlier shipped copy
    and nothing else."""
    run(cfg_for(target_dir, tmp_path / "run", "train.steps=2", "train.keep_best=true", "train.eval_every=1"))
    dest = tmp_path / "repo" / "eagle3"
    assert ship_drafter.main([str(tmp_path / "run"), str(dest), "--best"]) == 0
    best = json.loads((tmp_path / "run" / "best" / "eval.json").read_text())
    m = json.loads((dest / "manifest.json").read_text())
    assert m["from"] == "best" and m["steps"] == best["step"]
    assert ship_drafter.main([str(tmp_path / "run"), str(dest)]) == 2  # exists, no --replace
    assert ship_drafter.main([str(tmp_path / "run"), str(dest), "--replace"]) == 0
    assert json.loads((dest / "manifest.json").read_text())["from"] == "final"
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["eagle3"]
    other = tmp_path / "repo" / "notes"
    other.mkdir()
    assert ship_drafter.main([str(tmp_path / "run"), str(other), "--replace"]) == 2  # not a shipped copy
    capsys.readouterr()
    assert ship_drafter.main([str(tmp_path / "nothing"), str(tmp_path / "repo" / "x"), "--best"]) == 2
    assert "train.keep_best=true" in capsys.readouterr().err


def test_warm_start_goes_on_from_a_shipped_drafter_on_a_fresh_machine(target_dir, tmp_path):
    """train.warm_start: a run dir with no checkpoint (a fresh machine) continues the shipped drafter at its step:
    the schedule and the tokens-seen axis carry on as in the uninterrupted run, best/ is the shipped one to beat, and
    a drafter of another config or a directory without one is refused in one line."""
    over = ["train.steps=4", "train.keep_best=true", "train.eval_every=1"]
    full = tmp_path / "full"
    run(cfg_for(target_dir, full, *over))
    run(cfg_for(target_dir, tmp_path / "piece", *over, "train.stop_after=2"))
    dest = tmp_path / "repo" / "eagle3"
    assert ship_drafter.main([str(tmp_path / "piece"), str(dest), "--best", "--target", str(target_dir)]) == 0
    at = json.loads((dest / "final" / "eval.json").read_text())["step"]
    fresh = tmp_path / "fresh"  # another machine: no checkpoints, only the repo
    run(cfg_for(target_dir, fresh, *over, f"train.warm_start={dest}"))
    recs = {d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, fresh)}
    assert [r["step"] for r in recs[fresh]] == [1, 2, 3, 4]  # the shipped record up to `at`, then this run's
    for a, b in zip(recs[full], recs[fresh]):
        assert a["lr"] == pytest.approx(b["lr"]) and a["tokens_seen"] == b["tokens_seen"]
    assert recs[fresh][at]["elapsed_s"] >= recs[fresh][at - 1]["elapsed_s"]
    best = json.loads((fresh / "best" / "eval.json").read_text())
    shipped = json.loads((dest / "final" / "eval.json").read_text())
    assert best["sim_tau"] >= shipped["sim_tau"]
    # grown data (a second tranche) and a longer schedule: the shipped drafter goes on, its draft vocabulary kept
    # (the one its head was trained over, not the one the grown rows would pick)
    grown = tmp_path / "grown"
    run(cfg_for(target_dir, grown, "train.steps=6", "train.keep_best=true", "train.eval_every=1",
                "data.max_rows=40", "train.mode=offline", f"train.feature_cache={tmp_path / 'feat'}",
                f"train.warm_start={dest}"))
    steps = [json.loads(x)["step"] for x in (grown / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    shipped_w, grown_w = load_file(str(dest / "final" / "model.safetensors")), final_weights(grown)
    assert torch.equal(shipped_w["d2t"], grown_w["d2t"])
    assert not torch.equal(shipped_w["fc.weight"], grown_w["fc.weight"].to(shipped_w["fc.weight"].dtype))
    with pytest.raises(ValueError, match="different draft"):
        run(cfg_for(target_dir, tmp_path / "other", *over, "draft.config.ttt_steps=2", f"train.warm_start={dest}"))
    with pytest.raises(ValueError, match="ship_drafter"):
        run(cfg_for(target_dir, tmp_path / "none", *over, f"train.warm_start={tmp_path / 'nothing'}"))
