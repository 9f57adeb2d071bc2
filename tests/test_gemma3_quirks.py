"""What Gemma's architecture changes for drafting, on tiny models built in code (issue #49 item 7).

- Sliding-window attention: a verified block that straddles the window's edge, cut short inside it (KV rollback), for
  a chain (plain causal attention, HF's own window) and a tree (our 4D mask, which must carry the window itself),
  on the eager engine's growing cache and on the static cache of the compiled step.
- The embedding scale: Gemma multiplies embeddings by √hidden inside its model; EAGLE-3 reads the raw rows and
  normalises them, so the scale changes its logits only through the norm's eps, and not what it drafts.
- The tied head under a reduced draft vocabulary, and Gemma-2's final-logit soft-capping: the offline teacher (the
  feature cache's logits, full or at the draft ids) must be the logits the target itself computes.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from data.features import FeatureCache
from eval.decode.single import decode_ar, speculative_decode
from models.core.proposal import Proposal
from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.net import Eagle3Drafter
from models.methods.eagle3.proposers import Eagle3ChainProposer
from tests.families import WINDOW, _config, make_family, make_tokenizer


@functools.cache
def gemma(family: str = "gemma3", tied: bool = False) -> FrozenTarget:
    if not tied:
        return FrozenTarget(*make_family(family))
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(family)
    cfg = _config(family, tok, (len(tok) // 64 + 2) * 64)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    return FrozenTarget(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), tok)


class EdgeProposer:
    """Drafts the reference continuation, wrong at the generated indices ``wrong_at``; ``branch`` adds a wrong
    sibling of the first draft, which makes every proposal a tree (verified through the 4D mask)."""

    layer_ids: list[int] = []

    def __init__(self, reference: list[int], k: int, wrong_at: set[int], vocab: int, branch: bool = False):
        self.ref, self.k, self.wrong_at, self.vocab, self.branch = reference, k, wrong_at, vocab, branch

    def begin(self, tokens, hidden, sampling):
        self.pos = 1

    def accept(self, tokens, hidden):
        self.pos += tokens.shape[1]

    def propose(self, max_depth: int) -> Proposal:
        n = min(self.k, max_depth)
        toks = [(t + 1) % self.vocab if self.pos + i in self.wrong_at else t
                for i, t in enumerate(self.ref[self.pos : self.pos + n])]
        if not self.branch or n == 0:
            return Proposal(tokens=torch.tensor(toks))
        parents = [-1] + list(range(n - 1)) + [-1]
        return Proposal(tokens=torch.tensor(toks + [(self.ref[self.pos] + 2) % self.vocab]),
                        parents=torch.tensor(parents))


def test_a_verified_block_across_the_window_edge_cut_inside_it():
    t = gemma()
    g = torch.Generator().manual_seed(0)
    p = WINDOW - 2  # the root sits at position p: the first block verifies positions p..p+5, across WINDOW
    prompt = torch.randint(3, len(t.tokenizer), (1, p), generator=g)
    n = 3 * WINDOW
    ref = decode_ar(t, prompt, n).tokens
    x = prompt
    for _ in range(n):  # no cache at all: what the window means
        x = torch.cat([x, t.model(x).logits[:, -1:].argmax(-1)], 1)
    assert ref == x[0, p:].tolist()
    # wrong at generated index 4 (position p + 4 = WINDOW + 2): the first round keeps 3 drafts that cross the edge
    # and rolls back the rest; later edges land inside blocks too (the window slides with every token)
    wrong = {4, WINDOW + 3, 2 * WINDOW + 1}
    for branch in (False, True):
        res = speculative_decode(t, EdgeProposer(ref, 5, wrong, t.vocab_size, branch=branch), prompt, n)
        assert res.tokens == ref, f"branch={branch}"
        assert res.accepted[0] == 3 and res.drafted[0] == 5 + branch


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "mistral"])
@pytest.mark.parametrize("backend", [None, "eager"])
def test_the_static_cache_keeps_the_window_across_its_edge(family, backend):
    """decode_step=compiled on a sliding-window target (models/core/static_kv.py ``static_cache``): every layer keeps
    every entry and the window lives in the mask, the model's own for chains and ``apply_window``'s for trees (per
    layer type for Gemma, one windowed mask for Mistral), widened to the capacity. Untraced and traced (``eager``:
    one graph per width), a chain and a tree across the edge give AR's tokens; without the window they would not."""
    t = gemma() if family == "gemma3" else FrozenTarget(*make_family(family))
    prompt = torch.randint(3, len(t.tokenizer), (1, WINDOW - 2), generator=torch.Generator().manual_seed(0))
    n = 3 * WINDOW
    ref = decode_ar(t, prompt, n).tokens
    t.use_static(capacity=256, backend=backend)
    try:
        assert decode_ar(t, prompt, n).tokens == ref
        for branch in (False, True):
            res = speculative_decode(t, EdgeProposer(ref, 5, {4, WINDOW + 3}, t.vocab_size, branch), prompt, n)
            assert res.tokens == ref and res.accepted[0] == 3, f"branch={branch}"
        assert {"w1", "w8", "w8+mask"} <= set(t.static.compile_s)  # the chain's and the tree's widths ran static
    finally:
        t.use_eager()
    unwindowed = copy.deepcopy(t.model)
    unwindowed.config.sliding_window = 10**6  # the control: the same weights, a window that never binds
    assert decode_ar(FrozenTarget(unwindowed, t.tokenizer), prompt, n).tokens != ref


def _eagle(t: FrozenTarget, embed: torch.Tensor, vd: int) -> Eagle3Drafter:
    torch.manual_seed(3)
    d2t, t2d = build_draft_vocab(torch.arange(t.vocab_size).flip(0).float(), vd)
    return Eagle3Drafter(Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=vd, ttt_steps=2), t.model.config,
                         embed, d2t, t2d).eval()


def test_eagle3_drafts_the_same_whatever_the_embedding_scale():
    t = gemma()
    raw = t.embed.weight.detach().clone()
    scaled = _eagle(t, raw * t.model.config.hidden_size ** 0.5, 64)
    plain = _eagle(t, raw, 64)
    ids = torch.randint(3, len(t.tokenizer), (2, 12), generator=torch.Generator().manual_seed(1))
    hidden = t(ids, layer_ids=plain.layer_ids).hidden
    for a, b in zip(plain.ttt_forward(ids, hidden), scaled.ttt_forward(ids, hidden)):
        # equal but for the RMSNorm's eps, which weighs more against the smaller rows
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_tied_head_reduced_draft_vocabulary_decodes_losslessly():
    t = gemma(tied=True)
    head = t.model.get_output_embeddings().weight
    assert head.data_ptr() == t.embed.weight.data_ptr()  # one matrix: the embedding is the head
    drafter = _eagle(t, t.embed.weight.detach().clone(), 48)
    prompt = torch.randint(3, len(t.tokenizer), (1, WINDOW + 3), generator=torch.Generator().manual_seed(2))
    ref = decode_ar(t, prompt, 2 * WINDOW).tokens
    res = speculative_decode(t, Eagle3ChainProposer(drafter, num_speculative_tokens=3), prompt, 2 * WINDOW)
    assert res.tokens == ref


def _offline_teacher_is_the_targets_logits(t: FrozenTarget, tmp_path):
    g = torch.Generator().manual_seed(4)
    rows = [{"input_ids": torch.randint(3, len(t.tokenizer), (n,), generator=g).tolist()} for n in (9, 14, 11)]
    cache = FeatureCache(tmp_path, t, rows, [1, 2, 3], dtype="float32", shard_rows=2)
    cache.build(show_progress=False)
    width = max(len(r["input_ids"]) for r in rows)
    _, logits = cache.batch([0, 1, 2], width)
    draft_ids = torch.tensor([0, 5, 7, 40, t.vocab_size - 1])
    _, teacher = cache.batch([0, 1, 2], width, draft_ids)
    for j, r in enumerate(rows):
        n = len(r["input_ids"])
        want = t(torch.tensor([r["input_ids"]])).logits[0].float()
        torch.testing.assert_close(logits[j, :n], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(teacher.logits[j, :n], want[:, draft_ids], rtol=1e-4, atol=1e-4)
        assert teacher.top[j, :n].tolist() == want.argmax(-1).tolist()


def test_offline_teacher_of_a_soft_capped_target_is_soft_capped(tmp_path):
    t = FrozenTarget(*make_family("gemma2"))
    cap = t.model.config.final_logit_softcapping  # 30: the target's logits are cap * tanh(head / cap)
    with torch.no_grad():  # a head whose raw logits reach past the cap, so capping them matters
        t.model.get_output_embeddings().weight.mul_(300)
    raw = t.model.get_output_embeddings()(t(torch.tensor([[5, 9, 11]]), layer_ids=[t.num_layers]).hidden[
        t.num_layers])
    assert raw.abs().max() > 2 * cap
    _offline_teacher_is_the_targets_logits(t, tmp_path)


def test_offline_teacher_of_a_tied_head(tmp_path):
    _offline_teacher_is_the_targets_logits(gemma(tied=True), tmp_path)
