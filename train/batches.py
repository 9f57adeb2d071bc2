"""Which rows train at each step, and how they are padded into a batch.

Every batch is a pure function of (seed, step, micro-step, rank), so a resumed run needs only the step count to
draw exactly the batches an uninterrupted one draws.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from data.features import pad_ids
from train.distributed import Dist


def batch_indices(n_rows: int, step: int, micro: int, batch_size: int, grad_accum: int, d: Dist,
                  seed: int, lengths: tuple[int, ...] | None = None, bucket: int = 0) -> list[int]:
    """Rows of one micro-batch: epochs are seeded permutations; ranks take disjoint slices. With ``lengths`` and
    ``bucket`` > 1, rows of similar length share a step (``epoch_order``)."""
    per_step = batch_size * grad_accum * d.world_size
    start = step * per_step + (micro * d.world_size + d.rank) * batch_size
    out = []
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, n_rows)
        out.append(int(epoch_order(n_rows, seed, epoch, per_step, lengths if bucket > 1 else None, bucket)[i]))
    return out


@functools.lru_cache(maxsize=4)
def epoch_order(n_rows: int, seed: int, epoch: int, per_step: int, lengths: tuple[int, ...] | None,
                bucket: int) -> np.ndarray:
    """One epoch's row order: a seeded permutation; with ``lengths``, cut into windows of ``bucket`` steps, each
    window sorted by row length and its steps shuffled. A batch is padded to its longest row, so random batches of
    chat rows (40 to 512 tokens) spend much of a step on padding; sorted windows nearly remove it, while the
    windows and the step order inside them keep the epoch random."""
    perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
    if lengths is None:
        return perm
    rng = np.random.default_rng([seed, epoch, 1])
    window = bucket * per_step
    parts = []
    for w0 in range(0, n_rows, window):
        chunk = perm[w0 : w0 + window]
        chunk = chunk[np.argsort([lengths[i] for i in chunk], kind="stable")]
        steps = [chunk[b : b + per_step] for b in range(0, len(chunk), per_step)]
        parts += [steps[j] for j in rng.permutation(len(steps))]
    return np.concatenate(parts)


def collate(rows: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = pad_ids([r["input_ids"] for r in rows], pad_id)
    mask = torch.zeros_like(ids)
    for j, r in enumerate(rows):
        mask[j, : len(r["loss_mask"])] = torch.tensor(r["loss_mask"])
    return ids, mask
