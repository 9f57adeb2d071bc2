"""Batched proposing (models/core/proposal.py BatchProposer): DFlash and n-gram draft every row of a batch in one call.

What is checked:
- greedy batched decoding with the batched proposers is token-identical to per-row autoregressive decoding
  (batch 3, ragged prompt lengths, rows finishing at different rounds) and drafts what the B=1 proposers draft
  (the same acceptance, round for round);
- the n-gram batch proposes exactly what NGramProposer proposes, row by row, on ragged growing contexts;
- ONE drafter block forward per round for all rows (forward calls counted), against one per row per round
  through the per-row adapter;
- sampled batched DFlash drafting keeps the target's exact distribution (χ²) for two prompts of different
  lengths in one batch;
- trees batch too (per-row masks): greedy EAGLE-3 / Medusa trees of 3 ragged rows equal per-row AR;
- the draft-cost microbenchmark times one batched forward per round.
"""

from __future__ import annotations

import pytest
import torch

from eval.decode.batch import decode_ar_batch, speculative_decode_batch
from eval.decode.single import decode_ar, speculative_decode
from models.core.proposal import PerRowProposers, Sampling, batch_proposer
from models.core.target import FrozenTarget
from models.methods.dflash.config import DFlashConfig
from models.methods.dflash.net import DFlashDrafter
from models.methods.dflash.proposers import DFlashBatchProposer, DFlashProposer
from models.methods.ngram import NGramBatchProposer, NGramProposer
from tests.test_decode import batched, chi2_pvalue, exact_joint, sharp_tiny_llama
from tests.test_dflash import drafter, scramble, target  # noqa: F401  (target: a fixture)

N = 21


def ragged_prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, vocab - 1, (n,), generator=g) for n in (5, 9, 14)]
    ps[2] = torch.cat([ps[2][:7], ps[2][:7]])  # a repeated prompt: the n-gram lookup finds matches
    return ps


def make(name: str, d: DFlashDrafter | None):
    return DFlashProposer(d) if name == "dflash" else NGramProposer(num_speculative_tokens=3, max_ngram=3)


def logged(propose, log: list):
    """Wrap a B=1 propose method so that every call's drafted tokens are appended to ``log``."""
    def wrapped(depth):
        out = propose(depth)
        log.append(out.tokens.tolist())
        return out
    return wrapped


def log_batch(bp, logs: list[list]) -> None:
    """Wrap a batch proposer so that row b's drafts (budget > 0) are appended to logs[b], following retain."""
    active = list(range(len(logs)))
    propose, retain = bp.propose, bp.retain

    def wrapped(depth):
        out = propose(depth)
        for a, (p, k) in enumerate(zip(out, depth)):
            if k > 0:
                logs[active[a]].append(p.tokens.tolist())
        return out

    def kept(rows):
        active[:] = [active[a] for a in rows]
        retain(rows)

    bp.propose, bp.retain = wrapped, kept


@pytest.mark.parametrize("name", ["dflash", "ngram"])
def test_batched_greedy_equals_per_row_ar_and_per_row_drafts(target, name):  # noqa: F811
    d = drafter(target) if name == "dflash" else None
    ps = ragged_prompts(target.vocab_size)
    refs = [decode_ar(target, p, N) for p in ps]
    bp = batched(name, [make(name, d) for _ in ps])  # the form its ProposerSpec declares
    assert isinstance(bp, DFlashBatchProposer if name == "dflash" else NGramBatchProposer)
    assert isinstance(batched(name, [make(name, d)]), PerRowProposers)  # one row: the B=1 path, no padding
    assert isinstance(batch_proposer([make(name, d) for _ in ps]), PerRowProposers)  # none declared: row by row
    batch_logs: list[list] = [[] for _ in ps]
    log_batch(bp, batch_logs)
    got = speculative_decode_batch(target, bp, ps, N)
    assert [r.tokens for r in got] == [r.tokens for r in refs]
    rows = [make(name, d) for _ in ps]
    row_logs: list[list] = [[] for _ in ps]
    for p, log in zip(rows, row_logs):
        p.propose = logged(p.propose, log)
    speculative_decode_batch(target, PerRowProposers(rows), ps, N)
    assert batch_logs == row_logs  # the same drafts, round for round, row for row
    if name == "ngram":
        assert sum(sum(r.accepted) for r in got) > 0
    eos = refs[0].tokens[8]  # row 0 stops early at this eos; the others run on
    got = speculative_decode_batch(target, batched(name, [make(name, d) for _ in ps]), ps, N, eos_id=eos)
    assert [r.tokens for r in got] == [decode_ar(target, p, N, eos_id=eos).tokens for p in ps]
    assert len({r.rounds for r in got}) > 1  # rows finished at different rounds and left the batch


def test_ngram_batch_proposes_what_ngram_proposes():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 4, (n,), generator=g) for n in (1, 3, 8, 12)]  # tiny vocab: many matches
    one = [NGramProposer(num_speculative_tokens=4, max_ngram=3, min_ngram=1) for _ in rows]
    batch = NGramBatchProposer(num_speculative_tokens=4, max_ngram=3, min_ngram=1)
    for p, r in zip(one, rows):
        p.begin(r[None], {}, Sampling())
    batch.begin(rows, {}, Sampling())
    for step in range(8):
        depth = [(step + a) % 5 for a in range(len(rows))]  # 0..4: an empty budget, short and full ones
        got = batch.propose(depth)
        want = [p.propose(k) if k else None for p, k in zip(one, depth)]
        for gp, wp in zip(got, want):
            assert gp.tokens.tolist() == ([] if wp is None else wp.tokens.tolist())
        new = [torch.randint(0, 4, (1 + (step + a) % 3,), generator=g) for a in range(len(rows))]
        for p, t in zip(one, new):
            p.accept(t[None], {})
        batch.accept(new, {})
    batch.retain([1, 3])
    assert [p.tokens.tolist() for p in batch.propose([4, 4])] == [one[i].propose(4).tokens.tolist() for i in (1, 3)]


def test_one_drafter_forward_per_round_for_all_rows(target, monkeypatch):  # noqa: F811
    d = drafter(target)
    calls = []
    blocks = d.blocks
    monkeypatch.setattr(d, "blocks", lambda *a, **kw: (calls.append(a[0].shape[0]), blocks(*a, **kw))[1])
    ps = ragged_prompts(target.vocab_size)
    res = speculative_decode_batch(target, batched("dflash", [DFlashProposer(d) for _ in ps]), ps, N)
    # the batch's rounds that drafted (row b takes part in rounds 0..rounds_b-1; the last ones may have no budget)
    drafting = [i for i in range(max(r.rounds for r in res)) if any(i < r.rounds and r.drafted[i] for r in res)]
    assert len(drafting) >= 10 and len(calls) == len(drafting)  # one forward per round...
    assert calls[0] == len(ps)  # ...with all rows in it
    calls.clear()
    res = speculative_decode_batch(target, PerRowProposers([DFlashProposer(d) for _ in ps]), ps, N)
    assert len(calls) == sum(sum(x > 0 for x in r.drafted) for r in res) > 2 * len(drafting)  # one per row
    assert set(calls) == {1}


def test_draft_cost_microbenchmark_times_one_batched_forward_per_round(target, monkeypatch):  # noqa: F811
    """measure_draft_costs drives the same batched proposer as the engine: one block forward of all B rows per
    timed round (reps + 1 rounds per (B, K)), so the policy's d_B(K) is a batched round, not B of them."""
    from eval.bench.cost_model import measure_draft_costs

    d = drafter(target)
    calls = []
    blocks = d.blocks
    monkeypatch.setattr(d, "blocks", lambda *a, **kw: (calls.append(a[0].shape[0]), blocks(*a, **kw))[1])
    secs = measure_draft_costs(target, lambda n, b: batched("dflash", [DFlashProposer(d, num_speculative_tokens=n)
                                                                       for _ in range(b)]),
                               ragged_prompts(target.vocab_size), [1, 3], [1, 2], reps=2)
    assert set(secs) == {1, 3} and all(set(v) == {1, 2} and min(v.values()) > 0 for v in secs.values())
    assert calls == [1] * 6 + [3] * 6  # (B=1: K=1, K=2) x 3 rounds, then B=3 likewise: one forward each


def test_sampled_batched_dflash_reproduces_target_distribution():
    """Rows of two prompts (lengths 3 and 5) in each batch: their draft caches differ in length (the padded,
    masked path), each row's first 4 tokens must follow the target's exact joint for its prompt."""
    small = FrozenTarget(sharp_tiny_llama(5))
    cfg = DFlashConfig(layer_ids=[0], num_layers=1, block_size=4, mask_token_id=2, num_anchors=2)
    d = scramble(DFlashDrafter(cfg, small.model.config, small.embed.weight,
                               small.model.get_output_embeddings().weight), seed=3)
    prompts = [torch.tensor([0, 2, 1]), torch.tensor([1, 1, 0, 2, 2])]
    sampling = Sampling(0.8, 1.0, 2)
    accepted, rounds = assert_batched_rows_follow_target(small, lambda: DFlashProposer(d), prompts, sampling, 11,
                                                         "dflash")
    assert 0.1 * rounds < accepted < 2.5 * rounds  # drafts both accepted and rejected


def assert_batched_rows_follow_target(tgt, make, prompts, sampling, seed: int, method: str, batches: int = 70
                                      ) -> tuple[int, int]:
    """Batches of 6 rows alternating over two prompts (ragged: the padded, masked path), 4 sampled tokens each,
    drafted by ``method``'s batched form (its ProposerSpec's): each prompt's samples must follow the target's exact
    joint for it (χ²). Returns (accepted drafts, rounds)."""
    exact = [exact_joint(tgt, p[None], 4, sampling) for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    samples: list[list[tuple]] = [[], []]
    accepted = rounds = 0
    for _ in range(batches):
        rows = [prompts[i % 2] for i in range(6)]
        res = speculative_decode_batch(tgt, batched(method, [make() for _ in rows]), rows, 4,
                                                    sampling=Sampling(sampling.temperature, sampling.top_p,
                                                                      sampling.top_k, gen))
        for i, r in enumerate(res):
            samples[i % 2].append(tuple(r.tokens))
            accepted += sum(r.accepted)
            rounds += r.rounds
    for s, e in zip(samples, exact):
        assert chi2_pvalue(s, e) > 1e-3
    return accepted, rounds


def test_trees_batch_with_per_row_masks():
    from tests.test_decode import V as V_DEC
    from tests.test_decode import drafters, make_proposer, prompts
    from tests.test_decode import target as target_fixture

    tgt = target_fixture.__wrapped__()
    dr = drafters.__wrapped__(tgt)
    ps = [p[0] for p in prompts(3)]
    assert tgt.vocab_size == V_DEC
    for name in ("eagle3_tree", "medusa_tree"):
        res = speculative_decode_batch(tgt, [make_proposer(name, tgt, dr) for _ in ps], ps, 17)
        assert [r.tokens for r in res] == [decode_ar(tgt, p, 17).tokens for p in ps]
        assert sum(sum(r.accepted) for r in res) > 0, name  # the per-row tree compaction ran


class FixedTreeProposer:
    """Every row, every round: the tree parents [-1, -1, 0, 1] (two depth-2 paths), siblings sampled i.i.d.
    from q0 or deterministic distinct tokens — one topology for all rows, so the batched tree rule takes them."""

    layer_ids: list[int] = []

    def __init__(self, q0: torch.Tensor, g: torch.Generator, sampled: bool):
        self.q0, self.g, self.sampled = q0, g, sampled

    def begin(self, tokens, hidden, sampling):
        pass

    def accept(self, tokens, hidden):
        pass

    def propose(self, max_depth: int):
        from models.core.proposal import Proposal

        parents = torch.tensor([-1, -1, 0, 1]) if max_depth >= 2 else torch.tensor([-1, -1])
        n, v = parents.shape[0], self.q0.shape[0]
        if self.sampled:
            toks = torch.multinomial(self.q0, n, replacement=True, generator=self.g)
            return Proposal(tokens=toks, parents=parents, q=self.q0.expand(n, v).clone())
        first = torch.randperm(v, generator=self.g)[:2]
        return Proposal(tokens=torch.cat([first, torch.randint(v, (n - 2,), generator=self.g)]), parents=parents)


@pytest.mark.parametrize("sampled", [True, False])
def test_batched_shared_topology_trees_reproduce_target_distribution(sampled, monkeypatch):
    """8 rows whose trees share one topology are accepted by ONE call of the batched tree rule (the first round;
    later rows with smaller budgets draft smaller trees, accepted row by row), and the first 4 tokens of each
    row follow the target's exact joint (χ²)."""
    from models.core import verify

    calls = []
    batched = verify.speculative_sample_tree_batch
    monkeypatch.setattr(verify, "speculative_sample_tree_batch",
                        lambda toks, *a, **kw: (calls.append(toks.shape[0]), batched(toks, *a, **kw))[1])
    small = FrozenTarget(sharp_tiny_llama(5))
    prompt = torch.tensor([0, 2, 1])
    exact = exact_joint(small, prompt[None], 4, Sampling(1.0))
    gen, g = torch.Generator().manual_seed(21), torch.Generator().manual_seed(22)
    q0 = torch.tensor([0.4, 0.2, 0.4])
    samples, accepted = [], 0
    for _ in range(60):
        res = speculative_decode_batch(small, [FixedTreeProposer(q0, g, sampled) for _ in range(8)],
                                                    [prompt] * 8, 4, sampling=Sampling(1.0, generator=gen))
        samples += [tuple(r.tokens) for r in res]
        accepted += sum(sum(r.accepted) for r in res)
    assert len(calls) >= 60 and calls[0] == 8  # every batch's first round: all 8 rows in one call
    assert accepted > 100
    assert chi2_pvalue(samples, exact) > 1e-3


def test_public_decoders_take_one_sampling_object(target):  # noqa: F811
    """The public decoders spell sampling one way, a ``Sampling`` (what the ladder passes): the same seeded run
    gives the same tokens through each of them, None is greedy, and the old scalar keywords are refused."""
    p = ragged_prompts(target.vocab_size)[0]
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    fns = (decode_ar, lambda t, x, n, **kw: speculative_decode(t, NGramProposer(), x, n, **kw),
           lambda t, x, n, **kw: speculative_decode_batch(t, [NGramProposer()], [x], n, **kw)[0],
           lambda t, x, n, **kw: decode_ar_batch(t, [x], n, **kw)[0])
    sampled = [fn(target, p, 8, sampling=Sampling(0.9, top_k=5, generator=g())).tokens for fn in fns]
    assert sampled == [fn(target, p, 8, sampling=Sampling(0.9, top_k=5, generator=g())).tokens for fn in fns]
    greedy = [fn(target, p, 8).tokens for fn in fns]
    assert greedy[1:] == greedy[:1] * 3 and greedy == [fn(target, p, 8, sampling=Sampling()).tokens for fn in fns]
    assert all(s != x for s, x in zip(sampled, greedy))  # the temperature was used, not dropped
    for fn in fns:
        with pytest.raises(TypeError, match="temperature"):
            fn(target, p, 8, temperature=0.9)


def test_eagle3_chains_draft_batched_one_pass_per_step(monkeypatch):
    """EAGLE-3 chains of 3 ragged rows: one ``Eagle3ChainBatchProposer`` whose every midlayer pass carries all
    active rows; greedy output equals per-row AR and every row's drafts equal the B=1 proposer's, round for round
    (the ragged cache, per-row RoPE positions and the scratch drafts are where a bug would show)."""
    from models.methods.eagle3 import kernels, proposers
    from tests.test_decode import drafters, prompts
    from tests.test_decode import target as target_fixture

    tgt = target_fixture.__wrapped__()
    dr = drafters.__wrapped__(tgt)["eagle"]
    ps = [p[0] for p in prompts(3)]
    ps[1] = ps[1][:5]  # ragged lengths
    make = lambda: proposers.Eagle3ChainProposer(dr, num_speculative_tokens=4)  # noqa: E731
    bp = batched("eagle3", [make() for _ in ps])
    assert isinstance(bp, proposers.Eagle3ChainBatchProposer)
    calls = []
    qkv = kernels.entry_qkv
    for mod in (kernels, proposers):  # cached_step (the B=1 chain) calls it in kernels, the batched chain here
        monkeypatch.setattr(mod, "entry_qkv", lambda d, ids, *a: (calls.append(ids.shape[0]), qkv(d, ids, *a))[1])
    batch_logs: list[list] = [[] for _ in ps]
    log_batch(bp, batch_logs)
    got = speculative_decode_batch(tgt, bp, ps, N)
    assert [r.tokens for r in got] == [decode_ar(tgt, p, N).tokens for p in ps]
    rounds = max(r.rounds for r in got)
    assert calls[0] == len(ps) and len(calls) <= 4 * rounds  # <= k passes per round for the whole batch
    calls.clear()
    rows = [make() for _ in ps]
    row_logs: list[list] = [[] for _ in ps]
    for p, log in zip(rows, row_logs):
        p.propose = logged(p.propose, log)
    speculative_decode_batch(tgt, PerRowProposers(rows), ps, N)
    assert set(calls) == {1} and len(calls) > 2 * rounds  # the adapter: one pass per row per step
    assert batch_logs == row_logs


def test_sampled_batched_eagle3_chains_reproduce_target_distribution():
    """Sampled EAGLE-3 chain drafts of rows with prompts of two lengths in one batch (padded ragged cache): each
    row's first 4 tokens follow the target's exact joint for its prompt (χ²)."""
    from models.methods.eagle3.config import Eagle3Config
    from models.methods.eagle3.net import Eagle3Drafter
    from models.methods.eagle3.proposers import Eagle3ChainProposer
    from tests.test_decode import make_tiny_llama

    m = make_tiny_llama(3, layers=2, hidden=16, seed=5)  # sharp_tiny_llama's recipe with the 2 layers EAGLE-3 fuses
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 3 / p.shape[1] ** 0.5)
        m.model.embed_tokens.weight.mul_(16**0.5)
    small = FrozenTarget(m)
    tc = small.model.config
    torch.manual_seed(2)
    d = Eagle3Drafter(Eagle3Config(layer_ids=[0, 1, 2], draft_vocab_size=tc.vocab_size, ttt_steps=2), tc,
                      small.embed.weight * 3).eval()
    with torch.no_grad():  # sharp drafts too: a q that is not the distribution drafts were sampled from shows
        for name, w in d.named_parameters():
            if w.dim() == 2 and "embed" not in name:
                w.copy_(torch.randn(w.shape, generator=g) * 1 / w.shape[1] ** 0.5)
    prompts = [torch.tensor([0, 2, 1]), torch.tensor([1, 1, 0, 2, 2])]
    sampling = Sampling(0.8, 1.0, 2)
    # row by row, the first draft's q is the B=1 proposer's (same context) and every draft has q > 0
    hid = small.forward(torch.stack([prompts[0], prompts[1][:3]]), layer_ids=d.layer_ids).hidden
    one = Eagle3ChainProposer(d, num_speculative_tokens=3)
    bp = Eagle3ChainProposer.batched([Eagle3ChainProposer(d, num_speculative_tokens=3)] * 2)
    bp.begin([torch.cat([p, p[:1]]) for p in (prompts[0], prompts[1][:3])], hid, sampling)
    got = bp.propose([3, 3])
    for a, p in enumerate((prompts[0], prompts[1][:3])):
        one.begin(torch.cat([p, p[:1]])[None], {k: v[a : a + 1] for k, v in hid.items()}, sampling)
        assert torch.allclose(got[a].q[0], one.propose(1).q[0], atol=1e-6)
        assert bool((got[a].q[torch.arange(3), got[a].tokens] > 0).all())
    make = lambda: Eagle3ChainProposer(d, num_speculative_tokens=3)  # noqa: E731
    accepted, rounds = assert_batched_rows_follow_target(small, make, prompts, sampling, 12, "eagle3")
    assert 0.05 * rounds < accepted < 2.5 * rounds  # drafts both accepted and rejected
