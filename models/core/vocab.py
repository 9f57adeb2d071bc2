"""The EAGLE-3 reduced draft vocabulary and its two mapping tensors.

The drafter's ``lm_head`` scores only ``Vd`` of the target's ``V`` tokens: the ``Vd`` most frequent
tokens at loss-masked positions of the training data. Two tensors (both saved with the drafter and
read by SGLang/vLLM/TRT-LLM) describe the subset:

- ``d2t`` int64 [Vd]: offsets, ``target_id = draft_id + d2t[draft_id]``; the selected target ids are
  sorted ascending, so the offsets are non-decreasing and ``d2t[0]`` is the lowest selected id.
- ``t2d`` bool [V]: True where a target id is in the draft vocabulary.

A ``d2t`` that is not aligned with ``t2d`` (e.g. rebuilt from other data after fine-tuning) maps
every draft prediction to a wrong token without any error at load time, so ``check_mapping``
refuses every inconsistency it can see.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_tokens(rows: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Counts (int64 [V]) of each token id at positions where ``loss_mask`` is 1.

    Each row has ``input_ids`` and ``loss_mask``: equal-length lists (or 1-D tensors).
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for n, row in enumerate(rows):
        ids = torch.as_tensor(row["input_ids"], dtype=torch.int64).reshape(-1)
        mask = torch.as_tensor(row["loss_mask"]).reshape(-1).bool()
        if ids.numel() != mask.numel():
            raise ValueError(f"row {n}: input_ids has {ids.numel()} tokens but loss_mask has {mask.numel()}; "
                             "they must have equal length")
        picked = ids[mask]
        if picked.numel() == 0:
            continue
        lo, hi = int(picked.min()), int(picked.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"row {n}: token id {hi if hi >= vocab_size else lo} outside 0..{vocab_size - 1}; "
                             "pass the target's vocab_size (config.vocab_size)")
        counts += torch.bincount(picked, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for the ``draft_vocab_size`` most frequent ids in ``counts`` (int [V]).

    Ties go to the lower id; when fewer than ``draft_vocab_size`` distinct ids were seen, the
    lowest unseen ids fill the rest (a stable sort on -count gives both rules at once).
    """
    counts = torch.as_tensor(counts).reshape(-1)
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..{vocab_size} (the target vocab size); "
                         f"set draft_vocab_size <= {vocab_size}")
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    selected = torch.sort(order[:draft_vocab_size]).values
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, sizes: Iterable[int]) -> dict[int, float]:
    """Share of the counted (loss-masked) tokens that the ``n`` most frequent ids cover, for each ``n``: what a
    draft vocabulary of that size can draft at all (the rest is masked out of the loss and never proposed)."""
    c = torch.sort(torch.as_tensor(counts).reshape(-1).to(torch.float64), descending=True).values
    total = float(c.sum()) or 1.0
    cum = torch.cumsum(c, 0)
    return {int(n): float(cum[min(int(n), c.numel()) - 1]) / total for n in sizes}


def identity_mapping(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for a draft vocabulary equal to the whole target vocabulary."""
    return torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: ``arange(Vd) + d2t`` (int64 [Vd])."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)


def check_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError (one line) unless ``d2t``/``t2d`` describe the same sorted id subset."""
    if not isinstance(d2t, torch.Tensor) or d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"d2t must be a 1-D int64 tensor, got {getattr(d2t, 'dtype', type(d2t))} "
                         f"with shape {tuple(getattr(d2t, 'shape', ()))}; rebuild it with build_draft_vocab")
    if not isinstance(t2d, torch.Tensor) or t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be a 1-D bool tensor, got {getattr(t2d, 'dtype', type(t2d))} "
                         f"with shape {tuple(getattr(t2d, 'shape', ()))}; rebuild it with build_draft_vocab")
    vd, v = d2t.numel(), t2d.numel()
    if vd == 0 or vd > v:
        raise ValueError(f"d2t has {vd} entries but t2d covers {v} target ids; need 1 <= Vd <= V")
    target = draft_to_target(d2t.cpu())
    if int(target.min()) < 0 or int(target.max()) >= v:
        raise ValueError(f"d2t maps to target ids {int(target.min())}..{int(target.max())}, outside 0..{v - 1}; "
                         "d2t must be target_id - draft_id")
    if vd > 1 and not bool((target[1:] > target[:-1]).all()):
        bad = int(torch.nonzero(target[1:] <= target[:-1])[0]) + 1
        raise ValueError(f"d2t target ids are not strictly increasing at draft id {bad} "
                         f"({int(target[bad - 1])} then {int(target[bad])}); d2t must be sorted target_id - draft_id")
    n_true = int(t2d.sum())
    if n_true != vd:
        raise ValueError(f"t2d marks {n_true} target ids but d2t has {vd} entries; "
                         "they come from different vocabularies")
    t2d_cpu = t2d.cpu()
    if not bool(t2d_cpu[target].all()):
        bad = int(target[~t2d_cpu[target]][0])
        raise ValueError(f"d2t maps to target id {bad} which t2d does not mark; d2t and t2d are misaligned")


def choose_mask_token(target, train_rows: list[dict]) -> int:
    """The mask token of a block / parallel drafter (DFlash, DSpark, P-EAGLE; ``target`` a FrozenTarget): an
    embedding row the data never uses: the first padding row past the tokenizer when the embedding has
    one (Qwen3: 151669), else the tokenizer's mask token, else the highest id absent from the training data."""
    tok, rows = target.tokenizer, target.vocab_size
    n_tok = len(tok) if tok is not None else rows
    if n_tok < rows:
        return n_tok
    if tok is not None and getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    seen = torch.zeros(rows, dtype=torch.bool)
    for r in train_rows:
        seen[torch.as_tensor(r["input_ids"], dtype=torch.long)] = True
    special = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    unused = [i for i in (~seen).nonzero().flatten().tolist() if i not in special]
    if not unused:
        raise ValueError("every embedding row occurs in the training data; set draft.config.mask_token_id to a "
                         "reserved id explicitly")
    return int(unused[-1])
