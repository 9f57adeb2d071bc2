"""Held-out DFlash slots with no scored position (none of the held-out blocks reached them: every earlier draft
agreed nowhere, or no row has a trainable token there) are null in the held-out metrics, eval.json and val.jsonl:
they used to be written as loss 0.0 / acc 0.0, which reads as a perfect slot. Slots that were scored keep their
numbers (a cross-entropy is never exactly 0), and the simulated τ counts an unscored slot as never accepted."""

from __future__ import annotations

import json

import pytest

from models.core.acceptance import chain_tau
from models.core.target import FrozenTarget
from models.registry import load_drafter
from tests.test_train_loop import cfg_for
from train.loop import evaluate, run

BLOCK = 16  # 15 drafts: two training steps leave the deep ones unreached (a draft is scored where all before it agreed)


@pytest.fixture(scope="module")
def dflash_run(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash") / "run"
    run(cfg_for(target_dir, out, "train.steps=2", "train.eval_every=1", f"draft.config.block_size={BLOCK}",
                method="dflash"))
    return out


def test_unscored_slots_are_null_in_eval_json_and_val_jsonl(dflash_run):
    ev = json.loads((dflash_run / "final" / "eval.json").read_text())
    slots = sorted(int(k.split("_")[1]) for k in ev if k.startswith("acc_"))
    assert slots == list(range(BLOCK - 1))
    unscored = [k for k in slots if ev[f"acc_{k}"] is None]
    assert unscored and unscored[-1] == BLOCK - 2, ev  # the deepest draft is reached by no held-out block
    for k in slots:  # a slot's loss and agreement share its weight (the positions scored there)
        assert (ev[f"loss_{k}"] is None) == (k in unscored), (k, ev[f"loss_{k}"], ev[f"acc_{k}"])
        if k not in unscored:
            assert ev[f"loss_{k}"] > 0 and 0 <= ev[f"acc_{k}"] <= 1, (k, ev[f"loss_{k}"], ev[f"acc_{k}"])
    assert ev["sim_tau"] == pytest.approx(chain_tau([ev[f"acc_{k}"] for k in slots]))
    recs = [json.loads(x) for x in (dflash_run / "val.jsonl").read_text().splitlines() if x.strip()]
    assert recs and all(r[f"val/acc_{BLOCK - 2}"] is None and r[f"val/loss_{BLOCK - 2}"] is None for r in recs), recs


def test_evaluate_gives_null_for_a_slot_no_held_out_row_reaches(dflash_run, target_dir):
    """Rows whose only trainable tokens are their last two: drafts 0 and 1 can be scored, none after them."""
    target = FrozenTarget.from_pretrained(str(target_dir))
    drafter, _ = load_drafter(dflash_run / "final", target)
    ids = list(range(5, 15))
    rows = [{"input_ids": ids, "loss_mask": [0] * 8 + [1, 1]}, {"input_ids": ids[::-1], "loss_mask": [0] * 8 + [1, 1]}]
    ev = evaluate(drafter, target, rows, batch_size=2, pad_id=0)
    assert isinstance(ev["loss_0"], float) and ev["loss_0"] > 0
    for k in range(2, BLOCK - 1):
        assert ev[f"acc_{k}"] is None and ev[f"loss_{k}"] is None, k
    assert ev["sim_tau"] <= 1 + ev["acc_0"] + 1  # at most the two scored slots add to τ


def test_k_auto_sizes_from_an_eval_json_with_unscored_slots(dflash_run, target_dir):
    """num_speculative_tokens: auto reads final/eval.json's slot agreement: a null slot adds nothing to τ, so the
    cheapest K among equal bounds (the first) is verified, not a slot no held-out block reached."""
    from models.methods.dflash import SPEC

    drafter, _ = load_drafter(dflash_run / "final", FrozenTarget.from_pretrained(str(target_dir)))
    p, final = SPEC.proposers[0], str(dflash_run / "final")
    o = p.prepare(drafter, final, p.options({"num_speculative_tokens": "auto"}))
    sized = p.size(drafter, final, o, lambda k: 1 + 0.1 * k)
    ev = json.loads((dflash_run / "final" / "eval.json").read_text())
    first_null = next(k for k in range(BLOCK - 1) if ev[f"acc_{k}"] is None)
    assert 1 <= sized["num_speculative_tokens"] <= max(first_null, 1), sized
