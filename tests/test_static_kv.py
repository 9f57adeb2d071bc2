"""The static KV cache and its compiled step (models/core/static_kv.py, eval/bench/decode_step.py): the same greedy
tokens as the eager engine for AR and every proposer, chains and trees; the cache's bookkeeping; clear refusals."""

from __future__ import annotations

import pytest
import torch

from eval.bench.decode_step import choose_decode_step
from eval.decode.ladder import new_cache
from eval.decode.single import decode_ar, speculative_decode
from models.core.packed import available as packed_available
from models.core.packed import pack_linears
from models.core.proposal import Sampling
from models.core.static_kv import StaticKV, bucket
from models.core.syncs import HostSyncCounter
from models.core.target import FrozenTarget
from tests.conftest import make_tiny_llama
from tests.test_decode import PROPOSERS, V, drafters, make_proposer, prompts, target  # noqa: F401 (fixtures)
from tests.test_host_syncs import BUDGET, SETUP


@pytest.fixture()
def static_target(target):  # noqa: F811 (fixture imported above)
    """The module's tiny target with an untraced static step, handed back eager afterwards."""
    target.use_static(capacity=256, backend=None)
    yield target
    target.use_eager()


def test_padded_widths_fall_in_buckets_and_prefill_stays_eager():
    assert [bucket(w) for w in (1, 2, 5, 8, 9, 16)] == [1, 8, 8, 8, 16, 16]
    assert bucket(17) is None
    assert [bucket(w, (1, 5, 8, 16)) for w in (2, 5, 6)] == [5, 5, 8]


def test_each_chain_verifies_at_its_own_width(target, drafters):  # noqa: F811
    """eval adds every chain's K + 1 rows (and a lookup's tokens + 1) to the buckets: a K=4 chain's rounds run at 5
    rows, its budget-cut last rounds padded to 5, never to 8; the tokens stay AR's."""
    from eval.bench.decode_step import chain_widths
    from eval.bench.setup import Method

    ms = [Method("ar", "ar"), Method("ngram", "ngram", num_speculative_tokens=3), Method("tree", "eagle3_tree"),
          Method("eagle3_lookup", "eagle3", num_speculative_tokens=4, options={"lookup": 2, "lookup_tokens": 6})]
    assert chain_widths(ms) == [4, 5, 7]
    p = prompts()[2]  # 22 tokens: the prefill runs eagerly, every trace below is a round's
    ref = decode_ar(target, p, 19).tokens
    target.use_static(capacity=256, backend="eager", widths=[5])
    try:
        got = speculative_decode(target, make_proposer("eagle3_chain", target, drafters), p, 19).tokens
        assert got == ref and target.static.widths == (1, 5, 8, 16)
        assert any(k.startswith("w5") for k in target.static.compile_s)
        assert not any(k.startswith("w8") for k in target.static.compile_s)
    finally:
        target.use_eager()


def test_ar_over_the_static_cache_emits_the_eager_tokens(target, static_target):  # noqa: F811
    for p in prompts():
        static = decode_ar(static_target, p, 20).tokens
        target.use_eager()
        assert static == decode_ar(target, p, 20).tokens
        target.use_static(capacity=256, backend=None)


@pytest.mark.parametrize("name", PROPOSERS)
def test_every_proposer_over_the_static_cache_emits_plain_greedy_decoding(name, target, drafters):  # noqa: F811
    """Chains (padded to their width bucket) and trees (their mask widened to the capacity; wide trees eager) alike."""
    want = [decode_ar(target, p, 24).tokens for p in prompts()]
    target.use_static(capacity=256, backend=None)
    try:
        for p, ref in zip(prompts(), want):
            res = speculative_decode(target, make_proposer(name, target, drafters), p, 24)
            assert res.tokens == ref, name
            assert isinstance(new_cache(target), StaticKV)
    finally:
        target.use_eager()


def test_one_traced_graph_serves_ar_chains_and_trees(target, drafters):  # noqa: F811
    """torch.compile(fullgraph=True) traces the step (the ``eager`` backend: the graph without inductor's code
    generation): hidden states recorded by hooks, padded chains and masked trees give the eager engine's tokens."""
    want = [decode_ar(target, p, 16).tokens for p in prompts(2)]
    static = target.use_static(capacity=256, backend="eager")
    try:
        for name in ("eagle3_chain", "eagle3_tree"):
            for p, ref in zip(prompts(2), want):
                assert speculative_decode(target, make_proposer(name, target, drafters), p, 16).tokens == ref
        assert decode_ar(target, prompts(2)[0], 16).tokens == want[0]
        assert any(t.startswith("w1") for t in static.compile_s)
        assert any(t.startswith("w8/") for t in static.compile_s)  # the chain's K+1 = 5 rows, with hidden states
        assert any("+mask" in t for t in static.compile_s)  # a tree
    finally:
        target.use_eager()


def test_static_forward_returns_the_eager_logits_and_hidden_states(static_target):
    x = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(5))
    ids = [0, 2, 4]
    eager_cache = new_cache(static_target, rows=2)  # a DynamicCache: the target's own forward
    cache = new_cache(static_target)
    for part in (x[:, :-3], x[:, -3:-1], x[:, -1:]):  # a 21-token prefill (eager), 2 rows padded to 8, one row
        a = static_target(part, layer_ids=ids, cache=cache, use_cache=True)
        b = static_target(part, layer_ids=ids, cache=eager_cache, use_cache=True)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        for k in ids:
            torch.testing.assert_close(a.hidden[k], b.hidden[k], rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == x.shape[1] == eager_cache.get_seq_length()


def test_two_targets_traced_in_one_process_each_run_their_own_weights():
    """The traces drop the guards on the weights (frozen_weight_guards): the instance serial still keeps one target's
    traces from serving another of the same shapes, before and after the other traced."""
    x = torch.randint(3, V, (1, 9), generator=torch.Generator().manual_seed(2))
    a, b = (FrozenTarget(make_tiny_llama(V, layers=2, hidden=32, seed=s)) for s in (3, 4))
    want = {}
    for t in (a, b):
        want[id(t)] = t(x, use_cache=False).logits[:, -1]
        t.use_static(capacity=256, backend="eager")
    for t in (a, b, a):
        cache = new_cache(t)
        t(x[:, :-1], cache=cache, use_cache=True)
        got = t(x[:, -1:], cache=cache, use_cache=True).logits[:, -1]  # one row: the traced step
        torch.testing.assert_close(got, want[id(t)], rtol=1e-5, atol=1e-5)


def test_crop_moves_where_the_next_forward_writes(static_target):
    x = prompts()[0]
    cache = new_cache(static_target)
    static_target(x, cache=cache, use_cache=True)
    n = cache.get_seq_length()
    static_target(torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
    cache.crop(-3)
    assert cache.get_seq_length() == n
    assert all(int(layer.cumulative_length) == n for layer in cache.layers)
    again = static_target(torch.tensor([[9]]), cache=cache, use_cache=True).logits
    fresh = new_cache(static_target)
    static_target(x, cache=fresh, use_cache=True)
    torch.testing.assert_close(again, static_target(torch.tensor([[9]]), cache=fresh, use_cache=True).logits)


@pytest.mark.parametrize("name", ["eagle3_chain", "eagle3_tree"])
def test_the_static_cache_adds_no_host_sync_to_a_round(name, static_target, drafters):  # noqa: F811
    """AR within its setup syncs; a speculative round within the eager engine's budget (tests/test_host_syncs.py):
    lengths live on the host, so padding, cropping and widening masks read nothing back."""
    p = prompts()[0]
    with HostSyncCounter() as c:
        decode_ar(static_target, p, 24)
    assert c.total <= SETUP, dict(c.by_op)
    with HostSyncCounter(where=True) as c:
        res = speculative_decode(static_target, make_proposer(name, static_target, drafters), p, 24)
    assert res.rounds > 0 and (c.total - SETUP) / res.rounds <= BUDGET[name][0], c.where.most_common(4)


def test_capacity_grows_for_a_longer_decode_and_a_full_cache_is_one_clear_error(static_target):
    static = static_target.static
    cache = static.new_cache(300)
    assert static.capacity == 512 and cache.capacity == 512
    small = static_target.use_static(capacity=16, backend=None).new_cache()
    static_target(torch.randint(3, V, (1, 12)), cache=small, use_cache=True)
    small.set_length(250)  # capacity rounds up to 256: 2 rows padded to 8 no longer fit
    with pytest.raises(ValueError, match="static KV cache full: 250 \\+ 8 entries past its capacity 256"):
        static_target(torch.tensor([[5, 6]]), cache=small, use_cache=True)


def test_batches_keep_the_eager_engine_and_a_static_cache_refuses_rows(static_target):
    assert not isinstance(new_cache(static_target, rows=2), StaticKV)
    with pytest.raises(ValueError, match="one row"):
        static_target(torch.randint(3, V, (2, 4)), cache=new_cache(static_target), use_cache=True)


def test_a_target_without_a_static_step_decodes_eagerly_and_says_why():
    t = FrozenTarget(make_tiny_llama(64, layers=2, hidden=32, seed=3))
    t.model.config.is_encoder_decoder = True  # what static_unsupported refuses (sliding windows it now takes)
    try:
        rec = choose_decode_step(t, "auto", 256)
        assert rec["chosen"] == "eager" and "encoder-decoder" in rec["why"] and t.static is None
        with pytest.raises(ValueError, match="decode_step=compiled: the target cannot decode over a static cache"):
            choose_decode_step(t, "compiled", 256)
    finally:
        t.model.config.is_encoder_decoder = False
    with pytest.raises(ValueError, match="decode_step='fast' not understood"):
        choose_decode_step(t, "fast", 256)


def test_auto_races_the_one_token_steps_and_records_its_choice():
    t = FrozenTarget(make_tiny_llama(64, layers=2, hidden=32, seed=3))
    rec = choose_decode_step(t, "auto", 200, prefix_len=16, backend="eager")
    assert rec["chosen"] in ("eager", "compiled") and rec["eager_ms"] > 0 and rec["compiled_ms"] > 0
    assert (t.static is not None) == (rec["chosen"] == "compiled")
    assert t.model.draftsmith_decode_step is rec and "w1" in rec["compile_s"]
    assert rec["ratio"] == pytest.approx(rec["compiled_ms"] / rec["eager_ms"], rel=0.5)
    assert choose_decode_step(t, "eager", 200) == {"mode": "eager", "chosen": "eager"} and t.static is None


@pytest.mark.skipif(not packed_available(), reason="this torch build has no oneDNN linear ops")
def test_a_target_with_packed_linears_races_their_two_gemms_and_decodes_with_the_winner():
    """Packed linears can call oneDNN's packed GEMM or inductor's own in the compiled step: ``compiled`` races the two
    (no eager), ``auto`` all three; the step kept is the winner's, and it decodes AR's greedy tokens."""
    model = make_tiny_llama(64, layers=2, hidden=32, seed=3)
    ref = decode_ar(FrozenTarget(model), torch.tensor([[3, 9, 4, 17]]), 12).tokens
    assert pack_linears(model) > 0
    t = FrozenTarget(model)
    rec = choose_decode_step(t, "compiled", 200, prefix_len=16, backend="eager")
    assert rec["chosen"] == "compiled" and rec["linears"] in ("packed", "plain") and "eager_ms" not in rec
    assert rec["compiled_ms"] > 0 and rec["compiled_plain_ms"] > 0 and "compiled_gemv_ms" not in rec  # fp32
    assert t.static.linears == rec["linears"]
    assert decode_ar(t, torch.tensor([[3, 9, 4, 17]]), 12).tokens == ref
    rec = choose_decode_step(t, "auto", 200, prefix_len=16, backend="eager")
    assert {"eager_ms", "compiled_ms", "compiled_plain_ms", "ratio"} <= set(rec)
    assert rec["linears"] in ("packed", "plain")
    assert (t.static is None) == (rec["chosen"] == "eager")
    assert decode_ar(t, torch.tensor([[3, 9, 4, 17]]), 12).tokens == ref
    t.use_eager()


def test_a_timed_decode_that_compiled_a_new_trace_is_run_again():
    """Compile seconds are not decoding: the benchmark's timed decode repeats itself when the static step traced a
    new width during it, and keeps the second run (the same tokens); one with nothing new runs once."""
    from eval.bench.benchmark import _decode_timed
    from eval.bench.setup import BenchSettings, Method

    t = FrozenTarget(make_tiny_llama(64, layers=2, hidden=32, seed=3))
    t.use_static(capacity=256, backend="eager")
    calls = []

    def decode(tgt, proposer, ids, n, eos_id=None, sampling=None):
        calls.append(len(tgt.static.compile_s))
        return decode_ar(tgt, ids, n, eos_id=eos_id, sampling=sampling)
    m = Method("ar_counted", "ngram", decode=decode)
    s = BenchSettings(max_new_tokens=6)
    x = torch.tensor([[3, 9, 4, 17]])
    first = _decode_timed(t, m, None, x, s, 0.0, None, None)
    traced = calls[1]  # the prompt's width and w1, traced in the first; the second one is timed
    assert calls == [0, traced] and traced > 0 and first.tokens == decode_ar(t, x, 6).tokens
    _decode_timed(t, m, None, x, s, 0.0, None, None)
    assert calls == [0, traced, traced]
    t.use_eager()


def test_sampled_decoding_over_the_static_cache_repeats_the_eager_draws(target, drafters):  # noqa: F811
    """T=1 with one seed: the same forward values (fp32) give the same draws, so the same tokens."""
    p = prompts()[2]
    ref = speculative_decode(target, make_proposer("eagle3_chain", target, drafters), p, 20,
                             sampling=Sampling(1.0, generator=torch.Generator().manual_seed(7))).tokens
    target.use_static(capacity=256, backend=None)
    try:
        got = speculative_decode(target, make_proposer("eagle3_chain", target, drafters), p, 20,
                                 sampling=Sampling(1.0, generator=torch.Generator().manual_seed(7))).tokens
    finally:
        target.use_eager()
    assert got == ref


def test_results_md_says_which_step_decoded_and_why():
    from eval.bench.report import _decode_step_md

    rec = {"mode": "auto", "chosen": "compiled", "eager_ms": 98.1, "compiled_ms": 66.7, "rounds": 5,
           "compile_s": {"w1": 73.2, "w8/2/15/27": 80.4}}
    line = _decode_step_md({"env": {"decode_step": rec}})[1]
    assert line.startswith("Decoding step: **compiled** (`decode_step=auto`; one-token step 66.7 ms compiled vs "
                           "98.1 ms eager")
    assert "w1 73, w8/2/15/27 80" in line
    why = _decode_step_md({"env": {"decode_step": {"mode": "auto", "chosen": "eager", "why": "it has sliding"}}})[1]
    assert why == "Decoding step: **eager** (`decode_step=auto`; it has sliding)."
    assert _decode_step_md({"env": {}}) == []
