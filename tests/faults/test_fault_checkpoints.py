"""Checkpoints cannot eat each other: rotation by this run's steps, a valid `latest`, room made before writing,
resume-step and metrics consistency, a compat error naming only what differs, no final/ of an earlier run, no
resuming from a linked-in checkpoint. (A real full disk: test_fault_disk.py.)"""

from __future__ import annotations

import json

import pytest

from models.core.checkpoint import CONFIG, WEIGHTS
from tests.faults.fault_helpers import assert_same_weights, cfg_for, metrics_steps
from train import checkpoint as ckpt
from train.checks import ConfigError
from train.loop import run


def test_fresh_run_sets_old_checkpoints_aside_and_keeps_its_own(target_dir, tmp_path):
    out = tmp_path / "run"
    run(cfg_for(target_dir, out, "train.steps=6"))  # old run: step_4, step_6 kept
    run(cfg_for(target_dir, out, "train.resume=false", "train.steps=2", "train.ckpt_every=1"))
    root = out / "checkpoints"
    names = sorted(p.name for p in ckpt.complete_checkpoints(root))
    assert names == ["step_0000001", "step_0000002"]  # before: the old step_4/6 outranked and pruned these
    assert (root / (root / "latest").read_text()).is_dir()
    aside = list(out.glob("previous_*"))
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "step_0000006").is_dir()
    assert metrics_steps(out) == [1, 2]
    assert_same_weights(out / "final", root / "step_0000002")
    # the next default (resume=true) run resumes from the new run's step 2, not the old step 6
    res = run(cfg_for(target_dir, out, "train.steps=2"))
    assert res["steps"] == 2


def test_latest_falls_back_to_newest_complete_checkpoint(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path, "train.steps=4", "train.ckpt_every=1", "train.keep_ckpts=3"))
    root = tmp_path / "checkpoints"
    (root / "latest").write_text("step_0000099")  # points nowhere
    assert ckpt.latest_checkpoint(root) == root / "step_0000004"
    (root / "latest").unlink()
    assert ckpt.latest_checkpoint(root) == root / "step_0000004"
    (root / "step_0000004" / ckpt.TRAINER).unlink()  # incomplete: skipped
    assert ckpt.latest_checkpoint(root) == root / "step_0000003"


def test_resume_with_fewer_steps_than_checkpoint_is_an_error(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path, "train.steps=4"))
    with pytest.raises(ConfigError, match=r"train.steps=2 is below the step of the checkpoint being resumed \(4"):
        run(cfg_for(target_dir, tmp_path, "train.steps=2"))
    assert json.loads((tmp_path / "final" / "config.json").read_text())["step"] == 4


def test_metrics_not_duplicated_after_resume(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path, "train.stop_after=3"))  # checkpoint at 2, logged 1..3
    assert metrics_steps(tmp_path) == [1, 2, 3]
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "lo')  # torn by a kill
    run(cfg_for(target_dir, tmp_path))
    assert metrics_steps(tmp_path) == [1, 2, 3, 4]


def test_incompatible_checkpoint_error_names_only_the_differing_field(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path, "train.stop_after=2"))
    with pytest.raises(ValueError) as e:
        run(cfg_for(target_dir, tmp_path, "draft.config.ttt_steps=2"))
    msg = str(e.value)
    assert "draft.ttt_steps: 3 != 2" in msg and len(msg) < 400 and "\n" not in msg


def test_old_checkpoints_pruned_before_writing(target_dir, tmp_path, monkeypatch):
    run(cfg_for(target_dir, tmp_path, "train.stop_after=4", "train.steps=8"))  # step_2, step_4
    root = tmp_path / "checkpoints"
    seen = []
    real = ckpt.save_file

    def spy(tensors, path, **k):
        seen.append(sorted(p.name for p in ckpt.complete_checkpoints(root)))
        return real(tensors, path, **k)

    monkeypatch.setattr(ckpt, "save_file", spy)
    run(cfg_for(target_dir, tmp_path, "train.stop_after=6", "train.steps=8"))
    assert seen[0] == ["step_0000004"]  # step_2 went before step_6 was written; latest (4) kept until 6 committed
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_0000004", "step_0000006"]


def test_truncated_checkpoint_weights_name_the_path(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path, "train.stop_after=2"))
    w = tmp_path / "checkpoints" / "step_0000002" / WEIGHTS
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"step_0000002/model.safetensors: unreadable safetensors"):
        run(cfg_for(target_dir, tmp_path))


def test_corrupt_trainer_state_names_the_path(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path, "train.stop_after=2"))
    t = tmp_path / "checkpoints" / "step_0000002" / ckpt.TRAINER
    t.write_bytes(t.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"trainer.pt: unreadable"):
        run(cfg_for(target_dir, tmp_path))


def test_fresh_run_sets_aside_the_old_final_and_data_stats(target_dir, tmp_path):
    """train.resume=false: until the new run finishes, no final/ may claim to be its drafter (eval and export
    would use the old one), and data_stats.json must describe this run's data."""
    out = tmp_path / "run"
    run(cfg_for(target_dir, out, "train.steps=2"))
    old_stats = json.loads((out / "data_stats.json").read_text())
    run(cfg_for(target_dir, out, "train.resume=false", "train.stop_after=1", "data.max_rows=12"))
    assert not (out / "final").exists()
    aside = list(out.glob("previous_*"))
    assert len(aside) == 1 and (aside[0] / "final" / "model.safetensors").is_file()
    assert json.loads((aside[0] / "data_stats.json").read_text()) == old_stats
    new_stats = json.loads((out / "data_stats.json").read_text())
    assert new_stats["train_rows"] != old_stats["train_rows"]  # this run's, written after the move


def test_checkpoint_symlinked_from_another_run_is_refused(target_dir, tmp_path):
    other, out = tmp_path / "other", tmp_path / "run"
    run(cfg_for(target_dir, other, "train.steps=4", "train.ckpt_every=4"))
    run(cfg_for(target_dir, out, "train.steps=4", "train.stop_after=2"))
    (out / "checkpoints" / "step_0000009").symlink_to(other / "checkpoints" / "step_0000004")
    with pytest.raises(ValueError, match=r"step_0000009 is a symlink .*resumes only from its own checkpoints"):
        run(cfg_for(target_dir, out, "train.steps=12"))
    assert (other / "checkpoints" / "step_0000004" / WEIGHTS).is_file()  # the other run is untouched
    assert ckpt.latest_checkpoint(out / "checkpoints") == out / "checkpoints" / "step_0000002"


def test_rerun_keeps_files_it_did_not_write_in_final(target_dir, tmp_path):
    """final/ is replaced whole by each finished run; whatever else was put there (an export copied in, notes)
    is kept with the previous final/ instead of deleted."""
    out = tmp_path / "run"
    run(cfg_for(target_dir, out, "train.steps=2"))
    (out / "final" / "my_export").mkdir()
    (out / "final" / "my_export" / "notes.txt").write_text("mine")
    run(cfg_for(target_dir, out, "train.steps=4"))
    kept = list(out.glob("final.kept_*"))
    assert len(kept) == 1 and (kept[0] / "my_export" / "notes.txt").read_text() == "mine"
    assert json.loads((out / "final" / "config.json").read_text())["step"] == 4
    run(cfg_for(target_dir, out, "train.steps=6"))  # a final/ holding only what training wrote: just replaced
    assert len(list(out.glob("final.kept_*"))) == 1


def test_final_files_include_what_methods_write_after_training():
    """What a method's after-training step writes (its spec's final_files, e.g. Medusa's static tree) is replaced
    with final/, not taken for someone else's file."""
    from models import registry
    from models.methods.medusa import TREE_FILE

    assert registry.method("medusa").final_files == (TREE_FILE,)
    assert {CONFIG, WEIGHTS, "eval.json", TREE_FILE} <= ckpt.final_files()
