"""DSpark on the DFlash backbone (models/methods/dflash: heads.py, ``block_head``): the Markov head's decode
step equals its teacher-forced training form, the anchor-slot block convention (B drafts, labels a+j+1), lossless
greedy and sampled (χ²) decoding with the head feeding each drafted token into the next slot, the confidence-
scheduled K, a warm start from a DFlash checkpoint, a second head as one small module (a test-only toy GRU), and
``+recipe=dspark`` through the training loop."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from eval.decode.batch import speculative_decode_batch
from eval.decode.single import decode_ar, speculative_decode
from models import registry
from models.core.proposal import Sampling
from models.core.target import FrozenTarget
from models.methods.dflash import build
from models.methods.dflash import heads as block_heads
from models.methods.dflash.config import DFlashConfig
from models.methods.dflash.net import DFlashDrafter
from models.methods.dflash.proposers import DFlashProposer
from tests.conftest import make_tiny_llama
from tests.test_batch_proposers import assert_batched_rows_follow_target
from tests.test_decode import batched, chi2_pvalue, exact_joint, sharp_tiny_llama
from tests.test_dflash import scramble
from train.loop import run

CONF = Path(__file__).resolve().parent.parent / "conf"
V = 64
DSPARK = {"block_head": "markov", "sample_from_anchor": True, "markov_rank": 8, "ce_weight": 0.1, "tv_weight": 0.9}


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(make_tiny_llama(V, layers=4, hidden=32, seed=2))


def drafter(target, **kw) -> DFlashDrafter:
    cfg = DFlashConfig(**{"layer_ids": [1, 2, 3], "num_layers": 2, "block_size": 4, "mask_token_id": V - 1,
                          "num_anchors": 6, **DSPARK, **kw})
    rows = [{"input_ids": list(range(V - 1)), "loss_mask": [1] * (V - 1)}]
    return scramble(build(cfg, target, rows))


def test_markov_step_equals_teacher_forced_block_logits_and_starts_neutral(target):
    d = drafter(target)
    head = d.block_head
    z, h = torch.randn(2, 3, 4, d.draft_vocab_size), torch.randn(2, 3, 4, 32)
    prev = torch.randint(0, V, (2, 3, 4))
    fresh = block_heads.MarkovHead(d.cfg, 32, V, d.draft_vocab_size)
    torch.testing.assert_close(fresh.block_logits(z, h, prev)[0], z)  # W2 = 0: drafts start as the backbone's
    logits, conf = head.block_logits(z, h, prev)
    for s in range(4):
        ls, cs, _ = head.step(z[:, :, s], h[:, :, s], prev[:, :, s], head.init_state((2, 3)))
        torch.testing.assert_close(ls, logits[:, :, s])
        torch.testing.assert_close(cs, conf[:, :, s])
    names = {k for k in d.state_dict() if k.startswith("block_head.")}
    assert names == {"block_head.markov_head.markov_w1.weight", "block_head.markov_head.markov_w2.weight",
                     "block_head.confidence_head.proj.weight", "block_head.confidence_head.proj.bias"}
    assert tuple(head.confidence_head.proj.weight.shape) == (1, 32 + 8)


def test_anchor_slot_drafts_b_tokens_labelled_a_plus_j_plus_1(target, monkeypatch):
    """sample_from_anchor: draft j is block slot j (the anchor's own row for j = 0) and predicts token a+j+1; its
    head conditions on token a+j (the anchor for j = 0); B drafts per block."""
    d = drafter(target, label_path="data")
    assert d.num_spec == 4 and d.slot_offset == 0 and d.slot_weights().shape == (4,)
    t = 9
    logits = torch.full((1, t, V), -10.0)
    for pos in range(t):
        logits[0, pos, 10 + pos] = 10.0  # the target's token at pos+1 is 10+pos
    monkeypatch.setattr(d, "sample_anchors", lambda m: (torch.tensor([[2]]), torch.tensor([[True]])))
    seen = {}
    real_blocks = d.blocks

    def spy_blocks(*a, **k):
        seen["blocks"] = real_blocks(*a, **k)
        return seen["blocks"]

    def spy(out, teacher, valid, prev=None):
        seen.update(out=out, label=teacher.argmax(-1), valid=valid, prev=prev)
        return torch.zeros(()), {}

    monkeypatch.setattr(d, "blocks", spy_blocks)
    monkeypatch.setattr(d, "_scored", spy)
    ids = torch.arange(t)[None] + 20
    d.training_loss(ids, torch.ones(1, t, dtype=torch.long), {k: torch.randn(1, t, 32) for k in d.layer_ids},
                    logits)
    assert seen["label"][0, 0].tolist() == [12, 13, 14, 15]  # tokens 3..6 = target's choices at 2..5
    assert seen["prev"][0, 0].tolist() == [22, 23, 24, 25]  # tokens 2..5: the anchor, then the data's tokens
    torch.testing.assert_close(seen["out"][0, 0], seen["blocks"][0, :4])  # slot 0 (the anchor row) drafts


@pytest.mark.parametrize("vocab", [None, 40])
def test_greedy_dspark_is_lossless_and_drafts_b_tokens(target, vocab):
    d = drafter(target, draft_vocab_size=vocab)
    for seed in range(3):
        prompt = torch.randint(0, V - 1, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        ref = decode_ar(target, prompt, 20)
        prop = DFlashProposer(d)
        assert prop.num_speculative_tokens == 4
        assert speculative_decode(target, prop, prompt, 20).tokens == ref.tokens


def test_the_head_conditions_each_slot_on_the_previous_draft(target):
    """Drafts of a Markov drafter = backbone logits + W2 W1[previous draft], slot after slot."""
    d = drafter(target)
    with torch.no_grad():
        d.block_head.markov_head.markov_w2.weight.normal_(0, 3.0)
    prompt = torch.randint(0, V - 1, (1, 7), generator=torch.Generator().manual_seed(3))
    out = target(prompt[:, :-1], layer_ids=d.layer_ids)
    p = DFlashProposer(d)
    p.begin(prompt, {k: v.float() for k, v in out.hidden.items()}, Sampling())
    got = p.propose(4).tokens
    blk = d.blocks(prompt[:, -1:], p.kv, torch.arange(6, 10)[None], None)[0]
    z, prev, want = d.logits(blk), prompt[0, -1], []
    for s in range(4):
        w = d.block_head.markov_head
        tok = d.draft_ids[(z[s] + w.markov_w2(w.markov_w1(prev))).argmax()]
        want.append(int(tok))
        prev = tok
    assert got.tolist() == want


def _sharp_dspark(**kw):
    small = FrozenTarget(sharp_tiny_llama(5))
    cfg = DFlashConfig(layer_ids=[0], num_layers=1, block_size=3, mask_token_id=2, num_anchors=2,
                       **{**DSPARK, "markov_rank": 4, **kw})
    d = scramble(DFlashDrafter(cfg, small.model.config, small.embed.weight,
                               small.model.get_output_embeddings().weight), seed=3)
    with torch.no_grad():  # a strong Markov dependency: slot s's q depends clearly on the token drafted at s-1
        d.block_head.markov_head.markov_w2.weight.normal_(0, 2.0, generator=torch.Generator().manual_seed(1))
    return small, d


def test_sampled_dspark_reproduces_the_target_distribution():
    """Each slot's draft sampled from q_s(· | the draft at s-1), verified with the residual rule: the joint of 4
    generated tokens matches the target's exactly (χ²), with drafts both accepted and rejected."""
    small, d = _sharp_dspark()
    prompt = torch.tensor([[0, 2, 1]])
    sampling = Sampling(0.8, 1.0, 2)
    exact = exact_joint(small, prompt, 4, sampling)
    gen = torch.Generator().manual_seed(11)
    samples, accepted, rounds = [], 0, 0
    for _ in range(500):
        res = speculative_decode(small, DFlashProposer(d), prompt, 4,
                                        sampling=Sampling(0.8, top_k=2, generator=gen))
        samples.append(tuple(res.tokens))
        accepted += sum(res.accepted)
        rounds += res.rounds
    assert 0.1 * rounds < accepted < 2.5 * rounds
    assert chi2_pvalue(samples, exact) > 1e-3


def test_sampled_batched_dspark_with_confidence_scheduled_k_reproduces_the_target():
    small, d = _sharp_dspark()
    prompts = [torch.tensor([0, 2, 1]), torch.tensor([1, 1, 0, 2, 2])]
    accepted, rounds = assert_batched_rows_follow_target(
        small, lambda: DFlashProposer(d, min_confidence=0.3), prompts, Sampling(0.8, 1.0, 2), 5, "dflash", batches=60)
    assert accepted < 3 * rounds


def test_confidence_scheduled_k_stops_where_the_running_confidence_drops(target):
    d = drafter(target)
    prompt = torch.randint(0, V - 1, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        d.block_head.confidence_head.proj.weight.zero_()
        d.block_head.confidence_head.proj.bias.fill_(torch.logit(torch.tensor(0.7)).item())  # each slot: 0.7
    sizes = {}
    for m in (0.0, 0.6, 0.45, 0.3):  # running products 0.7, 0.49, 0.343, 0.24
        p = DFlashProposer(d, min_confidence=m)
        out = target(prompt[:, :-1], layer_ids=d.layer_ids)
        p.begin(prompt, {k: v.float() for k, v in out.hidden.items()}, Sampling())
        sizes[m] = p.propose(4).size
        assert speculative_decode(target, DFlashProposer(d, min_confidence=m), prompt, 16).tokens == \
            decode_ar(target, prompt, 16).tokens
    assert sizes == {0.0: 4, 0.6: 1, 0.45: 2, 0.3: 3}  # slot 0 is always drafted
    rows = [prompt[0], prompt[0, :5]]
    for m in (0.0, 0.45):
        res = speculative_decode_batch(target, batched("dflash", [DFlashProposer(d, min_confidence=m)
                                                                               for _ in rows]), rows, 16)
        assert [r.tokens for r in res] == [decode_ar(target, r, 16).tokens for r in rows]
    with pytest.raises(ValueError, match="needs a confidence head"):
        DFlashProposer(drafter(target, block_head="none", sample_from_anchor=False), min_confidence=0.5)


def test_verify_costs_schedule_k_from_the_heads_expected_tokens(target, tmp_path):
    """verify_costs: each round keeps the K maximising (1 + Σ_j Π_{i<=j} c_i) / v(K); with every c = 0.7:
    gains 1.7, 2.19, 2.54, 2.78. Cheap verification keeps the whole block, a steep v(K) only its start; the
    cost model fills v in for ``verify_costs: auto``, and decoding stays lossless."""
    from models.methods.dflash import SPEC

    d = drafter(target)
    with torch.no_grad():
        d.block_head.confidence_head.proj.weight.zero_()
        d.block_head.confidence_head.proj.bias.fill_(torch.logit(torch.tensor(0.7)).item())
    prompt = torch.randint(0, V - 1, (1, 8), generator=torch.Generator().manual_seed(1))
    out = target(prompt[:, :-1], layer_ids=d.layer_ids)
    for costs, want in (([1.0, 1.0, 1.0, 1.0], 4), ([1.0, 1.5, 2.0, 2.5], 1), ([1.0, 1.2, 1.4, 1.6], 2)):
        p = DFlashProposer(d, verify_costs=costs)  # 1.7/1, 2.19/1.2 = 1.825, 2.54/1.4 = 1.81, 2.78/1.6
        p.begin(prompt, {k: v.float() for k, v in out.hidden.items()}, Sampling())
        assert p.propose(4).size == want, costs
        assert speculative_decode(target, DFlashProposer(d, verify_costs=costs), prompt, 16).tokens == \
            decode_ar(target, prompt, 16).tokens
    p = SPEC.proposers[0]
    o = p.prepare(d, str(tmp_path), p.options({"verify_costs": "auto"}))
    sized = p.size(d, str(tmp_path), o, lambda k: 1 + 0.2 * k)
    assert sized["verify_costs"] == [1.2, 1.4, 1.6, 1.8]
    with pytest.raises(ValueError, match="confidence head"):
        plain = drafter(target, block_head="none", sample_from_anchor=False)
        p.prepare(plain, None, p.options({"verify_costs": "auto"}))


def test_training_loss_trains_head_and_confidence(target):
    d = drafter(target, label_path="data").train()
    ids = torch.randint(0, V - 1, (2, 20), generator=torch.Generator().manual_seed(0))
    out = target(ids, layer_ids=d.layer_ids)
    loss, m = d.training_loss(ids, torch.ones_like(ids), {k: v.float() for k, v in out.hidden.items()},
                              out.logits.float())
    loss.backward()
    w = d.block_head
    assert w.markov_head.markov_w2.weight.grad.abs().sum() > 0 and w.confidence_head.proj.weight.grad.abs().sum() > 0
    assert {"acc_3", "conf_0", "cstar_3", "conf_bce"} <= set(m) and 0 <= m["cstar_0"] <= 1


class ToyGRUHead(nn.Module):
    """A second head in one small module (test-only, Domino-like): a recurrent state over the block's drafts."""

    def __init__(self, cfg, hidden: int, vocab: int, draft_vocab: int):
        super().__init__()
        r = int(cfg.markov_rank)
        self.emb, self.cell, self.out = nn.Embedding(vocab, r), nn.GRUCell(r, r), nn.Linear(r, draft_vocab)

    def init_state(self, shape):
        return torch.zeros(*shape, self.cell.hidden_size)

    def step(self, z, h, prev, state):
        flat = self.cell(self.emb(prev.long()).reshape(-1, self.cell.input_size), state.reshape(-1, state.shape[-1]))
        state = flat.view(state.shape)
        return z + self.out(state), None, state

    def block_logits(self, z, h, prev):
        state, outs = self.init_state(z.shape[:-2]), []
        for s in range(z.shape[-2]):
            logits, _, state = self.step(z[..., s, :], h[..., s, :], prev[..., s], state)
            outs.append(logits)
        return torch.stack(outs, -2), None


def test_a_second_head_is_one_small_module(target, monkeypatch):
    monkeypatch.setitem(block_heads.BLOCK_HEADS, "toy_gru", ToyGRUHead)
    d = drafter(target, block_head="toy_gru", label_path="data")
    assert isinstance(d.block_head, ToyGRUHead)
    with torch.no_grad():
        d.block_head.out.weight.normal_(0, 2.0)
    ids = torch.randint(0, V - 1, (2, 20), generator=torch.Generator().manual_seed(0))
    out = target(ids, layer_ids=d.layer_ids)
    loss, _ = d.train().training_loss(ids, torch.ones_like(ids), {k: v.float() for k, v in out.hidden.items()},
                                      out.logits.float())
    loss.backward()
    assert d.block_head.cell.weight_hh.grad.abs().sum() > 0
    d.eval()
    prompt = ids[:1, :7]
    assert speculative_decode(target, DFlashProposer(d), prompt, 16).tokens == \
        decode_ar(target, prompt, 16).tokens
    with pytest.raises(ValueError, match="block_head='nope'"):
        drafter(target, block_head="nope")


# ----------------------------------------------------------------------------------------- recipe + warm start
def _cfg(target_dir, out, *over):
    base = [f"target.name_or_path={target_dir}", f"output_dir={out}", "tracking=none", "data.max_rows=16",
            "data.val_rows=4", "data.max_len=40", f"data.cache_dir={out}/data", "data.regenerate=0", "train.steps=2",
            "train.batch_size=2", "train.ckpt_every=100", "train.log_every=1", "train.eval_every=100",
            "optim.warmup_steps=1", "draft.config.layer_ids=[1,2,3]", "draft.config.block_size=4",
            "draft.config.num_anchors=4", "draft.config.draft_vocab_size=null", "draft.config.markov_rank=8"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=base + list(over))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("dspark_target")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def test_recipe_dspark_trains_and_warm_starts_from_dflash(target_dir, tmp_path):
    """+recipe=dflash for 2 steps, then +recipe=dspark warm-started from it: the DSpark drafter starts with the
    DFlash checkpoint's every tensor (and its mask id), its head fresh; refusals for a non-DFlash source."""
    run(_cfg(target_dir, tmp_path / "df", "+recipe=dflash"))
    res = run(_cfg(target_dir, tmp_path / "ds", "+recipe=dspark", "train.steps=1", "optim.optimizer.lr=1e-12",
                   f"draft.config.warm_start={tmp_path / 'df' / 'final'}"))
    assert "acc_3" in res["val"] and "conf_0" in res["val"]  # B = 4 drafts scored, confidence calibrated
    tgt = FrozenTarget.from_pretrained(str(target_dir))
    df, _ = registry.load_drafter(tmp_path / "df" / "final", tgt)
    ds, meta = registry.load_drafter(tmp_path / "ds" / "final", tgt)
    assert meta["draft"]["block_head"] == "markov" and meta["draft"]["sample_from_anchor"] is True
    assert ds.cfg.mask_token_id == df.cfg.mask_token_id
    for k, v in df.state_dict().items():  # lr ~ 0: still the warm start's weights
        torch.testing.assert_close(ds.state_dict()[k], v, atol=1e-6, rtol=0, msg=k)
    prompt = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    assert speculative_decode(tgt, DFlashProposer(ds), prompt, 12).tokens == \
        decode_ar(tgt, prompt, 12).tokens
    with pytest.raises(ValueError, match="not a DFlash one|no model.safetensors"):
        run(_cfg(target_dir, tmp_path / "bad", "+recipe=dspark", f"draft.config.warm_start={tmp_path}"))
    with pytest.raises(ValueError, match="num_layers=3 but the warm-start"):
        run(_cfg(target_dir, tmp_path / "bad2", "+recipe=dspark", "draft.config.num_layers=3",
                 f"draft.config.warm_start={tmp_path / 'df' / 'final'}"))


def test_warm_start_widens_a_reduced_vocabulary_to_the_whole_one(target_dir, tmp_path):
    """draft_vocab_size = the target's vocab size widens a reduced-vocabulary DFlash (its head is the target's
    frozen lm_head): same backbone, every id draftable, d2t the identity; a narrower or other width is refused."""
    tgt = FrozenTarget.from_pretrained(str(target_dir))
    V = tgt.vocab_size
    run(_cfg(target_dir, tmp_path / "df", "+recipe=dflash", "draft.config.draft_vocab_size=64"))
    run(_cfg(target_dir, tmp_path / "wide", "+recipe=dflash", "train.steps=1", "optim.optimizer.lr=1e-12",
             f"draft.config.draft_vocab_size={V}", f"draft.config.warm_start={tmp_path / 'df' / 'final'}"))
    df, _ = registry.load_drafter(tmp_path / "df" / "final", tgt)
    wide, meta = registry.load_drafter(tmp_path / "wide" / "final", tgt)
    assert df.draft_vocab_size == 64 and wide.draft_vocab_size == V == meta["draft"]["draft_vocab_size"]
    assert torch.equal(wide.draft_ids, torch.arange(V))
    torch.testing.assert_close(wide.lm_head, tgt.model.get_output_embeddings().weight.float())
    for k, v in df.state_dict().items():
        if k not in ("lm_head", "d2t", "t2d"):  # lr ~ 0: still the warm start's backbone
            torch.testing.assert_close(wide.state_dict()[k], v, atol=1e-6, rtol=0, msg=k)
    prompt = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(1))
    assert speculative_decode(tgt, DFlashProposer(wide), prompt, 12).tokens == decode_ar(tgt, prompt, 12).tokens
    with pytest.raises(ValueError, match="draft_vocab_size=32 but the warm-start .* has 64; pass .*=null"):
        run(_cfg(target_dir, tmp_path / "bad", "+recipe=dflash", "draft.config.draft_vocab_size=32",
                 f"draft.config.warm_start={tmp_path / 'df' / 'final'}"))
    # a whole-vocabulary checkpoint under a recipe that asks for a reduced one: said, not a d2t shape error
    with pytest.raises(ValueError, match=f"draft_vocab_size=64 but the warm-start .* has {V}; pass .*=null"):
        run(_cfg(target_dir, tmp_path / "bad2", "+recipe=dspark", "draft.config.draft_vocab_size=64",
                 f"draft.config.warm_start={tmp_path / 'wide' / 'final'}"))


# ----------------------------------------------------------------------------------------- export
def test_dspark_exports_round_trip_and_refuse_what_engines_would_misread(target_dir, tmp_path):
    import json
    import shutil

    from models.export.api import export, load_export
    from models.export.shared.common import ExportError
    from models.export.validate import validate
    from tests.test_dflash import _same_proposals

    run(_cfg(target_dir, tmp_path / "run", "+recipe=dspark"))
    tgt = FrozenTarget.from_pretrained(str(target_dir))
    d, meta = registry.load_drafter(tmp_path / "run" / "final", tgt)
    with torch.no_grad():  # a head that matters, so a dropped or misnamed tensor changes the drafts
        d.block_head.markov_head.markov_w2.weight.normal_(0, 2.0)
    prompts = [torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for fmt in ("dspark_speculators", "dspark_zlab"):
        out = export(d, fmt, tmp_path / fmt, tgt, meta=meta)
        assert validate(out, None, tgt) == fmt  # detected from config.json alone
        back = load_export(out, tgt)
        w2 = back.block_head.markov_head.markov_w2.weight
        torch.testing.assert_close(w2, d.block_head.markov_head.markov_w2.weight)
        _same_proposals(d, back, tgt, prompts)
    cfg = json.loads((tmp_path / "dspark_speculators" / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # B, not B-1
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["sample_from_anchor"] is True
    z = json.loads((tmp_path / "dspark_zlab" / "config.json").read_text())
    assert z["dflash_config"]["target_layer_ids"] == [0, 1, 2] and z["dflash_config"]["projector_type"] == "dspark"
    readme = (tmp_path / "dspark_speculators" / "README.md").read_text()
    assert '"method": "dspark"' in readme and '"num_speculative_tokens": 4' in readme
    assert "--speculative-algorithm DSPARK" in (tmp_path / "dspark_zlab" / "README.md").read_text()

    # builders: a DSpark drafter never goes into a DFlash format (its head would be dropped), nor the reverse
    for fmt in ("dflash_speculators", "dflash_zlab"):
        with pytest.raises(ExportError, match="would drop its head"):
            export(d, fmt, tmp_path / f"x_{fmt}", tgt, meta=meta)
    plain = DFlashDrafter(DFlashConfig(layer_ids=[1, 2, 3], block_size=4, mask_token_id=d.cfg.mask_token_id),
                          tgt.model.config, tgt.embed.weight, tgt.model.get_output_embeddings().weight)
    with pytest.raises(ExportError, match="Markov head with sample_from_anchor=true"):
        export(plain, "dspark_speculators", tmp_path / "x_plain", tgt)
    small_vocab = DFlashDrafter(DFlashConfig(layer_ids=[1, 2, 3], block_size=4, mask_token_id=d.cfg.mask_token_id,
                                             draft_vocab_size=100, **DSPARK), tgt.model.config, tgt.embed.weight,
                                tgt.model.get_output_embeddings().weight)
    with pytest.raises(ExportError, match="no draft vocabulary"):
        export(small_vocab, "dspark_zlab", tmp_path / "x_vocab", tgt)
    scramble(small_vocab)  # the speculators format holds it: W1 over target ids, W2 over the draft vocabulary
    out = export(small_vocab, "dspark_speculators", tmp_path / "x_vocab_spec", tgt)
    assert validate(out, None, tgt) == "dspark_speculators"
    _same_proposals(small_vocab, load_export(out, tgt), tgt, prompts)

    def broken(fmt, edit):
        dst = tmp_path / f"{fmt}_bad"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(tmp_path / fmt, dst)
        c = json.loads((dst / "config.json").read_text())
        edit(c)
        (dst / "config.json").write_text(json.dumps(c))
        return dst

    dc = lambda **kw: lambda c: c["dflash_config"].update(**kw)  # noqa: E731
    cases = [
        ("dspark_speculators", lambda c: c.update(sample_from_anchor=False), "sample_from_anchor must be true"),
        ("dspark_speculators", lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=5),
         "disagrees with block_size"),
        ("dspark_speculators", lambda c: c.update(markov_rank=0), "markov_rank"),
        ("dspark_speculators", lambda c: c.update(markov_rank=16), "markov_w1.weight has shape"),
        ("dspark_speculators", lambda c: c.pop("enable_confidence_head"), "enable_confidence_head"),
        ("dspark_speculators", lambda c: c.update(confidence_head_with_markov=False), "confidence_head.proj.weight"),
        ("dspark_speculators", lambda c: c.update(enable_confidence_head=False), "unexpected tensor"),
        ("dspark_speculators", lambda c: c.update(aux_hidden_state_layer_ids=[0, 1, 2]), "off by one"),
        ("dspark_speculators", lambda c: c["speculators_config"].update(algorithm="dflash"), "algorithm 'dspark'"),
        ("dspark_zlab", dc(projector_type=None), "projector_type"),
        ("dspark_zlab", dc(target_layer_ids=[1, 2, 3]), "off by one|out of range"),
        ("dspark_zlab", dc(markov_head_type="gated"), "only 'vanilla'"),
    ]
    for fmt, edit, msg in cases:
        with pytest.raises(ExportError, match=msg):
            validate(broken(fmt, edit), fmt, tgt)
