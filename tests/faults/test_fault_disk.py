"""A real full disk and a real read-only mount (small tmpfs mounts, not faked exceptions): every writer says
"no space left on device at PATH" in one line and leaves nothing half-written; a read-only output directory is
one line naming it. Skipped (with the reason) where a tmpfs cannot be mounted."""

from __future__ import annotations

import json

import pytest

from models.core.checkpoint import WEIGHTS, NoSpaceError
from tests.faults.fault_helpers import (
    PAGE,
    ROOT,
    assert_same_weights,
    cfg_for,
    fill_disk,
    remount_readonly,
    small_tmpfs,
)
from train import checkpoint as ckpt
from train.checks import ConfigError
from train.loop import run


@pytest.fixture
def disk(tmp_path):
    with small_tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def _no_leftovers(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*.tmp"))


def test_full_disk_while_writing_the_final_drafter(target_dir, disk):
    """The issue's case: rerun a finished run (keep_ckpts=1) on a nearly full disk; safetensors raises its own
    SafetensorError ('... No space left on device (os error 28)'), which used to escape as a traceback."""
    out = disk / "run"
    run(cfg_for(target_dir, out, "train.keep_ckpts=1"))
    (out / "final_before").mkdir()
    for f in (out / "final").iterdir():
        (out / "final_before" / f.name).write_bytes(f.read_bytes())
    fill_disk(disk, leave=2 * PAGE)  # room for data_stats.json, not for the drafter
    with pytest.raises(NoSpaceError, match=r"^no space left on device at .*/run/final") as e:
        run(cfg_for(target_dir, out, "train.keep_ckpts=1"))
    assert "\n" not in str(e.value)
    assert_same_weights(out / "final", out / "final_before")  # the previous final/ is intact
    assert not (out / "final.tmp").exists() and _no_leftovers(out) == []


def test_full_disk_at_a_checkpoint_keeps_the_last_good_one(target_dir, disk):
    out = disk / "run"
    run(cfg_for(target_dir, out, "train.stop_after=2"))
    root = out / "checkpoints"
    fill_disk(disk, leave=2 * PAGE)
    with pytest.raises(NoSpaceError, match=r"no space left on device at .*step_0000004"):
        run(cfg_for(target_dir, out))
    assert ckpt.latest_checkpoint(root) == root / "step_0000002"  # the last good checkpoint survives
    assert not list(root.glob("*.tmp"))  # the half-written one does not fill the disk further


def test_full_disk_in_torch_save_of_the_trainer_state(target_dir, disk):
    """Room for the checkpoint's weights but not for trainer.pt: torch's zip writer ('unexpected pos')."""
    out = disk / "run"
    run(cfg_for(target_dir, out, "train.stop_after=2"))
    step2 = out / "checkpoints" / "step_0000002"
    w, t = (step2 / WEIGHTS).stat().st_size, (step2 / ckpt.TRAINER).stat().st_size
    leave = w + 4 * PAGE  # weights + config.json + metrics/data_stats growth
    assert t > 4 * PAGE + PAGE, "trainer.pt too small for this test to reach torch.save"
    fill_disk(disk, leave=leave)
    with pytest.raises(NoSpaceError, match=r"no space left on device at .*step_0000004"):
        run(cfg_for(target_dir, out))
    assert ckpt.latest_checkpoint(out / "checkpoints") == step2 and not list((out / "checkpoints").glob("*.tmp"))


def test_full_disk_in_the_feature_cache(target_dir, disk):
    from data.features import FeatureCache
    from data.sources import DataConfig, build_rows
    from models.core.target import FrozenTarget

    target = FrozenTarget.from_pretrained(str(target_dir))
    rows, _ = build_rows(DataConfig(max_rows=8, max_len=32, val_rows=1), target.tokenizer)
    fill_disk(disk, leave=PAGE)  # the manifest fits, a shard does not
    cache = FeatureCache(disk / "feat", target, rows, [1, 2, 3], dtype="float32")
    with pytest.raises(NoSpaceError, match=r"no space left on device at .*shard_00000\.safetensors .*feature_cache"):
        cache.build(show_progress=False)
    assert not list((disk / "feat").glob("*.tmp"))


def test_full_disk_in_the_regeneration_cache(disk, tiny_llama, tiny_tokenizer):
    from data.sources import DataConfig, build_rows

    cfg = DataConfig(max_rows=6, max_len=32, val_rows=1, regenerate=2, regen_prompt_len=8, regen_new_tokens=3,
                     regen_batch_size=2, cache_dir=str(disk / "cache"))
    build_rows(cfg, tiny_tokenizer, tiny_llama)  # writes the cache's key file and one batch
    next(iter((disk / "cache").glob("regen_*.jsonl"))).unlink()  # the batch must be written again
    fill_disk(disk)
    with pytest.raises(NoSpaceError, match=r"no space left on device at .*regen_code_\w+\.jsonl .*data.cache_dir"):
        build_rows(cfg, tiny_tokenizer, tiny_llama)


def test_full_disk_in_an_export(target_dir, disk, tmp_path, capsys):
    from train.export import main as export_main

    run(cfg_for(target_dir, tmp_path / "run", "train.steps=2"))
    fill_disk(disk)
    capsys.readouterr()
    rc = export_main([str(tmp_path / "run" / "final"), "--format", "eagle3", "--out", str(disk / "exp")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: no space left on device at {disk / 'exp'}")
    assert sorted(p.name for p in disk.iterdir()) == [".filler"]  # its temporary directory was removed


def test_full_disk_in_eval_results(disk):
    """The results writer (results.json, results.md, plots), fed a real results.json from the shipped bench."""
    from eval.__main__ import check_writable, write_results

    res = json.loads((ROOT / "bench" / "results" / "results.json").read_text())
    fill_disk(disk)
    with pytest.raises(NoSpaceError, match=r"no space left on device at .*/out"):
        check_writable(disk / "out")  # up front: before any benchmark time is spent
    with pytest.raises(NoSpaceError, match=r"no space left on device at .*/out"):
        write_results(res, disk / "out")


def test_read_only_output_dir_is_one_line(target_dir, disk):
    (disk / "existing").mkdir()
    remount_readonly(disk)
    for out in (disk / "new", disk / "existing"):
        with pytest.raises(ConfigError, match=rf"^output_dir {out} is not writable \(Read-only file system\)") as e:
            run(cfg_for(target_dir, out))
        assert "\n" not in str(e.value)


def test_read_only_eval_out_dir_fails_before_the_benchmark(disk):
    from eval.__main__ import check_writable

    remount_readonly(disk)
    with pytest.raises(ValueError, match=r"out_dir .*/res is not writable \(Read-only file system\)"):
        check_writable(disk / "res")


@pytest.mark.slow
@pytest.mark.parametrize("module,key", [("train", "output_dir"), ("eval", "out_dir")])
def test_cli_read_only_output_dir_is_one_line_exit_2(target_dir, disk, module, key):
    """The real entry points: Hydra creates its run directory inside output_dir / out_dir before the program
    runs, so the check is a Hydra callback (conf: hydra.callbacks.writable_dir)."""
    import os
    import subprocess
    import sys

    remount_readonly(disk)
    cmd = [sys.executable, "-m", module, f"target.name_or_path={target_dir}", f"{key}={disk / 'out'}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"})
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and lines == [f"error: {key} {disk / 'out'} is not writable (Read-only file system); "
                                           f"choose another {key}"], p.stderr
