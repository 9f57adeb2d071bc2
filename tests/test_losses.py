"""models/core/losses.py: one step scored by hand, and the loop weighting every method's held-out metrics by n_k."""

import torch
import torch.nn.functional as F

from models.core.losses import distill_step, step_metrics, weighted_total


def test_distill_step_by_hand():
    g = torch.Generator().manual_seed(0)
    lk, tl = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    m = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    loss, acc, n = distill_step(lk, tl, m)
    ce = -(F.softmax(tl, -1) * F.log_softmax(lk, -1)).sum(-1)
    assert n == 4 and torch.allclose(loss, ce[m].mean())
    assert acc == ((lk.argmax(-1) == tl.argmax(-1)) & m).sum() / 4
    labels = torch.randint(0, 5, (2, 3), generator=g)
    hard, _, _ = distill_step(lk, tl, m, labels)
    assert torch.allclose(hard, F.cross_entropy(lk[m], labels[m]))
    empty = distill_step(lk[:, :0], tl[:, :0], m[:, :0])
    assert [float(x) for x in empty] == [0.0, 0.0, 0.0]


def test_weighted_total_and_metrics():
    losses = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)]
    assert float(weighted_total(losses, 0.5)) == 1 + 0.5 * 2 + 0.25 * 4
    m = step_metrics(losses, [torch.tensor(0.5), torch.tensor(0.5), torch.tensor(0.0)],
                     [torch.tensor(10), torch.tensor(8), torch.tensor(0)])
    assert (m["n_0"], m["n_1"], m["n_2"]) == (10.0, 8.0, 0.0)
    assert m["sim_tau"] == 1 + 0.5 + 0.25
