"""MTP modules: layout, embedding-first fusion, t_{i+1+k} alignment, frozen shared head, chain, native weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from models.core.target import FrozenTarget
from models.methods.mtp.config import MTPConfig
from models.methods.mtp.native import init_from_native, to_native_state_dict
from models.methods.mtp.net import MTPDrafter
from models.methods.mtp.proposers import propose_chain
from tests.conftest import make_tiny_llama

V, H = 48, 32


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return FrozenTarget(make_tiny_llama(V, layers=2, hidden=H, seed=1))


def _drafter(target: FrozenTarget, D: int = 2, seed: int = 0) -> MTPDrafter:
    torch.manual_seed(seed)
    return MTPDrafter.from_target(MTPConfig(num_modules=D), target)


def _batch(target: FrozenTarget, B: int = 2, T: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    out = target(ids, layer_ids=[2])
    return ids, {2: out.hidden[2]}, out.logits


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_layout_and_shared_weights(target):
    dr = _drafter(target)
    assert dr.layer_ids == [2]  # h^0 = the target's last hidden state after the final norm
    sd = dr.state_dict()
    assert all(k.startswith("mtp.") for k in sd)
    for d in range(2):
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "block.self_attn.q_proj.weight",
                     "block.mlp.down_proj.weight", "block.input_layernorm.weight"):
            assert f"mtp.{d}.{name}" in sd
    assert sd["mtp.0.eh_proj.weight"].shape == (H, 2 * H)
    assert not any("embed" in k or "lm_head" in k or "head.weight" in k for k in sd)
    assert dr.embed_weight.data_ptr() == target.embed.weight.data_ptr()  # borrowed, not copied
    assert dr.lm_head_weight.data_ptr() == target.model.lm_head.weight.data_ptr()
    frozen = {id(target.embed.weight), id(target.model.lm_head.weight)}
    assert not any(id(p) in frozen for p in dr.parameters())
    cd = dr.config_dict()
    assert cd["method"] == "mtp" and cd["num_modules"] == 2 and cd["block_intermediate_size"] == 2 * H


def test_concat_order_embedding_first(target):
    dr = _drafter(target, D=1)
    mod = dr.mtp[0]
    e, h = torch.randn(2, 5, H), torch.randn(2, 5, H)
    with torch.no_grad():
        mod.enorm.weight.fill_(2.0)
        mod.hnorm.weight.fill_(3.0)
        mod.eh_proj.weight.zero_()
        mod.eh_proj.weight[:, :H] = torch.eye(H)  # reads the first H inputs only
    torch.testing.assert_close(mod.fuse(e, h), 2.0 * _rms(e))
    with torch.no_grad():
        mod.eh_proj.weight.zero_()
        mod.eh_proj.weight[:, H:] = torch.eye(H)  # reads the last H inputs only
    torch.testing.assert_close(mod.fuse(e, h), 3.0 * _rms(h))


@pytest.mark.parametrize("between", ["post_norm", "pre_norm"])
def test_training_inputs_are_emb_of_t_i_plus_k_and_previous_hidden(target, between):
    dr = _drafter(target, D=2)
    dr.cfg.hidden_between_depths = between
    with torch.no_grad():  # a non-unit gain, so shared_head.norm(h) and h normalise to different inputs
        dr.mtp[0].shared_head.norm.weight.copy_(1 + torch.rand(H))
    ids, hidden, logits = _batch(target, T=10)
    seen: dict[str, torch.Tensor] = {}
    hooks = [dr.mtp[d].eh_proj.register_forward_hook(lambda m, i, o, d=d: seen.__setitem__(f"in{d}", i[0]))
             for d in range(2)]
    hooks.append(dr.mtp[0].register_forward_hook(lambda m, i, o: seen.__setitem__("out0", o)))
    per_depth = dr(ids, hidden[2])
    for hk in hooks:
        hk.remove()
    assert [x.shape for x in per_depth] == [(2, 9, V), (2, 8, V)]
    emb = F.embedding(ids, target.embed.weight)
    m0, m1 = dr.mtp
    # depth 1, position i: [enorm(emb(t_{i+1})), hnorm(h_i)]
    torch.testing.assert_close(seen["in0"][..., :H], m0.enorm(emb[:, 1:]))
    torch.testing.assert_close(seen["in0"][..., H:], m0.hnorm(hidden[2][:, :9]))
    # depth 2, position i: [enorm(emb(t_{i+2})), hnorm(h^1_i)], h^1 after shared_head.norm as the engines feed it
    torch.testing.assert_close(seen["in1"][..., :H], m1.enorm(emb[:, 2:]))
    h1 = seen["out0"][:, :8]
    h1 = m0.shared_head.norm(h1) if between == "post_norm" else h1
    torch.testing.assert_close(seen["in1"][..., H:], m1.hnorm(h1))


def _crafted(jump: int = 1, D: int = 2, distill: bool = True):
    """Identity blocks + orthonormal embeddings: depth k at i copies t_{i+k}, the head maps u → u + jump."""
    v, h, T = 16, 32, 12
    q, _ = torch.linalg.qr(torch.randn(h, v, generator=torch.Generator().manual_seed(0)))
    emb = q.T.contiguous()  # [v, h] orthonormal rows
    lm = 4.0 * emb[(torch.arange(v) - jump) % v]  # logits[w] ∝ <emb[w - jump], x>: peak at u + jump
    tc = LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    dr = MTPDrafter(MTPConfig(num_modules=D, distill=distill), tc, emb, lm)
    with torch.no_grad():
        for mod in dr.mtp:
            mod.eh_proj.weight.zero_()
            mod.eh_proj.weight[:, :h] = torch.eye(h)  # x = enorm(emb(t_{i+k}))
            mod.block.self_attn.o_proj.weight.zero_()  # block = identity (residual only)
            mod.block.mlp.down_proj.weight.zero_()
    seq = (torch.arange(T) + 3) % v  # t_{j+1} = t_j + 1, all distinct
    tl = torch.zeros(1, T, v)
    for t in range(T - 1):
        tl[0, t, seq[t + 1]] = 20.0  # the target predicts the sequence exactly
    return dr, seq[None], {2: torch.randn(1, T, h)}, tl


@pytest.mark.parametrize("distill", [True, False])
def test_depth_k_predicts_token_i_plus_1_plus_k(distill):
    dr, ids, hidden, tl = _crafted(jump=1, distill=distill)
    loss, m = dr.training_loss(ids, torch.ones_like(ids), hidden, tl)
    assert m["acc_0"] == 1.0 and m["acc_1"] == 1.0
    assert m["loss_0"] < 1e-3 and m["loss_1"] < 1e-3
    assert m["sim_tau"] == pytest.approx(3.0)
    # a drafter one token ahead of the label (predicting t_{i+2+k}) scores zero
    dr, ids, hidden, tl = _crafted(jump=2, distill=distill)
    _, m = dr.training_loss(ids, torch.ones_like(ids), hidden, tl)
    assert m["acc_0"] == 0.0 and m["acc_1"] == 0.0


def test_loss_mask_is_the_predicted_tokens():
    dr, ids, hidden, tl = _crafted()
    tl[0, 5] = 0.0
    tl[0, 5, 0] = 20.0  # corrupt the target's distribution for token 6
    mask = torch.ones_like(ids)
    _, m = dr.training_loss(ids, mask, hidden, tl)
    assert m["acc_0"] < 1.0 and m["acc_1"] < 1.0
    mask[0, 6] = 0
    _, m = dr.training_loss(ids, mask, hidden, tl)
    assert m["acc_0"] == 1.0 and m["acc_1"] == 1.0


def test_loss_matches_a_reference_loop(target):
    dr = _drafter(target, D=2)
    dr.cfg.step_weight = 0.5
    ids, hidden, logits = _batch(target, T=9, seed=2)
    mask = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) > 0.3).long()
    loss, m = dr.training_loss(ids, mask, hidden, logits)
    with torch.no_grad():
        per_depth = dr(ids, hidden[2])
    total = 0.0
    for d, lk in enumerate(per_depth):
        k = d + 1
        ces, hits = [], []
        for b in range(ids.shape[0]):
            for i in range(ids.shape[1]):
                if i + 1 + k >= ids.shape[1] or not mask[b, i + 1 + k]:
                    continue
                p = F.softmax(logits[b, i + k], -1)  # the target's distribution for token i+1+k
                ces.append(float(-(p * F.log_softmax(lk[b, i], -1)).sum()))
                hits.append(float(lk[b, i].argmax() == logits[b, i + k].argmax()))
        assert m[f"loss_{d}"] == pytest.approx(sum(ces) / len(ces), rel=1e-5)
        assert m[f"acc_{d}"] == pytest.approx(sum(hits) / len(hits))
        total += 0.5**d * sum(ces) / len(ces)
    assert loss.item() == pytest.approx(total, rel=1e-5)


def test_shared_head_and_embedding_get_no_gradient(target):
    dr = _drafter(target, D=2)
    ids, hidden, logits = _batch(target)
    loss, _ = dr.training_loss(ids, torch.ones_like(ids), hidden, logits)
    loss.backward()
    for w in (target.model.lm_head.weight, target.embed.weight):
        assert w.grad is None and not w.requires_grad
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in dr.parameters())
    assert set(dr.state_dict()) == {n for n, _ in dr.named_parameters()}  # trainable weights only


def test_chain_matches_teacher_forcing_and_reuses_the_last_module(target):
    dr = _drafter(target, D=2)
    n = 8
    ids = torch.randint(0, V, (2, n + 1), generator=torch.Generator().manual_seed(4))
    h = target(ids[:, :n], layer_ids=[2]).hidden[2]  # [2, n, H] for x_0..x_{n-1}; x_n = the target's token
    calls = [0, 0]
    hooks = [dr.mtp[d].register_forward_hook(lambda *a, d=d: calls.__setitem__(d, calls[d] + 1)) for d in range(2)]
    drafts = propose_chain(dr, ids, h, num_speculative_tokens=4)
    for hk in hooks:
        hk.remove()
    assert drafts.shape == (2, 4)
    assert calls == [1, 3]  # depth 3 and 4 reuse module 2
    # the same chain as a 4-module drafter whose modules 3, 4 are copies of module 2, run teacher-forced
    dr4 = _drafter(target, D=4, seed=9)
    sd = dr.state_dict()
    for d in (2, 3):
        sd |= {k.replace("mtp.1.", f"mtp.{d}.", 1): v for k, v in dr.state_dict().items() if k.startswith("mtp.1.")}
    dr4.load_state_dict(sd)
    ext = torch.cat([ids, drafts[:, :3]], dim=1)  # x_0..x_n, x_{n+1}..x_{n+3}
    hid = torch.cat([h, torch.zeros(2, 4, H)], dim=1)  # positions ≥ n are causally after what we read
    with torch.no_grad():
        per_depth = dr4(ext, hid)
    for d in range(4):  # depth d+1 at position n-1 drafts token n+1+d
        assert torch.equal(per_depth[d][:, n - 1].argmax(-1), drafts[:, d])
    assert torch.equal(propose_chain(dr4, ids, h, num_speculative_tokens=4), drafts)
    with pytest.raises(ValueError, match="hidden covers"):
        propose_chain(dr, ids, h[:, :-1], num_speculative_tokens=2)


def test_native_round_trip_and_refusals(target):
    dr = _drafter(target, D=2)
    sd = to_native_state_dict(dr)
    for key in ("model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.3.eh_proj.weight",
                "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.q_proj.weight",
                "model.layers.3.mlp.gate_proj.weight", "model.layers.3.post_attention_layernorm.weight",
                "model.layers.2.embed_tokens.weight", "model.layers.3.shared_head.head.weight"):
        assert key in sd
    assert not any("block." in k or k.startswith("mtp.") for k in sd)
    fresh = _drafter(target, D=2, seed=7)
    assert not torch.equal(fresh.state_dict()["mtp.0.eh_proj.weight"], dr.state_dict()["mtp.0.eh_proj.weight"])
    init_from_native(fresh, {**target.model.state_dict(), **sd})  # a whole checkpoint: main-model keys ignored
    for k, v in dr.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    init_from_native(_drafter(target, D=2), to_native_state_dict(dr, include_shared=False))

    def refused(bad: dict, match: str, D: int = 2):
        with pytest.raises(ValueError, match=match) as e:
            init_from_native(_drafter(target, D=D), bad)
        assert "\n" not in str(e.value)

    refused({k: v for k, v in sd.items() if k != "model.layers.3.hnorm.weight"}, "missing")
    refused({**sd, "model.layers.2.self_attn.q_norm.weight": torch.ones(8)}, "unexpected")
    refused(sd, "unexpected", D=1)  # the checkpoint has 2 MTP layers
    refused({**sd, "model.layers.2.eh_proj.weight": torch.zeros(H, H)}, "shapes")
    refused({**sd, "model.layers.3.embed_tokens.weight": torch.zeros(V, H)}, "differs")


def test_config_errors():
    with pytest.raises(ValueError, match="num_modules"):
        MTPConfig(num_modules=0)


def test_overfit_fixed_batch(target):
    dr = _drafter(target, D=2)
    ids, hidden, logits = _batch(target, B=2, T=24, seed=5)
    mask = torch.ones_like(ids)
    opt = torch.optim.Adam(dr.parameters(), lr=1e-2)
    _, m0 = dr.training_loss(ids, mask, hidden, logits)
    for _ in range(150):
        loss, _ = dr.training_loss(ids, mask, hidden, logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, m = dr.training_loss(ids, mask, hidden, logits)
    assert m0["acc_0"] < 0.5 and m["acc_0"] >= 0.9 and m["loss_0"] < m0["loss_0"]


def _family_targets():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4)
    yield "qwen3", Qwen3ForCausalLM(Qwen3Config(**common, num_key_value_heads=2, head_dim=8)), "self_attn.q_norm.weight"
    ds = DeepseekV3Config(**common, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                          num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                          q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                          num_nextn_predict_layers=1)
    yield "deepseek_v3", DeepseekV3ForCausalLM(ds), "mlp.experts.gate_up_proj"


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_block_follows_the_target_family(family):
    """from_target builds the target's own decoder block (Qwen3 q/k norms; DeepSeek-V3 MLA + MoE at layer L)."""
    torch.manual_seed(0)
    _, model, key = next(f for f in _family_targets() if f[0] == family)
    t = FrozenTarget(model.eval())
    dr = MTPDrafter.from_target(MTPConfig(num_modules=1), t)
    assert type(dr.mtp[0].block) is type(t.layers[0])
    ids = torch.randint(0, V, (2, 10))
    out = t(ids, layer_ids=[2])
    loss, _ = dr.training_loss(ids, torch.ones_like(ids), out.hidden, out.logits)
    assert torch.isfinite(loss)
    assert propose_chain(dr, ids, out.hidden[2][:, :9], num_speculative_tokens=3).shape == (2, 3)
    sd = to_native_state_dict(dr)
    assert f"model.layers.2.{key}" in sd
    layer_types = getattr(t.model.config, "layer_types", None)
    assert layer_types is None or len(layer_types) == 2  # the target's config is not mutated
    fresh = MTPDrafter.from_target(MTPConfig(num_modules=1), t)
    init_from_native(fresh, sd)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in dr.state_dict().items())


@pytest.mark.parametrize("between", ["post_norm", "pre_norm"])
def test_hidden_between_depths_cached_proposer_equals_reference(target, between):
    """Depth >= 2 reads shared_head.norm(h) (vLLM/SGLang) or h: the KV-cached proposer follows either exactly, and
    the option really changes the chain (non-unit norm gains, O(1) weights)."""
    from models.core.proposal import Sampling
    from models.methods.mtp.proposers import MTPProposer

    torch.manual_seed(4)
    drs = {}
    for mode in ("post_norm", "pre_norm"):
        torch.manual_seed(4)
        d = MTPDrafter.from_target(MTPConfig(num_modules=2, hidden_between_depths=mode), target).eval()
        with torch.no_grad():
            for n, p in d.named_parameters():
                p.copy_(1 + torch.rand_like(p)) if "norm" in n else p.normal_(0, 2 / p.shape[-1] ** 0.5)
        drs[mode] = d
    dr, L = drs[between], target.num_layers
    ctx = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(5))
    h = target(ctx, layer_ids=[L]).hidden[L]
    prop = MTPProposer(dr, num_speculative_tokens=4)
    prop.begin(ctx[:, :8], {L: h[:, :7]}, Sampling())
    assert torch.equal(prop.propose(4).tokens, propose_chain(dr, ctx[:, :8], h[:, :7], 4)[0])
    prop.accept(ctx[:, 8:11], {L: h[:, 7:10]})
    assert torch.equal(prop.propose(3).tokens, propose_chain(dr, ctx[:, :11], h[:, :10], 3)[0])
    # teacher-forced depth 2 differs between the two options (depth 1 is the same module on the same input)
    a, b = drs["post_norm"](ctx, h), drs["pre_norm"](ctx, h)
    torch.testing.assert_close(a[0], b[0])
    assert (a[1] - b[1]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="hidden_between_depths must be one of"):
        MTPConfig(hidden_between_depths="post")


def test_checkpoint_without_the_option_loads_as_pre_norm(target, tmp_path):
    """Checkpoints written before hidden_between_depths chained the pre-norm state: they keep doing so."""
    from models.registry import load_drafter
    from train.checkpoint import save_drafter

    d = MTPDrafter.from_target(MTPConfig(num_modules=2), target)
    meta = {"method": "mtp", "target": target.identity(), "draft": d.config_dict()}
    save_drafter(tmp_path / "new", d, meta)
    assert load_drafter(tmp_path / "new", target)[0].cfg.hidden_between_depths == "post_norm"
    old = {**meta, "draft": {k: v for k, v in meta["draft"].items() if k != "hidden_between_depths"}}
    save_drafter(tmp_path / "old", d, old)
    assert load_drafter(tmp_path / "old", target)[0].cfg.hidden_between_depths == "pre_norm"
