"""Prompt lookup in front of a model drafter (models/core/lookup.py ``LookupFirst``, EAGLE-3's ``lookup`` option).

What is checked:
- a round drafts the lookup's continuation when the context's last n >= min_ngram tokens occurred before, the
  model's proposal otherwise, and both see every accepted token;
- lossless: greedy output equals plain greedy decoding with both sources used (EAGLE-3 chain and tree behind
  it, B=1 and batched), and sampled output follows the target's distribution (χ²) with sampled model rounds
  and point-mass lookup rounds mixed;
- the eagle3_lookup / eagle3_tree_lookup variants build it, lookup=0 the plain proposer, a bad value is a
  one-line error.
"""

from __future__ import annotations

import pytest
import torch

from eval.decode.batch import speculative_decode_batch
from eval.decode.single import decode_ar, speculative_decode
from models import registry
from models.core.lookup import LookupFirst, PromptLookup, lookup_width, with_lookup
from models.core.proposal import Proposal, Sampling, batch_proposer
from models.methods.eagle3 import LOOKUP_TOKENS
from models.methods.eagle3.proposers import Eagle3ChainProposer, Eagle3TreeProposer
from tests.test_decode import MixedProposer, chi2_pvalue, drafters, exact_joint, sharp_tiny_llama, target  # noqa: F401


class Recorder:
    """A model proposer that drafts a fixed token and records what it was shown."""

    layer_ids: list[int] = []

    def __init__(self, token: int = 7):
        self.token, self.seen, self.proposed = token, [], 0

    def begin(self, tokens, hidden, sampling):
        self.seen = tokens[0].tolist()

    def accept(self, tokens, hidden):
        self.seen += tokens[0].tolist()

    def propose(self, max_depth: int) -> Proposal:
        self.proposed += 1
        return Proposal(tokens=torch.tensor([self.token]))


def test_lookup_drafts_where_the_context_repeats_and_the_model_elsewhere():
    model = Recorder()
    p = LookupFirst(model, PromptLookup(3, 3, min_ngram=2))
    p.begin(torch.tensor([[1, 2, 3, 4, 5, 9]]), {}, Sampling())
    assert p.propose(3).tokens.tolist() == [7] and p.lookup.matched == 0  # "5 9" never occurred before
    p.accept(torch.tensor([[1, 2]]), {})  # context ... 5 9 1 2: "1 2" occurred at the start, "9 1 2" did not
    assert p.propose(3).tokens.tolist() == [3, 4, 5] and p.lookup.matched == 2
    assert p.propose(2).tokens.tolist() == [3, 4]  # the round's depth budget caps it
    assert p.rounds == {"lookup": 2, "model": 1} and model.proposed == 1
    assert model.seen == [1, 2, 3, 4, 5, 9, 1, 2]  # the model saw the tokens the lookup's round accepted


def test_with_lookup_is_off_at_zero_and_checks_its_value():
    model = Recorder()
    assert with_lookup(model, 0, 4) is model
    p = with_lookup(model, 2, 4)
    assert isinstance(p, LookupFirst) and (p.lookup.min_ngram, p.lookup.max_ngram) == (2, 3)
    assert p.lookup.num_speculative_tokens == 4
    for bad in (-1, 4, "2", True, 1.5):
        with pytest.raises(ValueError, match="lookup must be 0") as e:
            with_lookup(model, bad, 4)
        assert "\n" not in str(e.value)


def _repetitive_prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    base = [torch.randint(3, 32, (1, 6 + i), generator=g) for i in range(3)]
    return [torch.cat([b, b, b[:, :3]], dim=1) for b in base]  # repeats: the lookup matches in early rounds


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_greedy_output_equals_plain_decoding_with_both_sources(target, drafters, kind):  # noqa: F811
    rounds = {"lookup": 0, "model": 0}
    for prompt in _repetitive_prompts():
        model = (Eagle3ChainProposer(drafters["eagle"], num_speculative_tokens=3) if kind == "chain" else
                 Eagle3TreeProposer(drafters["eagle"], depth=3, top_k=3, total_tokens=10))
        p = with_lookup(model, 1, 3)
        assert speculative_decode(target, p, prompt, 20).tokens == decode_ar(target, prompt, 20).tokens
        rounds = {k: rounds[k] + v for k, v in p.rounds.items()}
    assert rounds["lookup"] > 0 and rounds["model"] > 0


def test_batched_rows_behind_lookup_equal_plain_decoding(target, drafters):  # noqa: F811
    prompts = _repetitive_prompts()
    rows = [with_lookup(Eagle3ChainProposer(drafters["eagle"], num_speculative_tokens=3), 2, 3) for _ in prompts]
    batch = batch_proposer(rows, registry.proposer("eagle3")[1].batched)  # not the EAGLE-3 batch: row by row
    assert all(isinstance(r, LookupFirst) for r in batch.rows)
    out = speculative_decode_batch(target, batch, [p[0] for p in prompts], 16)
    assert [r.tokens for r in out] == [decode_ar(target, p, 16).tokens for p in prompts]


def test_sampled_output_follows_the_target_with_lookup_rounds_mixed_in():
    """Sampled chains and trees from q0 (MixedProposer) behind a lookup over a 3-token vocabulary, which matches
    often: the joint of 4 sampled tokens must be the target's."""
    from models.core.target import FrozenTarget

    small = FrozenTarget(sharp_tiny_llama(5))
    prompt = torch.tensor([[0, 2, 1, 0, 2, 1, 0]])
    exact = exact_joint(small, prompt, 4, Sampling(0.9))
    gen = torch.Generator().manual_seed(11)
    p = with_lookup(MixedProposer(torch.tensor([0.5, 0.2, 0.3]), seed=3), 2, 2)
    samples = [tuple(speculative_decode(small, p, prompt, 4, sampling=Sampling(0.9, generator=gen)).tokens)
               for _ in range(500)]
    assert p.rounds["lookup"] > 100 and p.rounds["model"] > 100, p.rounds
    assert chi2_pvalue(samples, exact) > 1e-3


def test_the_lookup_variants_build_it(target, drafters):  # noqa: F811
    d = drafters["eagle"]
    table = registry.variants()
    assert table["eagle3_lookup"] == {"method": "eagle3", "lookup": 2}
    assert table["eagle3_tree_lookup"] == {"method": "eagle3_tree", "lookup": 2}
    make, o = registry.make_proposer_factory("eagle3", d, target, options={"lookup": 2})
    assert isinstance(make(None), LookupFirst) and make(None).lookup.num_speculative_tokens == LOOKUP_TOKENS
    # the chain's K varies (the dynamic-K policy), the lookup's length stays its own
    assert make(2).model.num_speculative_tokens == 2 and make(2).lookup.num_speculative_tokens == LOOKUP_TOKENS
    assert lookup_width(o) == LOOKUP_TOKENS  # the verification width the cost tables cover
    make, o = registry.make_proposer_factory("eagle3", d, target)
    assert isinstance(make(None), Eagle3ChainProposer) and lookup_width(o) == 0  # lookup 0: the chain itself
    opts = {"lookup": 1, "lookup_tokens": 5, "total_tokens": 8, "depth": 2, "top_k": 2}
    make, _ = registry.make_proposer_factory("eagle3_tree", d, target, options=opts)
    tree = make(None)  # a lookup chain longer than the tree is deep
    assert isinstance(tree.model, Eagle3TreeProposer) and tree.lookup.num_speculative_tokens == 5
    with pytest.raises(ValueError, match="lookup must be 0"):
        registry.make_proposer_factory("eagle3", d, target, options={"lookup": 9})
