"""P-EAGLE (models/methods/peagle): the COD chains and their attention mask, cached parallel drafting equals a
from-scratch forward, lossless greedy and sampled (χ²) decoding, training on the loop, and the speculators
``peagle`` export (vLLM ``{"method": "eagle3", "parallel_drafting": true}``) with round trip and refusals."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from eval.decode.single import decode_ar, speculative_decode
from models import registry
from models.core.proposal import Sampling
from models.core.target import FrozenTarget
from models.methods.peagle import build
from models.methods.peagle.config import PEagleConfig
from models.methods.peagle.net import PEagleDrafter
from models.methods.peagle.proposers import PEagleProposer
from tests.conftest import make_tiny_llama
from tests.test_decode import chi2_pvalue, exact_joint
from tests.test_dflash import scramble
from train.loop import run

CONF = Path(__file__).resolve().parent.parent / "conf"
V = 64


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(make_tiny_llama(V, layers=4, hidden=32, seed=2))


def drafter(target, **kw) -> PEagleDrafter:
    cfg = PEagleConfig(**{"layer_ids": [3, 1, 2], "num_layers": 2, "num_depths": 4, "mask_token_id": V - 1, **kw})
    rows = [{"input_ids": list(range(V - 1)), "loss_mask": [1] * (V - 1)}]
    return scramble(build(cfg, target, rows))


def test_cod_chains_are_nested_and_shrink_by_the_ratio(target):
    d = drafter(target, down_sample_ratio=0.5, down_sample_ratio_min=0.2, max_anchors=100)
    torch.manual_seed(0)
    mask = torch.ones(2, 42, dtype=torch.long)
    mask[1, 30:] = 0
    chains = d.cod_anchors(mask)
    assert [a.shape[1] for a, _ in chains] == [20, 10, 8]  # ceil(40 * 0.5), ceil(40 * 0.25), ceil(40 * 0.2)
    for (a, k), (a2, k2) in zip(chains, chains[1:]):
        assert torch.equal(a[:, : a2.shape[1]], a2) and torch.equal(k[:, : k2.shape[1]], k2)
    a, k = chains[0]
    assert (a[0] < 40).all() and (a[1][k[1]] < 28).all()  # a valid anchor a: token a+2 is a training target


def test_training_positions_see_what_decoding_sees(target):
    """The training forward of real entries and one chain equals the decode forward: real entries 0..a causal,
    then the chain's mask entries at a+1..a+d (same outputs)."""
    d = drafter(target).eval()
    ids = torch.randint(0, V - 1, (1, 12), generator=torch.Generator().manual_seed(1))
    out = target(ids, layer_ids=d.layer_ids)
    hid = {k: v.float() for k, v in out.hidden.items()}
    a = 6
    p = PEagleProposer(d)
    p.begin(ids[:, : a + 2], {k: v[:, : a + 1] for k, v in hid.items()}, Sampling())
    prop = p.propose(4)
    # training form: all 12 real entries + a chain of depths 1..3 at anchor a, via the same mask as training_loss
    g0 = d.fuse(hid)
    e0 = d.embed_tokens(torch.cat([ids[:, 1:], ids[:, :1]], 1))
    em, gm = d.mask_entry(1, 3)
    anchor = torch.tensor([list(range(12)) + [a] * 3])
    depth = torch.tensor([0] * 12 + [1, 2, 3])
    q = 15
    real = depth == 0
    m = (real[None, None, :] & (torch.arange(q)[None, None, :] <= anchor[:, :, None])) | \
        ((anchor[:, :, None] == anchor[:, None, :]) & ~real[None, None, :] & ~real[None, :, None]
         & (depth[None, None, :] <= depth[None, :, None]))
    x, _ = d.forward_entries(torch.cat([e0, em], 1), torch.cat([g0, gm], 1), anchor + depth, None, m[:, None])
    rows = torch.cat([x[0, a : a + 1], x[0, 12:]])
    ref = d.draft_ids[d.logits(rows).argmax(-1)]
    assert torch.equal(ref, prop.tokens)


def test_cached_parallel_drafting_over_a_decode(target):
    """Every round's K drafts equal a from-scratch forward over all committed tokens + the mask entries."""
    d = drafter(target)
    prompt = torch.randint(0, V - 1, (1, 8), generator=torch.Generator().manual_seed(4))
    checked = []

    class Checked(PEagleProposer):
        def begin(self, tokens, hidden, sampling):
            self.all_ids = tokens.clone()
            super().begin(tokens, hidden, sampling)

        def accept(self, tokens, hidden):
            self.all_ids = torch.cat([self.all_ids, tokens], 1)
            super().accept(tokens, hidden)

        def propose(self, max_depth):
            prop = super().propose(max_depth)
            ids = self.all_ids
            out = target(ids[:, :-1], layer_ids=d.layer_ids)
            n = ids.shape[1] - 1
            g = d.fuse({k: v.float() for k, v in out.hidden.items()})
            em, gm = d.mask_entry(1, prop.size - 1)
            x, _ = d.forward_entries(torch.cat([d.embed_tokens(ids[:, 1:]), em], 1), torch.cat([g, gm], 1),
                                     torch.arange(n + prop.size - 1)[None], None, None)
            ref = d.draft_ids[d.logits(x[0, n - 1 :]).argmax(-1)]
            assert torch.equal(ref, prop.tokens)
            checked.append(prop.size)
            return prop

    res = speculative_decode(target, Checked(d), prompt, 24)
    assert len(checked) >= 5 and res.tokens == decode_ar(target, prompt, 24).tokens


@pytest.mark.parametrize("vocab", [None, 40])
def test_greedy_peagle_is_lossless(target, vocab):
    d = drafter(target, draft_vocab_size=vocab)
    for seed in range(3):
        prompt = torch.randint(0, V - 1, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        assert speculative_decode(target, PEagleProposer(d), prompt, 20).tokens == \
            decode_ar(target, prompt, 20).tokens


def test_sampled_peagle_reproduces_the_target_distribution():
    """Each depth's draft sampled from its own q_d, verified with the residual rule: the joint of 4 generated
    tokens matches the target's exactly (χ²), with drafts both accepted and rejected."""
    small = FrozenTarget(make_tiny_llama(3, layers=4, hidden=16, seed=5))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # sharp, context-dependent distributions (as tests/test_decode.py sharp_tiny_llama)
        for p_ in small.model.parameters():
            if p_.dim() == 2:
                p_.copy_(torch.randn(p_.shape, generator=g) * 3 / p_.shape[1] ** 0.5)
        small.model.model.embed_tokens.weight.mul_(4.0)
    d = scramble(PEagleDrafter(PEagleConfig(layer_ids=[1, 2, 3], num_depths=3, mask_token_id=2), small.model.config,
                               small.embed.weight, small.model.get_output_embeddings().weight), seed=3)
    prompt = torch.tensor([[0, 2, 1]])
    sampling = Sampling(0.8, 1.0, 2)
    exact = exact_joint(small, prompt, 4, sampling)
    gen = torch.Generator().manual_seed(11)
    samples, accepted, rounds = [], 0, 0
    for _ in range(500):
        res = speculative_decode(small, PEagleProposer(d), prompt, 4,
                                        sampling=Sampling(0.8, top_k=2, generator=gen))
        samples.append(tuple(res.tokens))
        accepted += sum(res.accepted)
        rounds += res.rounds
    assert 0.1 * rounds < accepted < 2.5 * rounds
    assert chi2_pvalue(samples, exact) > 1e-3


def test_loss_trains_mask_hidden_and_the_embedding(target):
    d = drafter(target, label_path="data").train()
    ids = torch.randint(0, V - 1, (2, 20), generator=torch.Generator().manual_seed(0))
    out = target(ids, layer_ids=d.layer_ids)
    loss, m = d.training_loss(ids, torch.ones_like(ids), {k: v.float() for k, v in out.hidden.items()},
                              out.logits.float())
    loss.backward()
    assert d.mask_hidden.grad.abs().sum() > 0 and d.embed_tokens.weight.grad.abs().sum() > 0
    assert not d.lm_head.requires_grad and {"acc_0", "acc_3", "n_3", "sim_tau"} <= set(m)
    assert m["n_1"] <= 2 * 18 and m["n_3"] <= m["n_1"]
    with pytest.raises(ValueError, match="trained for 4 parallel depths"):
        PEagleProposer(d, num_speculative_tokens=5)


def test_checkpoints_store_only_the_embedding_rows_training_changed(target, tmp_path):
    """The trained embedding is stored as the rows that differ from the target's (ids + rows) and loads back
    exact; the whole-table form still loads; ids out of range or repeated are refused with the file named."""
    from safetensors.torch import load_file, save_file

    from models.core.checkpoint import load_trainable_state, trainable_state

    d = drafter(target)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.embed.weight.float())
        d.embed_tokens.weight[[5, 9, 40]] += 0.25
    state = trainable_state(d)
    assert "embed_tokens.weight" not in state and state["embed_tokens.changed_ids"].tolist() == [5, 9, 40]
    save_file(state, str(tmp_path / "packed.safetensors"))
    save_file(trainable_state(d, packed=False), str(tmp_path / "whole.safetensors"))
    for f in ("packed", "whole"):
        back = drafter(target)
        load_trainable_state(back, tmp_path / f"{f}.safetensors")
        assert torch.equal(back.embed_tokens.weight, d.embed_tokens.weight), f
        assert torch.equal(back.mask_hidden, d.mask_hidden), f
    for ids in ([5, 9, V], [5, 5, 40]):
        bad = {**state, "embed_tokens.changed_ids": torch.tensor(ids)}
        save_file(bad, str(tmp_path / "bad.safetensors"))
        with pytest.raises(ValueError, match=r"bad.safetensors: .*outside 0..63 or repeats"):
            load_trainable_state(drafter(target), tmp_path / "bad.safetensors")
    assert load_file(str(tmp_path / "packed.safetensors"))["embed_tokens.changed_rows"].shape == (3, 32)


# ----------------------------------------------------------------------------------------- recipe + export
def _cfg(target_dir, out, *over):
    base = [f"target.name_or_path={target_dir}", f"output_dir={out}", "tracking=none", "data.max_rows=16",
            "data.val_rows=4", "data.max_len=40", f"data.cache_dir={out}/data", "data.regenerate=0", "train.steps=2",
            "train.batch_size=2", "train.ckpt_every=100", "train.log_every=1", "train.eval_every=100",
            "optim.warmup_steps=1", "+recipe=peagle", "draft.config.layer_ids=[1,2,3]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=base + list(over))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("peagle_target")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("vocab", ["null", "200"])
def test_recipe_trains_exports_and_round_trips(target_dir, tmp_path, vocab):
    import json
    import shutil

    from models.export.api import export, load_export
    from models.export.shared.common import ExportError
    from models.export.validate import validate

    res = run(_cfg(target_dir, tmp_path / "run", f"draft.config.draft_vocab_size={vocab}"))
    assert res["method"] == "peagle" and "acc_3" in res["val"]
    tgt = FrozenTarget.from_pretrained(str(target_dir))
    d, meta = registry.load_drafter(tmp_path / "run" / "final", tgt)
    prompt = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(0))
    assert speculative_decode(tgt, PEagleProposer(d), prompt, 12).tokens == \
        decode_ar(tgt, prompt, 12).tokens
    out = export(d, "peagle_speculators", tmp_path / "x", tgt, meta=meta)
    assert validate(out, None, tgt) == "peagle_speculators"
    back = load_export(out, tgt)
    for s in range(3):
        p = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(s))
        o = tgt(p[:, :-1], layer_ids=d.layer_ids)
        a, b = PEagleProposer(d), PEagleProposer(back)
        a.begin(p, {k: v.float() for k, v in o.hidden.items()}, Sampling())
        b.begin(p, {k: v.float() for k, v in o.hidden.items()}, Sampling())
        assert torch.equal(a.propose(4).tokens, b.propose(4).tokens)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == d.cfg.mask_token_id
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["norm_before_residual"] is False
    readme = (out / "README.md").read_text()
    assert '"method": "eagle3"' in readme and '"parallel_drafting": true' in readme
    if vocab != "null":
        return

    def broken(edit):
        dst = tmp_path / "bad"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(out, dst)
        c = json.loads((dst / "config.json").read_text())
        edit(c)
        (dst / "config.json").write_text(json.dumps(c))
        return dst

    cases = [
        (lambda c: c.pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.update(mask_token_id=10**6), "mask_token_id"),
        (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=9), "parallel depths"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), "off by one"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), "out of range"),
        (lambda c: c.pop("norm_before_residual"), "norm_before_residual"),
        (lambda c: c.update(speculators_model_type="eagle3"), "peagle"),
        (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), "missing"),
    ]
    for edit, msg in cases:
        with pytest.raises(ExportError, match=msg):
            validate(broken(edit), "peagle_speculators", tgt)
