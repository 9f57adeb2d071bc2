"""DFlash (models/methods/dflash): block mask, slot/label alignment, cached drafting, lossless decoding, training on
the shared loop (resume), export in both formats, and another family (Qwen3: QK-norm, GQA) end to end."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from eval.decode.single import decode_ar, speculative_decode
from models import registry
from models.core.proposal import Sampling
from models.core.target import FrozenTarget
from models.export.api import export, load_export
from models.export.shared.common import ExportError
from models.export.validate import validate
from models.methods.dflash import build
from models.methods.dflash.config import DFlashConfig, default_layer_ids
from models.methods.dflash.net import DFlashDrafter
from models.methods.dflash.proposers import DFlashProposer
from tests.conftest import make_tiny_llama
from tests.test_decode import chi2_pvalue, exact_joint, sharp_tiny_llama
from train.loop import run

CONF = Path(__file__).resolve().parent.parent / "conf"
V = 64


def scramble(d: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """O(1) trainable weights so drafts depend clearly on context, positions and the cache."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)
    return d.eval()


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(make_tiny_llama(V, layers=4, hidden=32, seed=2))


def drafter(target, **kw) -> DFlashDrafter:
    cfg = DFlashConfig(**{"layer_ids": [1, 2, 3], "num_layers": 2, "block_size": 4, "mask_token_id": V - 1,
                          "num_anchors": 6, **kw})
    rows = [{"input_ids": list(range(V - 1)), "loss_mask": [1] * (V - 1)}]
    return scramble(build(cfg, target, rows))


def test_default_layer_ids_follow_zlab_plus_one():
    assert default_layer_ids(36, 5) == [2, 10, 18, 26, 34]  # z-lab Qwen3-8B [1, 9, 17, 25, 33] + 1
    assert default_layer_ids(24, 5) == [2, 7, 12, 17, 22]  # Qwen2.5-0.5B [1, 6, 11, 16, 21] + 1
    assert default_layer_ids(8, 1) == [5]  # [L // 2] + 1


def test_block_mask_matches_a_visibility_table_by_hand(target):
    d = drafter(target, block_size=3)
    anchors = torch.tensor([[1, 4]])  # T = 6: block 0 anchored at 1, block 1 at 4
    keep = torch.tensor([[True, True]])
    m = d.block_mask(anchors, keep, torch.ones(1, 6, dtype=torch.bool))[0, 0].int()
    #          ctx 0 1 2 3 4 5 | block0 s0 s1 s2 | block1 s0 s1 s2
    row_b0 = [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]  # c < 1; its own block, bidirectional
    row_b1 = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]  # c < 4 (not the anchor's own state)
    assert m.tolist() == [row_b0] * 3 + [row_b1] * 3
    # a padding block sees no context, only itself (its rows are never scored)
    m2 = d.block_mask(anchors, torch.tensor([[True, False]]), torch.ones(1, 6, dtype=torch.bool))[0, 0].int()
    assert m2[3:, :6].sum() == 0 and m2[3:, 9:].all()


def test_slot_labels_are_the_targets_tokens_at_anchor_plus_k(target, monkeypatch):
    """Slot k of a block anchored at a is scored against argmax(target_logits[a+k-1]) = the target's token a+k;
    slot 0 is not scored; labels past the row's end or outside the loss mask are not scored."""
    d = drafter(target, block_size=4, num_anchors=2, label_path="data")
    t = 7
    logits = torch.full((1, t, V), -10.0)
    for pos in range(t):
        logits[0, pos, 10 + pos] = 10.0  # the target's token at pos+1 is 10+pos
    monkeypatch.setattr(d, "sample_anchors", lambda m: (torch.tensor([[1, 5]]), torch.tensor([[True, True]])))
    seen = {}

    def spy(out, teacher, valid, prev=None):
        seen["label"], seen["valid"], seen["prev"] = teacher.argmax(-1), valid, prev
        return torch.zeros(()), {}

    monkeypatch.setattr(d, "_scored", spy)
    mask = torch.ones(1, t, dtype=torch.long)
    mask[0, 3] = 0  # token 3 is not a training target
    ids = torch.arange(t)[None]
    d.training_loss(ids, mask, {k: torch.randn(1, t, 32) for k in d.layer_ids}, logits)
    # anchor 1: slots 1..3 predict tokens 2, 3, 4 → target's choices at 1, 2, 3 → ids 11, 12, 13
    assert seen["label"][0, 0].tolist() == [11, 12, 13]
    assert seen["prev"][0, 0].tolist() == [1, 2, 3]  # the token before each label (a block head's condition)
    assert seen["valid"][0, 0].tolist() == [True, False, True]  # token 3 is masked
    # anchor 5: tokens 6, 7, 8 → only token 6 exists in a row of 7
    assert seen["label"][0, 1, 0].item() == 15
    assert seen["valid"][0, 1].tolist() == [True, False, False]
    # label_path=greedy: slot k only where tokens a+1..a+k-1 are the target's own choices (token p = 10+p-1)
    d.cfg.label_path = "greedy"
    on_path = torch.tensor([[0, 10, 11, 99, 13, 14, 15]])  # token 3 is off the target's greedy path
    d.training_loss(on_path, torch.ones(1, t, dtype=torch.long), {k: torch.randn(1, t, 32) for k in d.layer_ids},
                    logits)
    assert seen["valid"][0, 0].tolist() == [True, True, False]  # slot 3 follows token 3: not the target's path
    assert seen["valid"][0, 1].tolist() == [True, False, False]


def test_conditional_agreement_gives_the_expected_accepted_length(target):
    d = drafter(target, block_size=4)
    out = torch.zeros(1, 2, 3, 32)
    teacher = torch.zeros(1, 2, 3, V)
    hit = torch.tensor([[[True, True, False], [True, False, True]]])
    valid = torch.ones_like(hit)
    top = int(d.draft_ids[d.logits(out)[0, 0, 0].argmax()])  # the drafter's token on zero outputs (a tie: id 0)
    other = (top + 1) % V
    teacher[..., top] = torch.where(hit, 5.0, 0.0)  # the target agrees with the drafter exactly where hit
    teacher[..., other] = torch.where(hit, 0.0, 5.0)
    _, m = d._scored(out, teacher, valid)
    # block 0 accepts 2, block 1 accepts 1 (its slot 3 hit does not count): acc_0 = 1, acc_1 = 1/2, acc_2 = 0
    assert (m["acc_0"], m["acc_1"], m["acc_2"]) == (1.0, 0.5, 0.0)
    assert (m["n_0"], m["n_1"], m["n_2"]) == (2.0, 2.0, 1.0)
    assert m["sim_tau"] == pytest.approx(1 + 1 + 0.5)  # mean accepted (2 + 1) / 2 plus the bonus token


def test_cached_drafting_equals_the_no_cache_reference(target):
    """Over several rounds of a real decode, every proposal equals a from-scratch forward over the whole
    context (context features of every committed token, block at positions n..n+B-1, no mask)."""
    d = drafter(target, block_size=5)
    prompt = torch.randint(0, V - 1, (1, 9), generator=torch.Generator().manual_seed(4))
    checked = []

    class Checked(DFlashProposer):
        def propose(self, max_depth):
            prop = super().propose(max_depth)
            ctx_ids = self.all_ids[:, :-1]
            out = target(ctx_ids, layer_ids=d.layer_ids)
            ctx = d.context({k: v.float() for k, v in out.hidden.items()})
            n = ctx.shape[1]
            kvs = d.context_kv(ctx, torch.arange(n)[None])
            blk = d.blocks(self.all_ids[:, -1:], kvs, torch.arange(n, n + d.block_size)[None], None)
            ref = d.logits(blk[0, 1 : prop.size + 1]).argmax(-1)
            assert torch.equal(d.draft_ids[ref], prop.tokens)
            checked.append(prop.size)
            return prop

        def begin(self, tokens, hidden, sampling):
            self.all_ids = tokens.clone()
            super().begin(tokens, hidden, sampling)

        def accept(self, tokens, hidden):
            self.all_ids = torch.cat([self.all_ids, tokens], 1)
            super().accept(tokens, hidden)

    res = speculative_decode(target, Checked(d), prompt, 24)
    assert len(checked) >= 5 and res.tokens == decode_ar(target, prompt, 24).tokens


@pytest.mark.parametrize("vocab", [None, 40])
def test_greedy_dflash_is_lossless(target, vocab):
    d = drafter(target, draft_vocab_size=vocab)
    for seed in range(3):
        prompt = torch.randint(0, V - 1, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        ref = decode_ar(target, prompt, 20)
        assert speculative_decode(target, DFlashProposer(d), prompt, 20).tokens == ref.tokens


def test_sampled_dflash_drafts_reproduce_the_target_distribution():
    """Sampled slot drafts (each from its own q_k) verified with the residual rule: the joint distribution of
    4 generated tokens matches the target's exactly (χ²), with drafts both accepted and rejected."""
    small = FrozenTarget(sharp_tiny_llama(5))
    cfg = DFlashConfig(layer_ids=[0], num_layers=1, block_size=4, mask_token_id=2, num_anchors=2)
    d = scramble(DFlashDrafter(cfg, small.model.config, small.embed.weight,
                               small.model.get_output_embeddings().weight), seed=3)
    prompt = torch.tensor([[0, 2, 1]])
    sampling = Sampling(0.8, 1.0, 2)
    exact = exact_joint(small, prompt, 4, sampling)
    gen = torch.Generator().manual_seed(11)
    prop = DFlashProposer(d)
    samples, accepted, rounds = [], 0, 0
    for _ in range(500):
        res = speculative_decode(small, prop, prompt, 4, sampling=Sampling(0.8, top_k=2, generator=gen))
        samples.append(tuple(res.tokens))
        accepted += sum(res.accepted)
        rounds += res.rounds
    assert 0.1 * rounds < accepted < 2.5 * rounds
    assert chi2_pvalue(samples, exact) > 1e-3


def test_k_auto_is_sized_from_heldout_agreement_and_verify_cost(target, tmp_path):
    """num_speculative_tokens: auto verifies the k maximising E(k)/v(k) with E from final/eval.json's conditional
    slot agreement."""
    import json

    from models.methods.dflash import SPEC

    p = SPEC.proposers[0]
    d = drafter(target, block_size=4)
    (tmp_path / "eval.json").write_text(json.dumps({"acc_0": 0.9, "acc_1": 0.1, "acc_2": 0.0}))
    o = p.prepare(d, str(tmp_path), p.options({"num_speculative_tokens": "auto"}))
    assert o["num_speculative_tokens"] == 3 and o["auto_size"]
    sized = p.size(d, str(tmp_path), o, lambda k: 1 + 0.1 * k)  # E(1)/v(1) = 1.9/1.1 beats 1.99/1.2
    assert sized["num_speculative_tokens"] == 1
    assert sized["num_speculative_tokens_sized"]["predicted_bound"][2] == pytest.approx(1.99 / 1.2, abs=1e-3)
    o = p.prepare(d, str(tmp_path), p.options({"num_speculative_tokens": None}))
    assert p.size(d, str(tmp_path), o, lambda k: 1.0) is None


def test_bad_settings_are_one_line_errors(target):
    with pytest.raises(ValueError, match="mask_token_id=64 is not a row"):
        drafter(target, mask_token_id=V)
    with pytest.raises(ValueError, match="block_size=1"):
        drafter(target, block_size=1)
    with pytest.raises(ValueError, match="post-norm"):
        drafter(target, layer_ids=[1, 4])
    with pytest.raises(ValueError, match="never trained"):
        DFlashProposer(drafter(target, block_size=4), num_speculative_tokens=4)
    with pytest.raises(ValueError, match="loss="):
        drafter(target, loss="mse")


# ----------------------------------------------------------------------------------------- training + export
def _cfg(target_dir, out, *over):
    base = [f"target.name_or_path={target_dir}", f"output_dir={out}", "tracking=none", "data.max_rows=16",
            "data.val_rows=4", "data.max_len=40", f"data.cache_dir={out}/data", "train.steps=4", "train.batch_size=2",
            "train.ckpt_every=2", "train.log_every=1", "train.eval_every=100", "optim.warmup_steps=1", "draft=dflash",
            "draft.config.layer_ids=[1,2,3]", "draft.config.block_size=4", "draft.config.num_anchors=4"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=base + list(over))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("dflash_target")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def test_recipe_resume_after_kill_equals_uninterrupted(target_dir, tmp_path):
    """Random anchors are redrawn every step from the checkpointed RNG: a resumed run is bit-identical."""
    full = run(_cfg(target_dir, tmp_path / "a"))
    assert "acc_0" in full["val"] and full["val"]["sim_tau"] >= 1.0
    assert run(_cfg(target_dir, tmp_path / "b", "train.stop_after=3"))["stopped_at"] == 3
    run(_cfg(target_dir, tmp_path / "b"))
    a = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and "embed_tokens" not in a and "lm_head" not in a  # frozen target copies
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def _same_proposals(d1, d2, target, prompts):
    for p in prompts:
        a, b = DFlashProposer(d1), DFlashProposer(d2)
        out = target(p[:, :-1], layer_ids=d1.layer_ids)
        hid = {k: v.float() for k, v in out.hidden.items()}
        s = Sampling()
        a.begin(p, hid, s)
        b.begin(p, hid, s)
        assert torch.equal(a.propose(9).tokens, b.propose(9).tokens)


@pytest.mark.parametrize("vocab", [None, 200])
def test_export_round_trips_and_refusals(target_dir, tmp_path, vocab):
    over = [] if vocab is None else [f"draft.config.draft_vocab_size={vocab}"]
    run(_cfg(target_dir, tmp_path / "run", "train.steps=2", *over))
    target = FrozenTarget.from_pretrained(str(target_dir))
    d, meta = registry.load_drafter(tmp_path / "run" / "final", target)
    prompts = [torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    fmts = ["dflash_speculators"] + (["dflash_zlab"] if vocab is None else [])
    for fmt in fmts:
        out = export(d, fmt, tmp_path / fmt, target, meta=meta)
        assert validate(out, None, target) == fmt
        _same_proposals(d, load_export(out, target), target, prompts)
    if vocab is not None:
        with pytest.raises(ExportError, match="no draft vocabulary"):
            export(d, "dflash_zlab", tmp_path / "z", target, meta=meta)
        return
    import json

    def broken(fmt, edit):
        src = tmp_path / fmt
        dst = tmp_path / f"{fmt}_bad"
        if dst.exists():
            import shutil
            shutil.rmtree(dst)
        import shutil
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
        return dst

    def z_ids(c, ids):
        c["dflash_config"]["target_layer_ids"] = ids

    cases = [
        ("dflash_speculators", lambda c: c.update(mask_token_id=10**6), "mask_token_id"),
        ("dflash_zlab", lambda c: c["dflash_config"].update(mask_token_id=-1), "mask_token_id"),
        # ids in the other convention: z-lab file given vLLM-capture ids (off by one against the sidecar)
        ("dflash_zlab", lambda c: z_ids(c, [1, 2, 3]), "off by one|out of range"),
        ("dflash_speculators", lambda c: c.update(aux_hidden_state_layer_ids=[0, 1, 2]), "off by one"),
        ("dflash_speculators", lambda c: c.update(aux_hidden_state_layer_ids=[2, 3, 9]), "out of range"),
        ("dflash_speculators", lambda c: c.update(aux_hidden_state_layer_ids=[1, 2]), "fc.weight has shape|off by"),
        ("dflash_speculators", lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4),
         "disagrees with block_size"),
        ("dflash_speculators", lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
        # vLLM 0.32 reads false as causal in-block attention on every draft layer (tests/engines serve it)
        ("dflash_speculators", lambda c: c.update(sliding_window_non_causal=False), "sliding_window_non_causal"),
    ]
    assert json.loads((tmp_path / "dflash_speculators" / "config.json").read_text())["sliding_window_non_causal"]
    for fmt, edit, msg in cases:
        with pytest.raises(ExportError, match=msg):
            validate(broken(fmt, edit), fmt, target)


def test_qwen3_target_trains_decodes_losslessly_and_exports(tmp_path):
    """Another family: Qwen3 (QK-norm, GQA, explicit head_dim) — 2 training steps, lossless greedy decode,
    both exports round-trip."""
    from models.core.tokenizer import train_tokenizer
    from tests.conftest import TINY_TEXTS

    tok = train_tokenizer(TINY_TEXTS, vocab_size=300)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "qwen3")
    tok.save_pretrained(tmp_path / "qwen3")
    res = run(_cfg(tmp_path / "qwen3", tmp_path / "run", "train.steps=2"))
    assert "acc_0" in res["val"]
    target = FrozenTarget.from_pretrained(str(tmp_path / "qwen3"))
    d, meta = registry.load_drafter(tmp_path / "run" / "final", target)
    scramble(d)
    assert d.head_dim == 16 and d.num_key_value_heads == 2
    prompt = torch.tensor([tok("def add(a, b):\n    return", add_special_tokens=False)["input_ids"]])
    assert speculative_decode(target, DFlashProposer(d), prompt, 16).tokens == \
        decode_ar(target, prompt, 16).tokens
    for fmt in ("dflash_speculators", "dflash_zlab"):
        out = export(d, fmt, tmp_path / fmt, target, meta=meta)
        _same_proposals(d, load_export(out, target), target, [prompt])
