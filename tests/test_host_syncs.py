"""Host synchronisations per decode round (models/core/syncs.py), counted on a CPU.

On a GPU each ``.item()`` / ``.tolist()`` / ``bool(t)`` / data-shaped op makes the host wait for the device, so a
round's sync count bounds how far the kernels can run ahead (issue #46). A CPU never waits, so the count is taken
from the calls themselves. The budgets below are what each proposer's round costs today (tiny models, fixed seeds,
both temperatures); a change that adds a sync to every round exceeds its budget and fails here, with the sites
that sync named.
"""

from __future__ import annotations

import math

import pytest
import torch

from eval.decode.single import decode_ar, speculative_decode
from models.core.proposal import Sampling
from models.core.syncs import HostSyncCounter
from tests.test_decode import PROPOSERS, drafters, make_proposer, prompts, target  # noqa: F401 (fixtures)

# per round, (T=0, T=1): the most syncs a verification round plus its drafting may take (measured, rounded up)
BUDGET = {
    "ngram": (6, 6),
    "draft_model": (4, 4),
    "self_draft": (4, 4),
    "eagle3_chain": (3, 3),
    "eagle3_tree": (14, 27),
    "medusa_tree": (7, 21),
    "mtp_chain": (3, 3),
}
SETUP = 3  # prefill and the end of the run: the first token, the output list, a stop check


def test_counter_counts_what_would_make_a_gpu_host_wait():
    x = torch.arange(6.0)
    with HostSyncCounter(where=True) as c:
        x.sum().item()
        x.tolist()
        bool((x > 1).any())
        int(x[0])
        x[x > 2]
        x.nonzero()
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]))
    assert dict(c.by_op) == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "bool-mask index": 1,
                             "nonzero": 1, "repeat_interleave": 1}
    assert all(site.startswith("tests/test_host_syncs.py:") for site in c.where)
    with HostSyncCounter() as quiet:  # device-side work whose shapes are known ahead: no host wait
        y = (x * 2).cumsum(0)[torch.tensor([1, 3])]
        x.repeat_interleave(2)
        torch.cat([y, x]).argmax()
    assert quiet.total == 0


def test_ar_decoding_reads_the_host_once_per_run_or_once_per_token_with_an_eos(target):  # noqa: F811 (fixture imported above)
    p = prompts()[0]
    with HostSyncCounter() as c:
        res = decode_ar(target, p, 24)
    assert len(res.tokens) == 24 and c.total <= SETUP
    with HostSyncCounter() as c:
        res = decode_ar(target, p, 24, eos_id=target.model.config.vocab_size + 1)  # an eos that never comes
    assert c.total <= len(res.tokens) + SETUP


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", PROPOSERS)
def test_a_speculative_round_stays_within_its_sync_budget(target, drafters, name, temperature):  # noqa: F811
    sampling = Sampling(temperature=temperature, generator=torch.Generator().manual_seed(0)) if temperature \
        else Sampling()
    proposer = make_proposer(name, target, drafters)
    with HostSyncCounter(where=True) as c:
        res = speculative_decode(target, proposer, prompts()[0], 24, sampling=sampling)
    budget = BUDGET[name][temperature > 0]
    assert res.rounds > 0
    per_round = (c.total - SETUP) / res.rounds
    sites = ", ".join(f"{k} x{v}" for k, v in c.where.most_common(6))
    assert per_round <= budget, (f"{name} at T={temperature:g}: {per_round:.2f} host syncs a round over "
                                 f"{res.rounds} rounds, budget {budget}; most frequent: {sites}")
    assert math.ceil(per_round) >= budget - 1, (  # a budget far above the cost lets a new sync slip through
        f"{name} at T={temperature:g} now takes {per_round:.2f} syncs a round: lower its budget to "
        f"{math.ceil(per_round)}")
