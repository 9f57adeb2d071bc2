"""The decoding engine (eval/decode/single.py) and every proposer (models/methods/<name>/) on tiny models built in
code.

What is checked:
- the KV cache: cached greedy decoding equals a naive no-cache argmax loop;
- tree verification: one forward with the 4D tree mask gives, for every node, the logits of running its
  root-to-node path on its own; KV compaction leaves exactly the cache of [prefix, root, accepted path];
- the KV-cached drafters equal the models' reference (no-cache) proposals;
- losslessness: greedy speculative output == decode_ar for every proposer, lengths not a multiple of K, eos;
- sampling: through the engine, the first generated tokens follow the target's exact distribution (χ²);
- accounting: an oracle proposer gives τ = K+1 exactly, an always-wrong one τ = 1;
- one-line errors for bad sampling settings, oversized trees and drafters/draft models for another target.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from scipy.stats import chisquare

from eval.decode.batch import decode_ar_batch, speculative_decode_batch
from eval.decode.ladder import new_cache
from eval.decode.single import commit_kv, decode_ar, prefill, speculative_decode, verify_forward
from models import registry
from models.core.proposal import Proposal, Sampling, batch_proposer
from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab
from models.methods.draft_model import DraftModelProposer
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.net import Eagle3Drafter
from models.methods.eagle3.proposers import Eagle3ChainProposer, Eagle3TreeProposer
from models.methods.medusa.config import MedusaConfig
from models.methods.medusa.net import MedusaHeads
from models.methods.medusa.proposers import MedusaProposer
from models.methods.medusa.tree import default_medusa_choices
from models.methods.mtp.config import MTPConfig
from models.methods.mtp.net import MTPDrafter
from models.methods.mtp.proposers import MTPProposer, propose_chain
from models.methods.ngram import NGramProposer
from models.registry import load_proposer
from tests.conftest import make_tiny_llama

V = 32  # small vocabulary: random drafters still get some tokens accepted, so compaction paths run


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return FrozenTarget(make_tiny_llama(V, layers=4, hidden=32, seed=0))


@pytest.fixture(scope="module")
def drafters(target):
    tc = target.model.config
    torch.manual_seed(1)
    d2t, t2d = build_draft_vocab(torch.rand(V), 24)  # reduced draft vocabulary: exercises the d2t mapping
    # embedding x30: the target's tiny-init embedding would leave the drafter's output almost independent of
    # its context and positions, and the reference comparisons below blind to cache/position bugs
    eagle = Eagle3Drafter(Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=24, ttt_steps=3), tc,
                          target.embed.weight * 30, d2t, t2d).eval()
    medusa = MedusaHeads(MedusaConfig(num_heads=3), tc, target.model.get_output_embeddings().weight.detach())
    with torch.no_grad():  # non-zero ResBlocks so the heads differ from the target's own lm_head
        for p in medusa.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mtp = MTPDrafter.from_target(MTPConfig(num_modules=2), target).eval()
    with torch.no_grad():  # O(1) weights (not the 0.02 init) so its outputs depend clearly on context
        for p in mtp.parameters():
            if p.dim() == 2:
                p.normal_(0, 2 / p.shape[1] ** 0.5)
    draft_lm = make_tiny_llama(V, layers=1, hidden=16, seed=3)
    return {"eagle": eagle, "medusa": medusa, "mtp": mtp, "draft_lm": draft_lm}


def make_proposer(name: str, target: FrozenTarget, d: dict):
    if name == "ngram":
        return NGramProposer(num_speculative_tokens=4, max_ngram=3)
    if name == "draft_model":
        return DraftModelProposer(d["draft_lm"], num_speculative_tokens=3, target=target)
    if name == "self_draft":  # the target drafting for itself: every draft is accepted
        return DraftModelProposer(target.model, num_speculative_tokens=3, target=target)
    if name == "eagle3_chain":
        return Eagle3ChainProposer(d["eagle"], num_speculative_tokens=4)
    if name == "eagle3_tree":
        return Eagle3TreeProposer(d["eagle"], depth=4, top_k=4, total_tokens=24)
    if name == "medusa_tree":
        return MedusaProposer(d["medusa"], choices=default_medusa_choices(3, top_k=4, num_nodes=20))
    if name == "mtp_chain":
        return MTPProposer(d["mtp"], num_speculative_tokens=3)  # 3 > D = 2: the last module is reused
    raise KeyError(name)


PROPOSERS = ["ngram", "draft_model", "self_draft", "eagle3_chain", "eagle3_tree", "medusa_tree", "mtp_chain"]
# make_proposer's names → the registry's proposer names (what the batched form is declared on)
SPEC_OF = {"ngram": "ngram", "draft_model": "draft_model", "self_draft": "draft_model", "eagle3_chain": "eagle3",
           "eagle3_tree": "eagle3_tree", "medusa_tree": "medusa", "mtp_chain": "mtp", "dspark": "dflash"}


def batched(name: str, rows: list):
    """``rows`` batched as eval batches them: the batched form their proposer's spec declares
    (``ProposerSpec.batched``; one drafter call per round for all rows), else one row after another."""
    return batch_proposer(rows, registry.proposer(SPEC_OF.get(name, name))[1].batched)


def prompts(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, V, (1, 5 + 3 * i), generator=g) for i in range(n)]
    out[-1] = torch.cat([out[-1], out[-1]], dim=1)  # a repeated prompt: prompt lookup finds matches
    return out


@torch.no_grad()
def naive_greedy(target: FrozenTarget, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt
    for _ in range(n):
        nxt = target.model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, prompt.shape[1]:].tolist()


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """parents [n], topological: node j hangs off a random earlier node or the root."""
    return torch.tensor([int(torch.randint(-1, j, (1,), generator=g)) for j in range(n)])


# --------------------------------------------------------------------------------------------- engine pieces
def test_decode_ar_greedy_equals_naive_no_cache_loop(target):
    for prompt in prompts():
        res = decode_ar(target, prompt, 13)
        assert res.tokens == naive_greedy(target, prompt, 13)
        assert res.target_forwards == 13 and res.tau == 1.0 and res.stop == "length"
    eos = res.tokens[5]
    stopped = decode_ar(target, prompt, 13, eos_id=eos)
    first = res.tokens.index(eos)
    assert stopped.tokens == res.tokens[: first + 1] and stopped.stop == "eos"


def test_tree_verification_logits_equal_each_path_run_alone(target):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, V, (1, 9), generator=g)
    root = torch.tensor([7])
    parents = random_tree(14, g)
    tokens = torch.randint(3, V, (14,), generator=g)
    cache = new_cache(target)
    prefill(target, prompt, cache)
    out = verify_forward(target, cache, root, Proposal(tokens=tokens, parents=parents))
    assert out.logits.shape == (1, 15, V) and cache.get_seq_length() == 9 + 15
    par = parents.tolist()
    for j in [-1, *range(14)]:
        path, node = [], j
        while node >= 0:
            path.append(int(tokens[node]))
            node = par[node]
        seq = torch.cat([prompt[0], root, torch.tensor(path[::-1], dtype=torch.long)])[None]
        ref = target.model(input_ids=seq).logits[0, -1]
        torch.testing.assert_close(out.logits[0, j + 1], ref, atol=1e-5, rtol=0)


def test_commit_kv_keeps_exactly_the_accepted_path(target):
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, V, (1, 6), generator=g)
    root = torch.tensor([5])
    parents = torch.tensor([-1, -1, 0, 1, 3, 1, 4])
    tokens = torch.randint(3, V, (7,), generator=g)
    cache = new_cache(target)
    prefill(target, prompt, cache)
    verify_forward(target, cache, root, Proposal(tokens=tokens, parents=parents))
    path = [1, 3, 4, 6]  # not contiguous: the entries must be gathered into place
    commit_kv(cache, 6, path)
    ref = new_cache(target)
    prefill(target, torch.cat([prompt[0], root, tokens[path]])[None], ref)
    assert cache.get_seq_length() == ref.get_seq_length() == 6 + 1 + 4
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)
    # a chain path is a crop
    verify_forward(target, cache, torch.tensor([9]), Proposal(tokens=tokens[:3]))
    commit_kv(cache, 11, [0, 1])
    assert cache.get_seq_length() == 11 + 1 + 2


# --------------------------------------------------------------------------------------------- KV-cached drafters
def test_eagle3_kv_chain_equals_draft_greedy(target, drafters):
    dr = drafters["eagle"]
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(3, V, (1, 12), generator=g)
    hid = target(ctx, layer_ids=dr.layer_ids).hidden
    prop = Eagle3ChainProposer(dr, num_speculative_tokens=5)
    n0 = 8  # begin: tokens x_0..x_8, states for x_0..x_7
    prop.begin(ctx[:, : n0 + 1], {k: v[:, :n0] for k, v in hid.items()}, Sampling())
    got = prop.propose(5).tokens
    ref = dr.draft_greedy({k: v[:, :n0] for k, v in hid.items()}, ctx[:, : n0 + 1], 5)[0]
    assert torch.equal(got, ref)
    # accept 3 more context tokens (states for the 3 tokens before them), propose again from the cache
    prop.accept(ctx[:, n0 + 1 :], {k: v[:, n0 : n0 + 3] for k, v in hid.items()})
    got = prop.propose(4).tokens
    ref = dr.draft_greedy({k: v[:, :11] for k, v in hid.items()}, ctx, 4)[0]
    assert torch.equal(got, ref)
    assert prop.n_real == 11
    # sampled drafts: q over the target vocabulary is the drafter's distribution after the drafted tokens
    prop = Eagle3ChainProposer(dr, num_speculative_tokens=4)
    prop.begin(ctx, {k: v[:, :11] for k, v in hid.items()}, Sampling(1.0, generator=g))
    sampled = prop.propose(4)
    assert sampled.q.shape == (4, V) and torch.allclose(sampled.q.sum(-1), torch.ones(4))
    assert bool((sampled.q[:, ~dr.t2d] == 0).all())  # no mass outside the draft vocabulary
    for s in range(4):
        ref_q = torch.exp(_eagle_reference_logp(dr, {k: v[:, :11] for k, v in hid.items()}, ctx,
                                                sampled.tokens[:s].tolist()))
        torch.testing.assert_close(sampled.q[s, dr.draft_ids], ref_q, atol=1e-5, rtol=0)


def test_eagle3_kv_buffer_growth_keeps_the_cache(target, drafters):
    """Contexts past DraftKV's first capacity (64) and accepts that cross a doubling still draft exactly
    what the no-cache loop drafts; drafted scratch entries never leak into the real ones."""
    from models.methods.eagle3.kernels import DraftKV

    kv = DraftKV()
    a = torch.randn(1, 2, 60, 4)
    kv.write(0, a, a + 1)
    b = torch.randn(1, 2, 10, 4)
    keys, values = kv.write(60, b, b + 1)  # grows past 64: the first 60 entries are copied over
    assert keys.shape[2] == 70 and torch.equal(keys[:, :, :60], a) and torch.equal(values[:, :, 60:], b + 1)
    dr = drafters["eagle"]
    g = torch.Generator().manual_seed(4)
    ctx = torch.randint(3, V, (1, 140), generator=g)
    hid = target(ctx, layer_ids=dr.layer_ids).hidden
    prop = Eagle3ChainProposer(dr, num_speculative_tokens=5)
    n0 = 60
    prop.begin(ctx[:, : n0 + 1], {k: v[:, :n0] for k, v in hid.items()}, Sampling())
    prop.propose(5)  # drafted scratch entries are written after the real ones, then overwritten
    for n1 in (63, 66, 130, 139):  # accepts that land just below / above a capacity doubling
        prop.accept(ctx[:, n0 + 1 : n1 + 1], {k: v[:, n0:n1] for k, v in hid.items()})
        n0 = n1
        ref = dr.draft_greedy({k: v[:, :n0] for k, v in hid.items()}, ctx[:, : n0 + 1], 5)[0]
        assert torch.equal(prop.propose(5).tokens, ref), n0
        assert prop.n_real == n0


def _eagle_reference_logp(dr, hid, ctx, path_tokens):
    """No-cache reference (draft_greedy's loop with forced tokens): log q [Vd] after drafting ``path_tokens``."""
    import math

    import torch.nn.functional as F

    layer, attn = dr.midlayer, dr.midlayer.self_attn
    emb = dr.embed_tokens(ctx[:, 1:])
    h = dr.fuse(hid)
    for s in range(len(path_tokens) + 1):
        x, residual = layer.pre(emb, h)
        cos, sin = dr.rope(emb.shape[1], offset=0)
        q, k, v = attn.qkv(x, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(dr.head_dim))
        a_last = layer.post(o, residual)[:, -1:]
        if s < len(path_tokens):
            emb = torch.cat([emb, dr.embed_tokens(torch.tensor([[path_tokens[s]]]))], dim=1)
            h = torch.cat([h, a_last], dim=1)
    return torch.log_softmax(dr.logits(a_last)[0, 0].float(), -1)


@torch.no_grad()
def test_eagle2_dynamic_tree_matches_a_no_cache_reference(target, drafters):
    dr = drafters["eagle"]
    g = torch.Generator().manual_seed(4)
    ctx = torch.randint(3, V, (1, 10), generator=g)
    hid = {k: v[:, :9] for k, v in target(ctx, layer_ids=dr.layer_ids).hidden.items()}
    prop = Eagle3TreeProposer(dr, depth=4, top_k=3, total_tokens=15)
    prop.begin(ctx, hid, Sampling())
    tree = prop.propose(10)
    par, toks, depth = tree.parents.tolist(), tree.tokens.tolist(), tree.depth.tolist()
    assert tree.size == 15 and 2 <= max(depth) <= 4 and all(p < j for j, p in enumerate(par))
    t2d = {t: i for i, t in enumerate(dr.draft_ids.tolist())}
    children: dict[int, list[int]] = {}
    for j, p in enumerate(par):
        children.setdefault(p, []).append(j)
    for p, kids in children.items():
        path, node = [], p
        while node >= 0:
            path.append(toks[node])
            node = par[node]
        ref = _eagle_reference_logp(dr, hid, ctx, path[::-1])
        top = set(dr.draft_ids[ref.topk(3).indices].tolist())
        base = 0.0 if p < 0 else float(prop.last_scores[p])
        for j in kids:
            assert toks[j] in top  # distinct top-k children (deterministic drafts)
            # cumulative log q equals the no-cache drafter's along the path: positions, masks and states right
            assert abs(float(prop.last_scores[j]) - (base + float(ref[t2d[toks[j]]]))) < 1e-4, (p, j)
    assert len(children[-1]) == 3  # the root's top-3 always survive (highest scores)
    prop.begin(ctx, hid, Sampling())
    assert int(prop.propose(2).depth.max()) == 2  # the engine's budget caps the depth


def _mtp_reference_q(dr, ctx: torch.Tensor, h: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """No-cache reference (propose_chain's loop with forced tokens): q [k, V] of each chain step."""
    n = ctx.shape[1] - 1
    tokens = torch.cat([ctx, torch.tensor([drafts])], dim=1)
    prev, out = h, []
    for j in range(len(drafts)):
        d = min(j, dr.cfg.num_modules - 1)
        prev = dr.run_module(d, prev, tokens[:, j + 1 : j + 1 + n])
        out.append(torch.softmax(dr.logits(d, prev[:, -1])[0].float(), -1))
    return torch.stack(out)


@torch.no_grad()
def test_mtp_kv_chain_equals_propose_chain(target, drafters):
    dr = drafters["mtp"]
    L = dr.layer_ids[0]
    g = torch.Generator().manual_seed(5)
    ctx = torch.randint(3, V, (1, 14), generator=g)
    h = target(ctx, layer_ids=dr.layer_ids).hidden[L]
    for sampling in (Sampling(), Sampling(1.0, generator=g)):
        prop = MTPProposer(dr, num_speculative_tokens=4)
        prop.begin(ctx[:, :7], {L: h[:, :6]}, sampling)
        end, k = 7, 4
        for nxt in (9, 10, 14, None):  # propose, then accept 2, 1, 4 tokens: the per-depth caches stay right
            got = prop.propose(k)
            if sampling.greedy:
                assert torch.equal(got.tokens, propose_chain(dr, ctx[:, :end], h[:, : end - 1], k)[0])
            else:
                ref = _mtp_reference_q(dr, ctx[:, :end], h[:, : end - 1], got.tokens.tolist())
                torch.testing.assert_close(got.q, ref, atol=1e-5, rtol=0)
            if nxt is None:
                break
            prop.accept(ctx[:, end:nxt], {L: h[:, end - 1 : nxt - 1]})
            end, k = nxt, (4 if nxt < 14 else 2)


# --------------------------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("name", PROPOSERS)
def test_greedy_speculative_equals_autoregressive(target, drafters, name):
    accepted = 0
    for i, prompt in enumerate(prompts()):
        n = (17, 22, 30)[i]  # not multiples of K + 1
        ref = decode_ar(target, prompt, n)
        res = speculative_decode(target, make_proposer(name, target, drafters), prompt, n)
        assert res.tokens == ref.tokens, (name, i)
        assert res.target_forwards == 1 + res.rounds
        assert len(res.tokens) == 1 + sum(a + 1 for a in res.accepted)  # prefill token + accepted + 1 per round
        accepted += sum(res.accepted)
        # eos inside an accepted run stops exactly where decode_ar stops
        eos = ref.tokens[n // 2]
        ref_eos = decode_ar(target, prompt, n, eos_id=eos)
        res_eos = speculative_decode(target, make_proposer(name, target, drafters), prompt, n, eos_id=eos)
        assert res_eos.tokens == ref_eos.tokens and res_eos.stop == "eos"
    if name in ("ngram", "self_draft", "eagle3_tree", "medusa_tree"):
        assert accepted > 0, name  # the compaction paths actually ran
    if name == "self_draft":
        assert accepted >= 25


# --------------------------------------------------------------------------------------------- sampling
class MixedProposer:
    """Each round, at random: a chain sampled from q0, a tree of deterministic distinct siblings, or a tree of
    siblings sampled i.i.d. from q0 (SpecInfer). q0 differs from the target, so rejections are frequent."""

    layer_ids: list[int] = []

    def __init__(self, q0: torch.Tensor, seed: int):
        self.q0 = q0
        self.g = torch.Generator().manual_seed(seed)

    def begin(self, tokens, hidden, sampling):
        pass

    def accept(self, tokens, hidden):
        pass

    def propose(self, max_depth: int) -> Proposal:
        mode = int(torch.randint(3, (1,), generator=self.g))
        v = self.q0.shape[0]
        if mode == 0:
            k = min(2, max_depth)
            toks = torch.multinomial(self.q0, k, replacement=True, generator=self.g)
            return Proposal(tokens=toks, q=self.q0.expand(k, v).clone())
        parents = torch.tensor([-1, -1, 0, 1])[: 2 if max_depth < 2 else 4]
        n = parents.shape[0]
        if mode == 1:
            first = torch.randperm(v, generator=self.g)[:2]
            toks = torch.cat([first, torch.randint(v, (n - 2,), generator=self.g)])
            return Proposal(tokens=toks, parents=parents)
        toks = torch.multinomial(self.q0, n, replacement=True, generator=self.g)
        return Proposal(tokens=toks, parents=parents, q=self.q0.expand(n, v).clone())


@torch.no_grad()
def exact_joint(target: FrozenTarget, prompt: torch.Tensor, n: int, sampling: Sampling) -> dict:
    """P(first n generated tokens) from the target's processed probabilities, by enumeration."""
    v = target.vocab_size
    probs = {}
    for seq in itertools.product(range(v), repeat=n):
        ids = torch.cat([prompt[0], torch.tensor(seq[:-1], dtype=torch.long)])[None]
        p = sampling.probs(target.model(input_ids=ids).logits[0, -n:].double())
        probs[seq] = float(torch.prod(p[torch.arange(n), torch.tensor(seq)]))
    return probs


def chi2_pvalue(samples: list[tuple[int, ...]], exact: dict) -> float:
    """χ² goodness of fit; sequences of probability 0 must never occur, cells expecting < 5 are pooled."""
    counts = {s: 0 for s in exact}
    for s in samples:
        counts[s] += 1
    impossible = [s for s in exact if exact[s] < 1e-12]
    assert sum(counts[s] for s in impossible) == 0, "sampled a sequence the target gives probability 0"
    total = len(samples)
    big = [s for s in exact if exact[s] * total >= 5]
    small = [s for s in exact if 1e-12 <= exact[s] and exact[s] * total < 5]
    obs = [counts[s] for s in big] + ([sum(counts[s] for s in small)] if small else [])
    exp = [exact[s] * total for s in big] + ([sum(exact[s] for s in small) * total] if small else [])
    scale = total / sum(exp)  # renormalise away the excluded probability-0 mass (float dust)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def sharp_tiny_llama(seed: int) -> torch.nn.Module:
    """A 3-token, 1-layer Llama whose next-token distribution depends strongly on context and positions
    (weights ~ 3/sqrt(fan_in), unit-scale embeddings): KV-cache or position bugs change what it samples."""
    m = make_tiny_llama(3, layers=1, hidden=16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 3 / p.shape[1] ** 0.5)
        m.model.embed_tokens.weight.mul_(16**0.5)
    return m


@pytest.fixture(scope="module")
def small_target() -> FrozenTarget:
    return FrozenTarget(sharp_tiny_llama(5))


def test_sampled_engine_reproduces_target_distribution(small_target):
    """4 tokens: round 1 drafts 2 deep (chain, deterministic tree or sampled tree), later rounds run on the
    compacted cache. top_k=2 zeroes one token per step, so every draft of it must be rejected."""
    prompt = torch.tensor([[0, 2, 1]])
    sampling = Sampling(0.8, 1.0, 2)
    exact = exact_joint(small_target, prompt, 4, sampling)
    q0 = torch.tensor([0.5, 0.2, 0.3])
    gen = torch.Generator().manual_seed(123)
    prop = MixedProposer(q0, seed=7)
    samples, accepted, rounds = [], 0, 0
    for _ in range(500):
        res = speculative_decode(small_target, prop, prompt, 4,
                                        sampling=Sampling(0.8, top_k=2, generator=gen))
        samples.append(tuple(res.tokens))
        accepted += sum(res.accepted)
        rounds += res.rounds
    assert 0.3 * rounds < accepted < 1.5 * rounds  # drafts accepted (compaction + bonus ran) and rejected
    assert chi2_pvalue(samples, exact) > 1e-3


def test_sampled_draft_model_reproduces_target_distribution(small_target):
    draft = sharp_tiny_llama(9)
    prompt = torch.tensor([[0, 2, 1]])
    exact = exact_joint(small_target, prompt, 4, Sampling(1.0, 0.9, 0))
    gen = torch.Generator().manual_seed(321)
    samples, rounds, acc = [], 0, 0
    for _ in range(300):
        prop = DraftModelProposer(draft, num_speculative_tokens=2, target=small_target)
        res = speculative_decode(small_target, prop, prompt, 4,
                                        sampling=Sampling(1.0, top_p=0.9, generator=gen))
        samples.append(tuple(res.tokens))
        rounds += res.rounds
        acc += sum(res.accepted)
    assert 0.2 * rounds < acc < 1.8 * rounds  # some but not all drafts accepted
    assert chi2_pvalue(samples, exact) > 1e-3


# --------------------------------------------------------------------------------------------- batched chains
@pytest.mark.parametrize("name", ["ngram", "self_draft", "eagle3_chain", "mtp_chain"])
def test_batched_greedy_equals_per_row_autoregressive(target, drafters, name):
    ps = prompts(4)  # lengths 5, 8, 11, 28: right padding + per-row positions
    refs = [decode_ar(target, p, 19) for p in ps]
    res = speculative_decode_batch(target, batched(name, [make_proposer(name, target, drafters)
                                                                       for _ in ps]), ps, 19)
    for r, ref in zip(res, refs):
        assert r.tokens == ref.tokens
        assert len(r.tokens) == 1 + sum(a + 1 for a in r.accepted) and r.target_forwards == 1 + r.rounds
    if name == "self_draft":
        assert all(r.tau > 3 for r in res)
    eos = refs[1].tokens[6]
    res = speculative_decode_batch(target, batched(name, [make_proposer(name, target, drafters)
                                                                       for _ in ps]), ps, 19, eos_id=eos)
    assert [r.tokens for r in res] == [decode_ar(target, p, 19, eos_id=eos).tokens for p in ps]
    assert [r.tokens for r in decode_ar_batch(target, ps, 19)] == [r.tokens for r in refs]


class RaggedChainProposer:
    """Chains of random length 0..2 (rows of a batch differ, so the engine pads), sampled from q0 or
    deterministic at random."""

    layer_ids: list[int] = []

    def __init__(self, q0: torch.Tensor, g: torch.Generator):
        self.q0, self.g = q0, g

    def begin(self, tokens, hidden, sampling):
        pass

    def accept(self, tokens, hidden):
        pass

    def propose(self, max_depth: int) -> Proposal:
        k = min(int(torch.randint(3, (1,), generator=self.g)), max_depth)
        toks = torch.multinomial(self.q0, k, replacement=True, generator=self.g) if k else torch.zeros(0).long()
        sampled = bool(torch.randint(2, (1,), generator=self.g))
        return Proposal(tokens=toks, q=self.q0.expand(k, -1).clone() if sampled else None)


def test_batched_sampling_reproduces_target_distribution(small_target):
    """8 rows of one prompt per batch; ragged drafts padded with token 0, a real token here, so accepted
    padding (the pad emitted as that position's token) happens often and must keep the output exact."""
    prompt = torch.tensor([0, 2, 1])
    exact = exact_joint(small_target, prompt[None], 4, Sampling(1.0))
    gen, g = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    q0 = torch.tensor([0.4, 0.2, 0.4])
    samples, accepted = [], 0
    for _ in range(90):
        res = speculative_decode_batch(small_target, [RaggedChainProposer(q0, g) for _ in range(8)],
                                              [prompt] * 8, 4, sampling=Sampling(1.0, generator=gen))
        samples += [tuple(r.tokens) for r in res]
        accepted += sum(sum(r.accepted) for r in res)
    assert accepted > 100
    assert chi2_pvalue(samples, exact) > 1e-3


# --------------------------------------------------------------------------------------------- τ accounting
class ScriptedProposer:
    """Proposes the reference continuation (oracle) or a token that is always different from it."""

    layer_ids: list[int] = []

    def __init__(self, reference: list[int], num_speculative_tokens: int, wrong: bool = False):
        self.ref, self.num_speculative_tokens, self.wrong = reference, num_speculative_tokens, wrong

    def begin(self, tokens, hidden, sampling):
        self.pos = 1  # generated tokens already in the context

    def accept(self, tokens, hidden):
        self.pos += tokens.shape[1]

    def propose(self, max_depth: int) -> Proposal:
        toks = torch.tensor(self.ref[self.pos : self.pos + min(self.num_speculative_tokens, max_depth)])
        return Proposal(tokens=(toks + 1) % V if self.wrong else toks)


def test_tau_oracle_is_k_plus_one_and_always_wrong_is_one(target):
    k, rounds = 3, 5
    n = 1 + rounds * (k + 1)
    prompt = prompts()[0]
    ref = decode_ar(target, prompt, n).tokens
    oracle = speculative_decode(target, ScriptedProposer(ref, k), prompt, n)
    assert oracle.tokens == ref and oracle.tau == k + 1 and oracle.rounds == rounds
    assert oracle.acceptance_by_pos == [1.0] * k and oracle.target_forwards == 1 + rounds
    wrong = speculative_decode(target, ScriptedProposer(ref, k, wrong=True), prompt, n)
    assert wrong.tokens == ref and wrong.tau == 1.0 and wrong.rounds == n - 1
    assert wrong.acceptance_by_pos == [0.0]
    assert oracle.draft_s >= 0 and oracle.verify_s > 0 and oracle.total_s >= oracle.verify_s


# --------------------------------------------------------------------------------------------- errors
def test_errors_are_one_line(target, drafters, tiny_tokenizer, tmp_path):
    prompt = prompts()[0]
    for kw in ({"temperature": -1.0}, {"temperature": 1.0, "top_p": 0.0}, {"temperature": 1.0, "top_p": 1.5}):
        with pytest.raises(ValueError, match="temperature|top_p"):  # refused where the Sampling is made
            Sampling(**kw)
    with pytest.raises(ValueError, match="max_nodes"):
        Eagle3TreeProposer(drafters["eagle"], total_tokens=300)

    class Huge(ScriptedProposer):
        def propose(self, max_depth):
            return Proposal(tokens=torch.zeros(300, dtype=torch.long), parents=torch.full((300,), -1))

    with pytest.raises(ValueError, match="more than max_nodes=256"):
        speculative_decode(target, Huge([], 1), prompt, 4)
    with pytest.raises(ValueError, match="3 heads"):
        MedusaProposer(drafters["medusa"], choices=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    with pytest.raises(ValueError, match="smaller than the target"):
        DraftModelProposer(make_tiny_llama(V - 1, layers=1, hidden=16), target=target)
    with_tok = FrozenTarget(make_tiny_llama(len(tiny_tokenizer), layers=1, hidden=16), tiny_tokenizer)
    grown = copy.deepcopy(tiny_tokenizer)  # another tokenizer: one more token
    grown.add_tokens(["<extra_token>"])
    with pytest.raises(ValueError, match="tokenizer differs"):
        DraftModelProposer(make_tiny_llama(len(grown), layers=1, hidden=16), target=with_tok, tokenizer=grown)
    # a drafter checkpoint trained for another target is refused by load_proposer (via load_drafter)
    from train.checkpoint import save_drafter

    dr = drafters["medusa"]
    meta = {"method": "medusa", "target": target.identity(), "draft": dr.config_dict(), "layer_ids": dr.layer_ids}
    save_drafter(tmp_path / "ck", dr, meta)
    assert isinstance(load_proposer(tmp_path / "ck", target, num_nodes=20), MedusaProposer)
    other = FrozenTarget(make_tiny_llama(V, layers=4, hidden=32, seed=11))
    with pytest.raises(ValueError, match="another target"):
        load_proposer(tmp_path / "ck", other, num_nodes=20)


def test_draft_model_proposer_when_new_tokens_match_all_its_drafts(target, drafters):
    """accept() of exactly the tokens it drafted (more than a verified round gives: the cache then holds the whole
    context) must not leave it with nothing to feed: the next proposal equals a fresh proposer's on that context."""
    p = DraftModelProposer(drafters["draft_lm"], num_speculative_tokens=3, target=target)
    ctx = prompts(1)[0][0]
    p.begin(ctx[None], {}, Sampling())
    drafts = p.propose(3).tokens
    p.accept(drafts[:2][None], {})  # both cached (the third draft was never fed): the cache covers the context
    assert p.seen.shape[0] == p.ctx.shape[0]
    fresh = DraftModelProposer(drafters["draft_lm"], num_speculative_tokens=3, target=target)
    fresh.begin(torch.cat([ctx, drafts[:2]])[None], {}, Sampling())
    assert p.propose(3).tokens.tolist() == fresh.propose(3).tokens.tolist()
