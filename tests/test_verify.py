"""models.core.verify: greedy acceptance by hand, losslessness of speculative sampling by χ² tests.

The statistical tests simulate decoding from a small position-dependent Markov "target" and a
different Markov "draft" (V = 6, both filtered through sampling_probs with top-p / top-k so that
zero-probability tokens occur), batch tens of thousands of independent trials per tensor op, and
check that the emitted sequence has exactly the target's joint distribution. Negative controls run
known-wrong acceptance rules through the same harness and must be rejected, so the harness is
known to be able to fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

from models.core import verify

V = 6
ALPHA = 1e-3  # a correct rule must give p-value > ALPHA
CONTROL_ALPHA = 1e-6  # a wrong rule must give p-value < CONTROL_ALPHA
TRIALS = 40_000
S0 = 0  # context token before the first generated position
T = 8  # positions covered by the tables (>= tokens tested + drafts per step)


# --------------------------------------------------------------------------------------------
# Hand-checked greedy verification
# --------------------------------------------------------------------------------------------
def rows_with_argmax(best: list[int], vocab: int = 5) -> torch.Tensor:
    """Logits [len(best), vocab]: a fixed non-uniform background plus +3 at the wanted argmax."""
    base = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5][:vocab])  # argmax would be the last id without the bump
    out = base.repeat(len(best), 1)
    out[torch.arange(len(best)), torch.tensor(best)] += 3.0
    return out


@pytest.mark.parametrize(
    "draft, best, n_expected, next_expected",
    [
        ([2, 4, 1], [2, 4, 1, 3], 3, 3),  # all accepted → bonus from row K
        ([0, 4, 1], [2, 4, 1, 3], 0, 2),  # first rejected → target's row-0 argmax
        ([2, 4, 0], [2, 4, 1, 3], 2, 1),  # break at the last draft
        ([2, 0, 1], [2, 4, 1, 3], 1, 4),  # a later match after the break does not count
        ([], [3], 0, 3),  # K = 0: plain autoregressive step
    ],
)
def test_greedy_chain_by_hand(draft: list[int], best: list[int], n_expected: int, next_expected: int) -> None:
    logits = rows_with_argmax(best)
    n, nxt = verify.greedy_accept_chain(torch.tensor(draft, dtype=torch.long), logits)
    assert (n, nxt) == (n_expected, next_expected)


def test_greedy_chain_batch_matches_single() -> None:
    best = torch.tensor([[2, 4, 1, 3], [1, 1, 1, 1], [0, 3, 2, 4]])
    drafts = torch.tensor([[2, 4, 0], [1, 1, 1], [1, 3, 2]])
    logits = torch.stack([rows_with_argmax(b.tolist()) for b in best])
    n, nxt = verify.greedy_accept_chain_batch(drafts, logits)
    assert n.tolist() == [2, 3, 0]
    assert nxt.tolist() == [1, 1, 0]
    with pytest.raises(ValueError):
        verify.greedy_accept_chain_batch(drafts, logits[:, :3])


# Tree used by the greedy cases (tokens in brackets):
#   root ─ 0[3] ─ 2[1] ─ 5[0]
#        │      └ 3[4]
#        └ 1[3] ─ 4[2] ─ 6[1] ─ 7[0]
#        └ 8[2]
PARENTS = [-1, -1, 0, 0, 1, 2, 4, 6, -1]
TOKENS = [3, 3, 1, 4, 2, 0, 1, 0, 2]


def tree_logits(best_root: int, best_after: dict[int, int], vocab: int = 5) -> torch.Tensor:
    """Rows [N+1]: row 0 root, row j+1 node j; nodes not listed get argmax 4."""
    best = [best_root] + [best_after.get(j, 4) for j in range(len(PARENTS))]
    return rows_with_argmax(best, vocab)


@pytest.mark.parametrize(
    "best_root, best_after, path_expected, next_expected",
    [
        # Both duplicate root children match; node 0's branch breaks at depth 2 (argmax 2, children 1/4 wrong)
        # while node 1's branch matches down to leaf 7 → longest path + bonus from row 7+1.
        (3, {0: 2, 1: 2, 4: 1, 6: 0, 7: 3}, [1, 4, 6, 7], 3),
        # Node 0's branch is deeper here: 0 → 2 → 5 (leaf, bonus 2); node 1's stops after 4.
        (3, {0: 1, 2: 0, 5: 2, 1: 2, 4: 3}, [0, 2, 5], 2),
        # Second child at depth 2 matches (node 3 = 4 after node 0); node 3 is a leaf → bonus.
        (3, {0: 4, 1: 0, 3: 1}, [0, 3], 1),
        # Root argmax 0 matches no root child → nothing accepted, next = root argmax.
        (0, {}, [], 0),
        # The third root child matches and is a leaf.
        (2, {8: 3}, [8], 3),
        # Root child matches but none of its children do → path of length 1, next = its argmax.
        (3, {0: 0, 1: 1}, [0], 0),
    ],
)
def test_greedy_tree_by_hand(best_root: int, best_after: dict, path_expected: list[int], next_expected: int) -> None:
    logits = tree_logits(best_root, best_after)
    path, nxt = verify.greedy_accept_tree(torch.tensor(TOKENS), torch.tensor(PARENTS), logits)
    assert path == path_expected
    assert nxt == next_expected


def test_greedy_tree_rejects_bad_parents() -> None:
    logits = rows_with_argmax([0, 0, 0])
    with pytest.raises(ValueError, match="topologically"):
        verify.greedy_accept_tree(torch.tensor([1, 2]), [1, -1], logits)
    with pytest.raises(ValueError):
        verify.greedy_accept_tree(torch.tensor([1, 2]), [-1, 0], logits[:2])


def test_sampling_with_temperature_zero_equals_greedy() -> None:
    """One-hot p (temperature 0) turns every sampling rule into greedy acceptance, whatever q is."""
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        best = torch.randint(0, 5, (10,), generator=g).tolist()
        # chain: drafts agree with the argmax for a random prefix
        k = 3
        draft = torch.tensor(best[:k])
        cut = trial % (k + 1)
        if cut < k:
            draft[cut] = (draft[cut] + 1) % 5
        logits = rows_with_argmax(best[: k + 1])
        p = verify.sampling_probs(logits, temperature=0.0)
        q = verify.sampling_probs(torch.randn(k, 5, generator=g), temperature=1.0)
        assert verify.speculative_sample_chain(draft, q, p, g) == verify.greedy_accept_chain(draft, logits)
        # tree without duplicate siblings
        parents = [-1, -1, 0, 0, 1, 2]
        tokens = torch.tensor([0, 1, 0, 1, 2, 3])
        tl = torch.randn(len(parents) + 1, 5, generator=g)
        pt = verify.sampling_probs(tl, temperature=0.0)
        qt = verify.sampling_probs(torch.randn(len(parents), 5, generator=g), temperature=1.0)
        expected = verify.greedy_accept_tree(tokens, parents, tl)
        assert verify.speculative_sample_tree(tokens, parents, qt, pt, g) == expected
        assert verify.speculative_sample_tree(tokens, parents, None, pt, g, deterministic=True) == expected


def test_sampling_is_reproducible_with_generator() -> None:
    p = verify.sampling_probs(torch.randn(4, V), 1.0)
    q = verify.sampling_probs(torch.randn(3, V), 1.0)
    draft = torch.tensor([1, 2, 3])
    out1 = [verify.speculative_sample_chain(draft, q, p, torch.Generator().manual_seed(s)) for s in range(20)]
    out2 = [verify.speculative_sample_chain(draft, q, p, torch.Generator().manual_seed(s)) for s in range(20)]
    assert out1 == out2
    assert len(set(out1)) > 1  # and it is actually random


def test_empty_drafts_and_shape_errors() -> None:
    """K = 0 / an empty tree is a plain target sample; wrong shapes raise ValueError."""
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert verify.speculative_sample_chain(torch.zeros(0, dtype=torch.long), torch.zeros(0, 4), p, g) == (0, 2)
    assert verify.speculative_sample_tree(torch.zeros(0, dtype=torch.long), [], torch.zeros(0, 4), p, g) == ([], 2)
    assert verify.greedy_accept_tree(torch.zeros(0, dtype=torch.long), [], p) == ([], 2)
    q3, p4 = torch.full((3, 4), 0.25), torch.full((4, 4), 0.25)
    with pytest.raises(ValueError):
        verify.speculative_sample_chain(torch.tensor([0, 1, 2]), q3, p4[:3], g)  # p needs K + 1 rows
    with pytest.raises(ValueError):
        verify.speculative_sample_tree(torch.tensor([0, 1, 2]), [-1, 0, 0], None, p4, g)  # q needed when sampled
    with pytest.raises(ValueError):
        verify.speculative_sample_tree(torch.tensor([0, 1, 2]), [-1, 0, 5], q3, p4, g)  # parent after child


# --------------------------------------------------------------------------------------------
# sampling_probs
# --------------------------------------------------------------------------------------------
def test_sampling_probs_temperature() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, -1.0, 5.0, 1.0]])
    greedy = verify.sampling_probs(logits, 0.0)
    assert torch.equal(greedy, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))  # first max on ties
    torch.testing.assert_close(verify.sampling_probs(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(verify.sampling_probs(logits, 2.0), torch.softmax(logits / 2, -1))
    hot, cold = verify.sampling_probs(logits, 3.0), verify.sampling_probs(logits, 0.3)
    assert (cold.max(-1).values > hot.max(-1).values).all()
    half = verify.sampling_probs(logits.half(), 0.7)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half.sum(-1), torch.ones(2))
    batched = verify.sampling_probs(torch.randn(2, 3, 7), 0.9, top_p=0.8, top_k=4)
    assert batched.shape == (2, 3, 7)
    torch.testing.assert_close(batched.sum(-1), torch.ones(2, 3))
    assert ((batched > 0).sum(-1) <= 4).all()


def test_sampling_probs_top_k_top_p() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    logits = probs.log()[[2, 0, 3, 1]]  # shuffled: ids 0..3 hold 0.2, 0.4, 0.1, 0.3

    def p_of(**kw: float) -> list[float]:
        return verify.sampling_probs(logits, 1.0, **kw).tolist()

    assert p_of(top_k=0) == pytest.approx([0.2, 0.4, 0.1, 0.3])
    assert p_of(top_k=4) == pytest.approx([0.2, 0.4, 0.1, 0.3])
    assert p_of(top_k=10) == pytest.approx([0.2, 0.4, 0.1, 0.3])
    assert p_of(top_k=2) == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7])
    assert p_of(top_k=1) == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert p_of(top_p=1.0) == pytest.approx([0.2, 0.4, 0.1, 0.3])
    assert p_of(top_p=0.35) == pytest.approx([0.0, 1.0, 0.0, 0.0])  # at least one token always kept
    assert p_of(top_p=0.65) == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7])  # 0.4 < 0.65 → need 0.3 too
    assert p_of(top_p=0.85) == pytest.approx([2 / 9, 4 / 9, 0.0, 3 / 9])
    # top-k first, then top-p on the renormalised top-k distribution (HF order):
    # top-2 → (4/7, 3/7); 4/7 ≥ 0.5 so top_p=0.5 keeps only the first. Top-p alone would keep two.
    assert p_of(top_k=2, top_p=0.5) == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert p_of(top_p=0.5) == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7])
    # temperature is applied before the filters: hot enough, the top-p set grows
    assert (verify.sampling_probs(logits, 5.0, top_p=0.65) > 0).sum() == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": -0.2}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
    ],
)
def test_sampling_probs_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        verify.sampling_probs(torch.randn(3, V), **kwargs)
    assert "\n" not in str(info.value)


def test_residual_probs() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    torch.testing.assert_close(verify.residual_probs(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    torch.testing.assert_close(verify.residual_probs(p, p), p)  # no residual mass → p itself


# --------------------------------------------------------------------------------------------
# Losslessness harness
# --------------------------------------------------------------------------------------------
def markov_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P [T, V, V] and draft Q [T, V, V]: P[t, a] = dist of the token at position t after token a.

    The target is top-p filtered (some exact zeros, differing per row), the draft top-k filtered and at a
    different temperature, so p ≠ q everywhere and both have zeros the other lacks.
    """
    g = torch.Generator().manual_seed(seed)
    p = verify.sampling_probs(torch.randn(T, V, V, generator=g, dtype=torch.float64), 0.8, top_p=0.97)
    q = verify.sampling_probs(torch.randn(T, V, V, generator=g, dtype=torch.float64), 1.3, top_k=4)
    return p.float(), q.float()


StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def decode(step: StepFn, n_tokens: int, trials: int, g: torch.Generator) -> torch.Tensor:
    """Run verification steps for ``trials`` independent sequences until each has ``n_tokens`` new tokens.

    ``step(prev [b], pos [b], g)`` → (emitted [b, L] padded with -1, count [b]); returns tokens [trials, n_tokens].
    """
    out = torch.full((trials, n_tokens), -1, dtype=torch.long)
    length = torch.zeros(trials, dtype=torch.long)
    while bool((length < n_tokens).any()):
        idx = (length < n_tokens).nonzero().squeeze(1)
        pos = length[idx]
        prev = torch.where(pos == 0, S0, out[idx, (pos - 1).clamp_min(0)])
        emitted, count = step(prev, pos, g)
        assert bool((count >= 1).all())
        for k in range(emitted.shape[1]):
            ok = (count > k) & (pos + k < n_tokens)
            out[idx[ok], pos[ok] + k] = emitted[ok, k]
        length[idx] = (pos + count).clamp(max=n_tokens)
    return out


def chain_step(P: torch.Tensor, Q: torch.Tensor, k: int, rule: Callable) -> StepFn:
    """Draft k tokens autoregressively from Q, verify against P with ``rule`` (verify's chain signature)."""

    def step(prev: torch.Tensor, pos: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ctx, drafts, q_rows, p_rows = prev, [], [], []
        for i in range(k + 1):
            p_rows.append(P[pos + i, ctx])
            if i == k:
                break
            q_rows.append(Q[pos + i, ctx])
            ctx = torch.multinomial(q_rows[-1], 1, generator=g).squeeze(1)
            drafts.append(ctx)
        draft = torch.stack(drafts, 1)
        n, nxt = rule(draft, torch.stack(q_rows, 1), torch.stack(p_rows, 1), g)
        emitted = torch.cat([draft, torch.full_like(draft[:, :1], -1)], 1)
        emitted[torch.arange(len(n)), n] = nxt
        return emitted, n + 1

    return step


def tree_step(P: torch.Tensor, Q: torch.Tensor, parents: list[int], deterministic: bool, rule: Callable) -> StepFn:
    """Draft a tree from Q — children of one node i.i.d. from Q (sampled) or Q's top-k in rank order
    (deterministic) — and verify against P with ``rule`` (verify's tree-batch signature)."""
    depth = [1 if pj < 0 else 0 for pj in parents]
    for j, pj in enumerate(parents):
        if pj >= 0:
            depth[j] = depth[pj] + 1
    children = verify.tree_children(parents)

    def step(prev: torch.Tensor, pos: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = len(prev), len(parents)
        tokens = torch.zeros(b, n, dtype=torch.long)
        q_rows = torch.zeros(b, n, V)
        p_rows = torch.zeros(b, n + 1, V)
        p_rows[:, 0] = P[pos, prev]
        for parent_row, kids in enumerate(children):  # topological: a parent's token is set before its kids
            if not kids:
                continue
            d = 0 if parent_row == 0 else depth[parent_row - 1]  # position offset of the kids
            ctx = prev if parent_row == 0 else tokens[:, parent_row - 1]
            q = Q[pos + d, ctx]  # [b, V]
            if deterministic:
                ranked = q.sort(dim=-1, descending=True, stable=True).indices
            for s, c in enumerate(kids):
                tokens[:, c] = ranked[:, s] if deterministic else torch.multinomial(q, 1, generator=g).squeeze(1)
                q_rows[:, c] = q
                p_rows[:, c + 1] = P[pos + d + 1, tokens[:, c]]
        path, n_acc, nxt = rule(tokens, parents, None if deterministic else q_rows, p_rows, g, deterministic)
        emitted = torch.full((b, path.shape[1] + 1), -1, dtype=torch.long)
        on_path = path >= 0
        emitted[:, : path.shape[1]][on_path] = tokens.gather(1, path.clamp_min(0))[on_path]
        emitted[torch.arange(b), n_acc] = nxt
        return emitted, n_acc + 1

    return step


def gof_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """χ² goodness of fit of integer ``samples`` to ``probs`` (flattened categories).

    Zero-probability categories must be empty (else p-value 0); small-expectation categories are pooled.
    """
    probs = probs.flatten().double()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * len(samples)
    big = expected >= 5
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    if bool((~big & (probs > 0)).any()):
        obs.append(float(counts[~big].sum()))
        exp.append(float(expected[~big].sum()))
    exp_total = sum(exp)
    exp = [e * sum(obs) / exp_total for e in exp]  # remove float drift so the totals match exactly
    return float(chisquare(obs, exp).pvalue)


def lossless_pvalues(tokens: torch.Tensor, P: torch.Tensor) -> dict[str, float]:
    """p-values for: t0 ~ P_0(·|S0), and every consecutive pair (t_i, t_i+1) ~ marginal(t_i) · P_i+1(·|t_i).

    With a first-order Markov target the pairs pin down the whole joint; a bonus-token bug at draft
    depth K shows up in the pair (t_K-1, t_K), so callers generate K + 1 tokens.
    """
    marginal = P[0, S0]
    out = {"t0": gof_pvalue(tokens[:, 0], marginal)}
    for i in range(tokens.shape[1] - 1):
        joint = marginal[:, None] * P[i + 1]  # [a, b] = P(t_i = a) P(t_i+1 = b | t_i = a)
        out[f"t{i},t{i + 1}"] = gof_pvalue(tokens[:, i] * V + tokens[:, i + 1], joint)
        marginal = joint.sum(0)
    return out


def assert_lossless(pvalues: dict[str, float]) -> None:
    assert min(pvalues.values()) > ALPHA, pvalues


def assert_caught(pvalues: dict[str, float]) -> None:
    assert min(pvalues.values()) < CONTROL_ALPHA, pvalues


# --------------------------------------------------------------------------------------------
# Wrong rules (negative controls), same signatures as the real ones
# --------------------------------------------------------------------------------------------
def accept_if_q_positive_chain(draft, q, p, g):
    """Wrong: accept every draft token with q(x) > 0 (i.e. all of them); bonus from p_K. Emits q, not p."""
    b, k = draft.shape
    n = (q.gather(2, draft[..., None]).squeeze(2) > 0).long().cumprod(1).sum(1)
    nxt = torch.multinomial(p[torch.arange(b), n], 1, generator=g).squeeze(1)
    return n, nxt


def resample_from_p_chain(draft, q, p, g):
    """Wrong (a classic bug): correct acceptance test, but after a rejection sample from p, not the residual."""
    b, k = draft.shape
    n, _ = verify.speculative_sample_chain_batch(draft, q, p, g)
    nxt = torch.multinomial(p[torch.arange(b), n], 1, generator=g).squeeze(1)
    return n, nxt


def stale_residual_tree(tokens, parents, q, p, g, deterministic):
    """Wrong, one-level trees only: every sibling is tested against the *original* p (no residual update
    between siblings); after all rejections sample norm(max(0, p − q)) (or p with tried children zeroed)."""
    assert all(x == -1 for x in parents)
    b, n = tokens.shape
    rows = torch.arange(b)
    p0 = p[:, 0]
    accepted = torch.full((b,), -1, dtype=torch.long)
    tried = torch.zeros_like(p0)
    for c in range(n):
        tok = tokens[:, c]
        q_c = 1.0 if deterministic else q[rows, c, tok]
        r = torch.rand(b, generator=g)
        acc = (accepted < 0) & (r * q_c < p0[rows, tok])
        accepted = torch.where(acc, c, accepted)
        tried[rows, tok] = 1.0
    fallback = p0 * (1 - tried) if deterministic else verify.residual_probs(p0, q[:, 0])
    fallback = fallback / fallback.sum(-1, keepdim=True)
    dist = torch.where((accepted >= 0)[:, None], p[rows, accepted.clamp_min(0) + 1], fallback)
    nxt = torch.multinomial(dist, 1, generator=g).squeeze(1)
    return accepted[:, None], (accepted >= 0).long(), nxt


# --------------------------------------------------------------------------------------------
# Statistical tests
# --------------------------------------------------------------------------------------------
TREE = [-1, -1, -1, 0, 0, 1, 3]  # root: 3 children; node 0: 2; node 1: 1; node 3: 1 → depth 3
FLAT = [-1, -1, -1]  # one level, three siblings (controls)


def test_tables_are_a_meaningful_fixture() -> None:
    P, Q = markov_tables(1)
    assert bool((P == 0).any()) and bool((Q == 0).any())  # filtered zeros on both sides
    assert bool(((P > 0) & (Q == 0)).any())  # target mass the draft can never propose
    assert float((P - Q).abs().sum(-1).min()) > 0.2  # and the two differ a lot everywhere


@pytest.mark.parametrize("k", [1, 3])
def test_chain_speculative_sampling_is_lossless(k: int) -> None:
    P, Q = markov_tables(1)
    g = torch.Generator().manual_seed(11 + k)
    tokens = decode(chain_step(P, Q, k, verify.speculative_sample_chain_batch), k + 1, TRIALS, g)
    assert_lossless(lossless_pvalues(tokens, P))


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "top-k"])
@pytest.mark.parametrize("parents", [TREE, FLAT], ids=["tree", "flat"])
def test_tree_speculative_sampling_is_lossless(parents: list[int], deterministic: bool) -> None:
    P, Q = markov_tables(2)
    g = torch.Generator().manual_seed(21 + int(deterministic))
    step = tree_step(P, Q, parents, deterministic, verify.speculative_sample_tree_batch)
    n_tokens = 4 if parents is TREE else 1  # depth 3 + bonus
    tokens = decode(step, n_tokens, TRIALS, g)
    assert_lossless(lossless_pvalues(tokens, P))


def test_tree_accepts_deep_paths() -> None:
    """The tree harness exercises depth: multi-token acceptances happen and follow the target."""
    P, Q = markov_tables(2)
    g = torch.Generator().manual_seed(5)
    step = tree_step(P, Q, TREE, False, verify.speculative_sample_tree_batch)
    _, count = step(torch.full((TRIALS,), S0), torch.zeros(TRIALS, dtype=torch.long), g)
    hist = torch.bincount(count, minlength=5)
    assert hist[0] == 0 and bool((hist[1:] > 0).all()), hist  # 1..4 tokens (3 accepted + bonus) all occur


@pytest.mark.parametrize("rule", [accept_if_q_positive_chain, resample_from_p_chain])
def test_negative_control_chain(rule: Callable) -> None:
    P, Q = markov_tables(1)
    g = torch.Generator().manual_seed(31)
    tokens = decode(chain_step(P, Q, 3, rule), 3, TRIALS, g)
    assert_caught(lossless_pvalues(tokens, P))


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "top-k"])
def test_negative_control_tree(deterministic: bool) -> None:
    P, Q = markov_tables(2)
    g = torch.Generator().manual_seed(41)
    tokens = decode(tree_step(P, Q, FLAT, deterministic, stale_residual_tree), 1, TRIALS, g)
    assert_caught(lossless_pvalues(tokens, P))


def test_acceptance_rate_matches_theory() -> None:
    """Single-step acceptance probability Σ_x min(p(x), q(x)) (Leviathan et al. 2023 §3: β = 1 − D_TV(p, q))."""
    P, Q = markov_tables(1)
    g = torch.Generator().manual_seed(7)
    p, q = P[0, S0], Q[0, S0]
    draft = torch.multinomial(q.expand(TRIALS, V), 1, replacement=True, generator=g)
    n, _ = verify.speculative_sample_chain_batch(draft, q.expand(TRIALS, 1, V), p.expand(TRIALS, 2, V), g)
    beta = float(torch.minimum(p, q).sum())
    rate = n.double().mean().item()
    assert abs(rate - beta) < 5 * math.sqrt(beta * (1 - beta) / TRIALS), (rate, beta)
