"""Medusa heads: layout, t+2+k alignment, loss, static tree, proposal, overfit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from models.core.target import FrozenTarget
from models.core.tree import tree_capacity
from models.methods.medusa.config import MedusaConfig
from models.methods.medusa.net import MedusaHeads, head_topk_accuracy, head_topk_hits, propose
from models.methods.medusa.tree import build_medusa_tree, load_static_tree, rank_accuracy, tree_buffers, tree_tokens
from tests.conftest import make_tiny_llama


def _cfg(vocab: int, hidden: int, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return FrozenTarget(make_tiny_llama(48, layers=2, hidden=32, seed=1))


def _run_target(target: FrozenTarget, B: int = 2, T: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (B, T), generator=g)
    out = target(ids, layer_ids=[target.num_layers])
    return ids, out.hidden[target.num_layers], out.logits


def test_parameter_layout_and_shapes():
    tc = _cfg(40, 32)
    w = torch.randn(40, 32)
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=2), tc, w)
    assert heads.layer_ids == [2]  # the last hidden state after the final norm
    sd = heads.state_dict()
    expect = set()
    for h in range(3):
        for lyr in range(2):
            expect |= {f"heads.{h}.{lyr}.linear.weight", f"heads.{h}.{lyr}.linear.bias"}
        expect.add(f"heads.{h}.2.weight")
    assert set(sd) == expect
    assert sd["heads.1.0.linear.weight"].shape == (32, 32) and sd["heads.1.2.weight"].shape == (40, 32)
    assert torch.count_nonzero(sd["heads.0.1.linear.weight"]) == 0  # zero-initialised W
    assert torch.equal(sd["heads.2.2.weight"], w)  # output layer starts as the target's lm_head
    assert heads(torch.randn(2, 5, 32)).shape == (2, 5, 3, 40)
    fd = heads.to_fasterdecoding_state_dict()
    assert set(fd) == {k.removeprefix("heads.") for k in expect}
    assert torch.equal(fd["1.0.linear.bias"], sd["heads.1.0.linear.bias"])
    assert heads.config_dict()["method"] == "medusa" and heads.config_dict()["num_heads"] == 3


def test_zero_init_head_is_the_target_lm_head(target):
    """W = 0 → head k = lm_head(h + SiLU(b)); with b = 0 too, exactly the target's logits on id L."""
    _, h, logits = _run_target(target)
    lm = target.model.lm_head.weight
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1), target.model.config, lm)
    got = heads(h)  # [B, T, K, V]
    for k in range(3):
        b = heads.heads[k][0].linear.bias
        torch.testing.assert_close(got[:, :, k], logits + F.silu(b) @ lm.T, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for k in range(3):
            heads.heads[k][0].linear.bias.zero_()
    got = heads(h)
    for k in range(3):
        torch.testing.assert_close(got[:, :, k], logits, atol=1e-5, rtol=1e-5)


SEQ = [3, 7, 1, 12, 5, 9, 0, 14, 2, 11, 6, 15]  # distinct tokens: an off-by-one can never score


def _crafted(shift: int, K: int = 3, distill: bool = True):
    """Heads that read position t from a one-hot hidden state and emit 20·onehot(SEQ[t + shift + k])."""
    T, V, H = len(SEQ), 16, 12
    heads = MedusaHeads(MedusaConfig(num_heads=K, num_layers=0, distill=distill), _cfg(V, H), torch.zeros(V, H))
    with torch.no_grad():
        for k in range(K):
            w = heads.heads[k][0].weight
            w.zero_()
            for t in range(T):
                if t + shift + k < T:
                    w[SEQ[t + shift + k], t] = 20.0
    ids = torch.tensor([SEQ])
    hidden = {2: torch.eye(T, H)[None]}  # h_t = onehot(t)
    tl = torch.zeros(1, T, V)
    for t in range(T - 1):
        tl[0, t, SEQ[t + 1]] = 20.0  # the target predicts the sequence exactly
    return heads, ids, hidden, tl


@pytest.mark.parametrize("distill", [True, False])
def test_head_k_predicts_token_t_plus_2_plus_k(distill):
    heads, ids, hidden, tl = _crafted(shift=2, distill=distill)
    loss, m = heads.training_loss(ids, torch.ones_like(ids), hidden, tl)
    for k in range(3):
        assert m[f"acc_{k}"] == 1.0
        assert m[f"loss_{k}"] < 1e-4
    assert m["sim_tau"] == pytest.approx(4.0)
    assert loss.item() < 1e-3
    # heads that predict t+1+k (the classic off-by-one) score zero
    heads, ids, hidden, tl = _crafted(shift=1, distill=distill)
    _, m = heads.training_loss(ids, torch.ones_like(ids), hidden, tl)
    assert all(m[f"acc_{k}"] == 0.0 for k in range(3))
    assert m[f"loss_{0}"] > 10


def test_loss_mask_is_the_predicted_tokens():
    heads, ids, hidden, tl = _crafted(shift=2)
    tl[0, 4] = 0.0
    tl[0, 4, SEQ[0]] = 20.0  # corrupt the target's distribution for token 5
    mask = torch.ones_like(ids)
    _, m = heads.training_loss(ids, mask, hidden, tl)
    assert m["acc_0"] < 1.0 and m["acc_2"] < 1.0  # token 5 = t+2 (t=3) and t+4 (t=1)
    mask[0, 5] = 0  # token 5 is not a training target → every head ignores it
    _, m = heads.training_loss(ids, mask, hidden, tl)
    assert all(m[f"acc_{k}"] == 1.0 for k in range(3))


def test_loss_matches_a_reference_loop():
    torch.manual_seed(0)
    B, T, V, H, K = 2, 9, 20, 16, 3
    heads = MedusaHeads(MedusaConfig(num_heads=K, num_layers=1, step_weight=0.5, metric_top_k=3), _cfg(V, H),
                        torch.randn(V, H))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    ids = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.3).long()
    hidden = {2: torch.randn(B, T, H)}
    tl = torch.randn(B, T, V) * 2
    loss, m = heads.training_loss(ids, mask, hidden, tl)
    logits = heads(hidden[2]).detach()
    total = 0.0
    for k in range(K):
        ces, hits, top3 = [], [], []
        for b in range(B):
            for t in range(T):
                if t + 2 + k >= T or not mask[b, t + 2 + k]:
                    continue
                p = F.softmax(tl[b, t + 1 + k], -1)
                q = F.log_softmax(logits[b, t, k], -1)
                ces.append(float(-(p * q).sum()))
                hits.append(float(logits[b, t, k].argmax() == tl[b, t + 1 + k].argmax()))
                top3.append(float(tl[b, t + 1 + k].argmax() in logits[b, t, k].topk(3).indices))
        ref = sum(ces) / len(ces)
        assert m[f"loss_{k}"] == pytest.approx(ref, rel=1e-5)
        assert m[f"acc_{k}"] == pytest.approx(sum(hits) / len(hits))
        assert m[f"top3_{k}"] == pytest.approx(sum(top3) / len(top3))
        assert m[f"top1_{k}"] == m[f"acc_{k}"]
        total += 0.5**k * ref
    assert loss.item() == pytest.approx(total, rel=1e-5)


def test_shared_lm_head_is_frozen_and_not_saved(target):
    ids, h, logits = _run_target(target)
    lm = target.model.lm_head.weight
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, share_lm_head=True), target.model.config, lm)
    assert heads.shared_lm_head.data_ptr() == lm.data_ptr()  # borrowed, not copied
    assert all(p is not lm for p in heads.parameters())
    assert set(heads.state_dict()) == {f"heads.{k}.0.linear.{n}" for k in range(2) for n in ("weight", "bias")}
    x = torch.randn(3, 32)
    ref = torch.stack([heads.heads[k](x) @ lm.T for k in range(2)], dim=-2)
    torch.testing.assert_close(heads(x), ref)
    loss, _ = heads.training_loss(ids, torch.ones_like(ids), {2: h}, logits)
    loss.backward()
    assert lm.grad is None and not lm.requires_grad
    assert all(p.grad is not None for p in heads.parameters())
    fd = heads.to_fasterdecoding_state_dict()
    assert torch.equal(fd["1.1.weight"], lm)  # export writes the shared head per head


def test_build_tree_on_toy_table():
    acc = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.3, 0.05]])
    # path scores: (0,).9 (0,0).72 (1,).5 (1,0).4 (0,1).27 (1,1).15 (2,).1 …
    assert build_medusa_tree(acc, 5) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert build_medusa_tree(acc, 6) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    acc3 = torch.tensor([[0.9, 0.2]] * 3)
    # (0,).9 (0,0).81 (0,0,0).729 (1,).2 then (0,1)=(1,0)=.18
    assert build_medusa_tree(acc3, 4) == [(0,), (1,), (0, 0), (0, 0, 0)]
    full = build_medusa_tree(acc3, tree_capacity(3, 2))
    assert len(full) == 14 == len(set(full)) and max(len(p) for p in full) == 3


@pytest.mark.parametrize("n", [0, -1, 15])
def test_tree_size_errors(n):
    with pytest.raises(ValueError, match="out of range") as e:
        build_medusa_tree(torch.full((3, 2), 0.5), n)
    assert "\n" not in str(e.value)


def test_tree_buffers():
    buf = tree_buffers([(1, 0), (0,), (0, 1), (1,), (0, 0)])
    assert buf.choices == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert buf.parent.tolist() == [-1, -1, 0, 0, 1]
    assert buf.depth.tolist() == [1, 1, 2, 2, 2]
    assert buf.head.tolist() == [0, 0, 1, 1, 1]
    assert buf.rank.tolist() == [0, 1, 0, 1, 0]
    assert buf.attn_mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [0, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [0, 1, 0, 0, 1],
    ]
    assert buf.leaf_paths.tolist() == [[0, 2], [0, 3], [1, 4]]
    cand = torch.tensor([[[10, 11], [20, 21]]])  # [B=1, K=2, top_k=2]
    assert tree_tokens(buf, cand).tolist() == [[10, 11, 20, 21, 20]]
    with pytest.raises(ValueError, match="no parent"):
        tree_buffers([(0,), (1, 0)])
    with pytest.raises(ValueError, match="duplicates"):
        tree_buffers([(0,), (0,)])


def test_propose_ranks_the_heads_logits(target):
    _, h, logits = _run_target(target)
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1), target.model.config, target.model.lm_head.weight)
    with torch.no_grad():
        for k in range(3):
            heads.heads[k][0].linear.bias.zero_()
    cand = propose(heads, h[:, -1], top_k=4)
    assert cand.shape == (2, 3, 4)
    for k in range(3):  # identity heads: rank 0 is the target's own argmax at the last position
        assert torch.equal(cand[:, k, 0], logits[:, -1].argmax(-1))
    assert torch.equal(cand[:, :, :2], heads(h[:, -1]).topk(2, -1).indices)


def test_head_topk_accuracy():
    heads, ids, hidden, tl = _crafted(shift=2)
    hits, total = head_topk_hits(heads, torch.ones_like(ids), hidden[2], tl, top_k=3)
    assert total.tolist() == [10, 9, 8]
    assert hits[:, 0].tolist() == total.tolist() and hits[:, 1:].sum() == 0


def test_head_topk_accuracy_on_a_target(target):
    heads = MedusaHeads(MedusaConfig(num_heads=3), target.model.config, target.model.lm_head.weight)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 48, (2, 10), generator=g), torch.ones(2, 10, dtype=torch.long)) for _ in range(2)]
    acc = head_topk_accuracy(heads, target, batches, top_k=4)
    assert acc.shape == (3, 4)
    assert (acc >= 0).all() and (acc.sum(1) <= 1 + 1e-6).all()  # ranks are distinct: one can hit per position
    ref_hits, ref_total = 0, 0
    for ids, mask in batches:
        out = target(ids, layer_ids=[2])
        h, t = head_topk_hits(heads, mask, out.hidden[2], out.logits, 4)
        ref_hits, ref_total = ref_hits + h, ref_total + t
    torch.testing.assert_close(acc, (ref_hits / ref_total[:, None]).float())


def test_static_tree_from_training_metrics(target, tmp_path):
    """The tree saved with a checkpoint comes from the loss's top{j}_{k} metrics, which must equal the
    per-rank accuracies head_topk_accuracy measures directly; eval can rebuild it at another size."""
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=3, metric_top_k=4, tree_nodes=7), target.model.config,
                        target.model.lm_head.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))  # break the identity heads: every rank gets some hits
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 48, (4, 16), generator=g)
    mask = torch.ones_like(ids)
    out = target(ids, layer_ids=[2])
    _, metrics = heads.training_loss(ids, mask, out.hidden, out.logits)
    acc = rank_accuracy(metrics, 3, 4)
    direct = head_topk_accuracy(heads, target, [(ids, mask)], top_k=4)
    torch.testing.assert_close(acc, direct.double(), atol=1e-6, rtol=0)
    path = heads.save_static_tree(tmp_path, metrics)
    assert path is not None and path.name == "medusa_choices.json"
    assert load_static_tree(tmp_path) == build_medusa_tree(acc, 7)
    assert load_static_tree(tmp_path, num_nodes=12) == build_medusa_tree(acc, 12)
    assert load_static_tree(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="metric_top_k >= 5"):
        rank_accuracy(metrics, 3, 5)
    no_ranks = MedusaHeads(MedusaConfig(num_heads=3), target.model.config, target.model.lm_head.weight)
    assert no_ranks.save_static_tree(tmp_path / "x", metrics) is None


def test_tree_sizing_trades_expected_tau_against_verify_cost():
    from models.core.tree import expected_tree_tau
    from models.methods.medusa.tree import size_tree

    acc = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.3, 0.05]])
    # (0,) .9  (0,0) .72  (1,) .5 → 1 + .9 + .72 + .5
    assert expected_tree_tau(acc, [(0,), (0, 0), (1,)]) == pytest.approx(3.12)
    n, pred = size_tree(acc, lambda n: 1.0, 15)  # free verification: the whole capacity (12 nodes) pays
    assert n == 12 and sorted(pred) == list(range(1, 13))
    n, pred = size_tree(acc, lambda n: 1.0 + 0.3 * n, 12)  # steep verify cost: a small tree wins
    assert pred[n] == max(pred.values()) and n <= 3
    assert pred[2] == pytest.approx((1 + 0.9 + 0.72) / 1.6)


def test_config_errors():
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(num_heads=0)
    with pytest.raises(ValueError, match="num_layers"):
        MedusaConfig(num_layers=-1)
    with pytest.raises(ValueError, match="tree_nodes=41: 3 heads x top-3 address 1..39") as e:
        MedusaConfig(num_heads=3, metric_top_k=3, tree_nodes=41)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="lm_head weight has shape"):
        MedusaHeads(MedusaConfig(), _cfg(40, 32), torch.zeros(32, 40))


def test_overfit_fixed_batch(target):
    torch.manual_seed(0)
    ids, h, logits = _run_target(target, B=2, T=24, seed=5)
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1), target.model.config, target.model.lm_head.weight)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    mask = torch.ones_like(ids)
    _, m0 = heads.training_loss(ids, mask, {2: h}, logits)
    for _ in range(300):
        loss, _ = heads.training_loss(ids, mask, {2: h}, logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, m = heads.training_loss(ids, mask, {2: h}, logits)
    assert m["acc_0"] >= 0.9 and m["loss_0"] < m0["loss_0"] and m0["acc_0"] < 0.5
