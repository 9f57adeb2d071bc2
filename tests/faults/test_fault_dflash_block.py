"""DFlash / DSpark whose block no training row holds whole (block_size close to data.max_len, or chat rows whose
replies are shorter than a block): the later drafts are never scored, their loss_k stay 0, and training says so on
one line instead of finishing a drafter that looks trained."""

from __future__ import annotations

import json

from models.methods.dflash import whole_block_note
from models.methods.dflash.config import DFlashConfig
from tests.test_train_loop import cfg_for
from train.loop import run


def _warnings(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("warning: draft.config.block_size=")]


def test_dspark_block_as_long_as_the_rows_warns_and_the_warning_is_true(target_dir, tmp_path, capsys):
    """DSpark's anchor slot drafts too: B drafts need B trainable tokens after the anchor, and a 48-token row
    holds at most 47."""
    out = tmp_path / "run"
    run(cfg_for(target_dir, out, "train.steps=2", "draft.config.block_size=48", "draft.config.sample_from_anchor=true",
                method="dflash"))
    said = _warnings(capsys.readouterr().out)
    assert len(said) == 1, said
    assert "the longest run is 47" in said[0] and "loss_47..loss_47 stay 0" in said[0]
    assert "lower draft.config.block_size or raise data.max_len" in said[0]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["train/loss_47"] == 0 and last["train/loss_0"] > 0  # what the warning says


def test_a_block_that_fits_says_nothing(target_dir, tmp_path, capsys):
    run(cfg_for(target_dir, tmp_path / "run", "train.steps=2", "draft.config.block_size=8", method="dflash"))
    assert _warnings(capsys.readouterr().out) == []


def test_chat_rows_with_short_replies():
    """Only the reply is trained: a 4-token reply holds 4 drafts of DFlash B=5, not of B=8."""
    rows = [{"input_ids": list(range(20)), "loss_mask": [0] * 12 + [1] * 4 + [0] * 4}] * 3
    assert whole_block_note(DFlashConfig(block_size=5), rows) is None
    note = whole_block_note(DFlashConfig(block_size=8), rows)
    assert note and "\n" not in note and "the longest run is 4" in note and "loss_4..loss_6 stay 0" in note
    assert whole_block_note(DFlashConfig(block_size=8), rows + [{"loss_mask": [1] * 9}]) is None
