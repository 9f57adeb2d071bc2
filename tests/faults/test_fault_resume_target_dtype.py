"""A run records the dtype it trained the drafter against (``target_dtype`` in every checkpoint and in final/,
beside the target's identity, which stays dtype-free because the data and feature caches are keyed by it) and refuses
to resume in another: one ``error:`` line naming both dtypes and the fix, nothing trained. A checkpoint written
before checkpoints recorded it still resumes."""

from __future__ import annotations

import json

import pytest

from tests.faults.fault_helpers import cfg_for, metrics_steps, one_error_line
from train.loop import run


def test_resume_in_another_target_dtype_is_refused(target_dir, tmp_path, capsys):
    from train.__main__ import main

    out = tmp_path / "run"
    run(cfg_for(target_dir, out, "train.steps=2"))
    ckpt = out / "checkpoints" / "step_0000002"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main.__wrapped__(cfg_for(target_dir, out, "train.steps=4", "target.dtype=bfloat16"))
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert str(ckpt) in line and "trained against the target in float32" in line and "loads it in bfloat16" in line
    assert "target.dtype=float32" in line
    assert metrics_steps(out) == [1, 2]  # refused before any step
    for d in (ckpt, out / "final"):
        meta = json.loads((d / "config.json").read_text())
        assert meta["target_dtype"] == "float32" and "dtype" not in meta["target"]

    # a checkpoint from before checkpoints recorded the dtype resumes as it always did
    meta = json.loads((ckpt / "config.json").read_text())
    del meta["target_dtype"]
    (ckpt / "config.json").write_text(json.dumps(meta))
    run(cfg_for(target_dir, out, "train.steps=4"))
    assert metrics_steps(out) == [1, 2, 3, 4]
    assert json.loads((out / "final" / "config.json").read_text())["target_dtype"] == "float32"
