"""Draft vocabulary: counting, selection rules, d2t/t2d round trip and every refusal of check_mapping."""

from __future__ import annotations

import pytest
import torch

from models.core.vocab import build_draft_vocab, check_mapping, count_tokens, draft_to_target, identity_mapping


def test_count_tokens_only_masked_positions():
    rows = [
        {"input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 0]},
        {"input_ids": [3, 3, 0], "loss_mask": [1, 1, 1]},
        {"input_ids": [4, 4], "loss_mask": [0, 0]},
    ]
    counts = count_tokens(rows, vocab_size=6)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [1, 0, 2, 2, 0, 0]


def test_count_tokens_refuses_bad_rows():
    with pytest.raises(ValueError, match="equal length"):
        count_tokens([{"input_ids": [1, 2], "loss_mask": [1]}], vocab_size=4)
    with pytest.raises(ValueError, match="outside 0..3"):
        count_tokens([{"input_ids": [1, 7], "loss_mask": [1, 1]}], vocab_size=4)
    # an out-of-range id at an unmasked position is not counted and not an error
    assert count_tokens([{"input_ids": [1, 7], "loss_mask": [1, 0]}], vocab_size=4).tolist() == [0, 1, 0, 0]


def test_build_draft_vocab_picks_most_frequent_with_ties_to_lower_id():
    #            id: 0  1  2  3  4  5  6  7
    counts = torch.tensor([0, 5, 1, 5, 9, 1, 0, 2])
    d2t, t2d = build_draft_vocab(counts, 4)
    # 4 (9), then 1 and 3 (5 each), then 7 (2); 2 and 5 (1 each) lose
    chosen = [1, 3, 4, 7]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1 - 0, 3 - 1, 4 - 2, 7 - 3]
    assert draft_to_target(d2t).tolist() == chosen
    assert t2d.dtype == torch.bool and torch.nonzero(t2d).flatten().tolist() == chosen
    check_mapping(d2t, t2d)

    # tie at the cut: ids 2 and 5 both have count 1, the lower one wins
    d2t, t2d = build_draft_vocab(counts, 5)
    assert draft_to_target(d2t).tolist() == [1, 2, 3, 4, 7]


def test_build_draft_vocab_fills_with_lowest_unseen_ids():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[8, 5]] = torch.tensor([3, 1])
    d2t, t2d = build_draft_vocab(counts, 5)
    # seen: 8, 5; then the lowest unused ids 0, 1, 2
    assert draft_to_target(d2t).tolist() == [0, 1, 2, 5, 8]
    assert int(t2d.sum()) == 5 and t2d[[0, 1, 2, 5, 8]].all()
    check_mapping(d2t, t2d)


def test_round_trip_full_and_identity():
    counts = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_draft_vocab(counts, 30)
    ids = draft_to_target(d2t)
    # every draft id lands on a t2d id and every t2d id is hit exactly once
    assert t2d[ids].all() and ids.unique().numel() == 30 and int(t2d.sum()) == 30
    # the selected ids are exactly the 30 largest counts (stable on ties)
    assert counts[ids].min() >= counts[~t2d].max()
    d2t, t2d = build_draft_vocab(counts, 100)
    assert (d2t == 0).all() and t2d.all()
    assert torch.equal(identity_mapping(100)[0], d2t) and torch.equal(identity_mapping(100)[1], t2d)


@pytest.mark.parametrize("size", [0, -1, 11])
def test_build_draft_vocab_refuses_bad_sizes(size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10, dtype=torch.int64), size)


def _good() -> tuple[torch.Tensor, torch.Tensor]:
    return build_draft_vocab(torch.tensor([0, 5, 1, 5, 9, 1, 0, 2]), 4)  # ids 1, 3, 4, 7


def test_check_mapping_refusals():
    d2t, t2d = _good()
    check_mapping(d2t, t2d)
    with pytest.raises(ValueError, match="int64"):
        check_mapping(d2t.to(torch.int32), t2d)
    with pytest.raises(ValueError, match="bool"):
        check_mapping(d2t, t2d.to(torch.int64))
    # misaligned by one (the SpecForge #534 failure): ids 2, 4, 5, 8 — 8 is out of range for V=8
    with pytest.raises(ValueError, match="outside 0..7"):
        check_mapping(d2t + 1, t2d)
    # misaligned but in range: ids 0, 2, 3, 6 are not the ids t2d marks
    with pytest.raises(ValueError, match="misaligned"):
        check_mapping(d2t - 1, t2d)
    # not strictly increasing: ids 1, 3, 3, 7
    with pytest.raises(ValueError, match="strictly increasing"):
        check_mapping(torch.tensor([1, 2, 1, 4]), t2d)
    # t2d marks one id too many
    extra = t2d.clone()
    extra[0] = True
    with pytest.raises(ValueError, match="marks 5"):
        check_mapping(d2t, extra)
    with pytest.raises(ValueError, match="outside"):
        check_mapping(torch.tensor([-1, 0, 0, 0]), t2d)
    with pytest.raises(ValueError, match="Vd <= V"):
        check_mapping(torch.zeros(9, dtype=torch.int64), t2d)


def test_check_mapping_refuses_d2t_and_t2d_from_different_data():
    # a d2t rebuilt from other counts after fine-tuning, paired with the old t2d
    d2t_a, _ = build_draft_vocab(torch.tensor([9, 8, 7, 0, 0, 0]), 3)  # ids 0, 1, 2
    _, t2d_b = build_draft_vocab(torch.tensor([0, 0, 0, 7, 8, 9]), 3)  # ids 3, 4, 5
    with pytest.raises(ValueError, match="misaligned"):
        check_mapping(d2t_a, t2d_b)


def test_coverage_is_the_top_n_share_of_counted_tokens():
    from models.core.vocab import coverage

    counts = torch.tensor([0, 5, 3, 2, 0])  # 10 tokens: top-1 = 5, top-2 = 8, top-3 = 10
    assert coverage(counts, [1, 2, 3, 9]) == {1: 0.5, 2: 0.8, 3: 1.0, 9: 1.0}
