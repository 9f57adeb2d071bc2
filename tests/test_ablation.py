"""scripts/ablation.py: each variant trains with its overrides into its own run, and the report compares them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ablation", ROOT / "scripts" / "ablation.py")
ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)


@pytest.mark.slow
def test_two_variants_train_with_their_overrides_and_are_reported(tmp_path):
    extra = ["data.regenerate=0", "data.max_rows=8", "data.val_rows=4", "data.max_len=64", "train.eval_every=1",
             "train.eval_rows=4", "train.batch_size=2", "optim.warmup_steps=1", "draft.config.draft_vocab_size=256"]
    rc = ablation.main(["--recipe", "eagle3", "--steps", "2", "--root", str(tmp_path), "--lanes", "2", *extra,
                        "--only", "ours", "speculators"])
    assert rc == 0
    for name in ("ours", "speculators"):  # side by side, one thread each, each with its own log
        first = (tmp_path / f"{name}.log").read_text().splitlines()[0]
        assert first.startswith("ablation: ") and f"output_dir={tmp_path / name}" in first
        assert "train.threads=1" in first
    cfg = json.loads((tmp_path / "speculators" / "final" / "config.json").read_text())["draft"]
    assert (cfg["lm_head"], cfg["ttt_steps"], cfg["step_weight"], cfg["hidden_noise"]) == \
        ("target_frozen", 3, 1.0, 0.05)
    assert json.loads((tmp_path / "ours" / "final" / "config.json").read_text())["draft"]["lm_head"] == "new"
    table = (tmp_path / "results.md").read_text().splitlines()
    assert [r.split("|")[1].strip() for r in table[2:]] == ["ours", "speculators"]
    assert (tmp_path / "learning_curve.png").exists()
