"""The T=0 lossless check under low precision (eval/bench/precision.py): a bf16 target must pass it without hiding a
real divergence.

A tiny Llama built in code, run in bfloat16 and float32. A near-tie is made exact: token ``twin``'s lm_head row
is a copy of token ``a``'s, so wherever AR emits ``a`` the two logits are equal (argmax takes the lower id) and a
method that emits ``twin`` there is as right as AR — what a numeric flip between the verify-width forward and
AR's one-token step produces at a near-tie. In bf16 that divergence is tolerated and still reported with its
gap; in fp32 the check stays exact and fails it; a broken verifier and a perturbed token fail in bf16 too.
"""

from __future__ import annotations

import json

import pytest
import torch

from eval.bench.benchmark import all_lossless, run_benchmark, write_json
from eval.bench.precision import measure_noise
from eval.bench.report import console_summary, markdown
from eval.bench.setup import BenchSettings, Method, Prompt, build_methods
from eval.decode import ladder
from eval.decode.single import decode_ar, speculative_decode
from models.core.target import FrozenTarget
from tests.conftest import make_tiny_llama

MAX_NEW = 10
TEXTS = ["def add(a, b):\n    return a + b\ndef add(a, b):\n", "for i in range(10):\n    print(i * i)\nfor i in",
         "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\nimport"]


def _settings() -> BenchSettings:
    return BenchSettings(max_new_tokens=MAX_NEW, temperatures=[0], repetitions=1, warmup=0, batch_sizes=[],
                         cost_reps=1, threads=1, progress=False, peers=False)


def _build(tok, dtype: torch.dtype):
    """(target in ``dtype``, prompts, a, twin): lm_head row twin = row a, a emitted by AR, twin never."""
    m = make_tiny_llama(len(tok))
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # a wide logit spread: distinct tokens are far apart, unlike a numeric flip
    t = FrozenTarget(m.to(dtype), tok)
    prompts = [Prompt(tok(x, add_special_tokens=False)["input_ids"], "code", str(i)) for i, x in enumerate(TEXTS)]
    ids = [torch.tensor([p.ids]) for p in prompts]
    ar = [decode_ar(t, x, MAX_NEW).tokens for x in ids]
    a = ar[0][2]
    twin = next(i for i in range(t.vocab_size - 1, a, -1) if all(i not in r for r in ar))
    with torch.no_grad():
        m.lm_head.weight[twin] = m.lm_head.weight[a]
    assert [decode_ar(t, x, MAX_NEW).tokens for x in ids] == ar  # ties go to the lower id: AR unchanged
    return t, prompts, a, twin, ar


def _swap(a: int, twin: int):
    """A method exact up to the tie: its tokens are speculative decoding's up to the first ``a``, emitted as
    ``twin`` (the other side of an exact tie), then the target's greedy continuation of that prefix."""
    def run(target, proposer, ids, max_new, *args, **kw):
        r = speculative_decode(target, proposer, ids, max_new, *args, **kw)
        if a in r.tokens:
            k = r.tokens.index(a)
            head = [*r.tokens[:k], twin]
            ctx = torch.cat([ids, torch.tensor([head], dtype=ids.dtype)], dim=1)
            rest = decode_ar(target, ctx, max_new - len(head)).tokens if len(head) < max_new else []
            r.tokens[:] = head + list(rest)
        return r
    return run


def _methods(t: FrozenTarget, a: int, twin: int) -> list[Method]:
    # K = 15: verify forwards 16 tokens wide, where CPU bf16 kernels differ from the one-token step (noise > 0)
    methods, _ = build_methods(t, ["ngram"], options={"ngram": {"num_speculative_tokens": 15}})
    ng = methods[1]
    return [*methods, Method("near_tie", "ngram", ng.make, num_speculative_tokens=ng.num_speculative_tokens,
                             options=ng.options, decode=_swap(a, twin))]


def test_noise_is_measured_per_dtype(tiny_tokenizer):
    m = make_tiny_llama(len(tiny_tokenizer))
    ids = [torch.tensor([tiny_tokenizer(x, add_special_tokens=False)["input_ids"]]) for x in TEXTS]
    fp32 = measure_noise(FrozenTarget(m, tiny_tokenizer), ids, widths=[1, 2, 4, 16])
    bf16 = measure_noise(FrozenTarget(m.to(torch.bfloat16), tiny_tokenizer), ids, widths=[1, 2, 4, 16])
    assert fp32["positions"] == bf16["positions"] == (2 + 4 + 16) * len(TEXTS) and bf16["width"] == 16
    assert fp32["noise"] < 1e-4 < bf16["noise"]


def test_bf16_tolerates_a_near_tie_and_reports_it(tiny_tokenizer, tmp_path):
    t, prompts, a, twin, ar = _build(tiny_tokenizer, torch.bfloat16)
    r = run_benchmark(t, _methods(t, a, twin), prompts, _settings())
    p = r["precision"]
    assert p["dtype"] == "bfloat16" and not p["exact"] and p["noise"] > 0 and p["threshold"] == 2 * p["noise"]
    nt = r["methods"]["near_tie"]
    assert nt["lossless"] is True and nt["n_mismatches"] == 0 and nt["mismatches"] == []
    assert nt["n_tolerated"] == sum(a in x for x in ar) >= 1
    for d in nt["divergences"]:  # every one reported, with the gap that excused it
        assert d["tolerated"] and (d["ar_token"], d["token"]) == (a, twin)
        assert d["gap"] <= d["threshold"] == p["threshold"] and d["top2_gap"] <= d["gap"]
    assert r["methods"]["ngram"]["lossless"] and r["lossless"] is True and all_lossless(r)
    md = markdown(r)
    assert "Lossless within bfloat16 noise" in md and "tolerated (near-tie)" in md and "**FAIL**" not in md
    assert "near-ties within bfloat16 noise tolerated" in console_summary(r)
    back = json.loads(write_json(r, tmp_path / "r.json").read_text())
    assert back["methods"]["near_tie"]["divergences"][0]["noise"] == pytest.approx(p["noise"])


def test_fp32_stays_exact(tiny_tokenizer):
    t, prompts, a, twin, _ = _build(tiny_tokenizer, torch.float32)
    r = run_benchmark(t, _methods(t, a, twin), prompts, _settings())
    assert r["precision"]["exact"] is True and r["precision"]["threshold"] == 0
    nt = r["methods"]["near_tie"]
    assert nt["lossless"] is False and nt["n_tolerated"] == 0 and nt["n_mismatches"] >= 1
    assert all(d["gap"] == 0 and not d["tolerated"] for d in nt["divergences"])  # the tie is exact, still a failure
    assert "LOSSLESS CHECK FAILED for near_tie" in markdown(r)


def _accept_everything(proposal, logits, sampling):
    n = proposal.size
    return list(range(n)), int(logits[n].argmax())


def _perturb_last(target, proposer, ids, max_new, *args, **kw):
    r = speculative_decode(target, proposer, ids, max_new, *args, **kw)
    r.tokens[-1] = (r.tokens[-1] + 1) % target.vocab_size
    return r


def test_bf16_still_flags_a_broken_verifier_and_a_wrong_token(tiny_tokenizer, monkeypatch):
    t, prompts, a, twin, _ = _build(tiny_tokenizer, torch.bfloat16)
    methods = _methods(t, a, twin)[:2]
    ng = methods[1]
    methods.append(Method("perturbed", "ngram", ng.make, num_speculative_tokens=ng.num_speculative_tokens,
                          options=ng.options, decode=_perturb_last))
    monkeypatch.setattr(ladder, "accept_proposal", _accept_everything)
    r = run_benchmark(t, methods, prompts, _settings())
    assert r["methods"]["ar"]["lossless"] is True  # AR never verifies
    for name in ("ngram", "perturbed"):
        m = r["methods"][name]
        assert m["lossless"] is False and m["n_mismatches"] >= 1, name
        assert all(d["gap"] > d["threshold"] and not d["tolerated"] for d in m["mismatches"]), name
    assert r["lossless"] is False and not all_lossless(r)
    md = markdown(r)
    assert "LOSSLESS CHECK FAILED" in md and "**FAIL**" in md


def _swap_then_break(a: int, twin: int):
    """The near-tie method, whose last token is then wrong: after a first divergence that AR's comparison tolerates,
    only the certificate (every token on the run's own prefix) can see it."""
    swap = _swap(a, twin)

    def run(target, proposer, ids, max_new, *args, **kw):
        r = swap(target, proposer, ids, max_new, *args, **kw)
        if twin in r.tokens and r.tokens.index(twin) < len(r.tokens) - 1:
            r.tokens[-1] = (r.tokens[-1] + 1) % target.vocab_size
        return r
    return run


def test_the_certificate_checks_every_token_after_a_first_divergence(tiny_tokenizer):
    t, prompts, a, twin, ar = _build(tiny_tokenizer, torch.bfloat16)
    methods = _methods(t, a, twin)
    near = methods[-1]
    methods.append(Method("near_tie_broken", "ngram", near.make, num_speculative_tokens=near.num_speculative_tokens,
                          options=near.options, decode=_swap_then_break(a, twin)))
    r = run_benchmark(t, methods, prompts, _settings())
    ok, bad = r["methods"]["near_tie"], r["methods"]["near_tie_broken"]
    assert ok["lossless"] is True
    cert = next(e["certificate"] for e in r["runs"] if e["method"] == "near_tie")
    assert cert["tokens_checked"] == cert["tokens_emitted"] == MAX_NEW * len(prompts) and cert["pass"]
    # AR's comparison judges only the first divergence (the tolerated tie); the broken last token is the certificate's
    assert all(d["tolerated"] for d in bad["divergences"] if d["where"] == "single")
    broken = [d for d in bad["mismatches"] if d["where"] == "certificate"]
    assert bad["lossless"] is False and broken and all(d["first_diff"] == MAX_NEW - 1 for d in broken)


def test_fp32_logits_on_a_bf16_target_do_not_tie_on_rounding(tiny_tokenizer):
    """Two lm_head rows whose logits differ by less than bf16 resolves: bf16 logits tie, the fp32 head's do not;
    ``.weight`` is still the bf16 parameter drafters share, and an fp32 model is left alone."""
    from models.core.packed import Fp32Head, fp32_logits

    m = make_tiny_llama(len(tiny_tokenizer)).to(torch.bfloat16)
    t = FrozenTarget(m, tiny_tokenizer)
    x = torch.tensor([tiny_tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        h = m.model(x).last_hidden_state[0, -1].float()
        w = m.lm_head.weight
        w[1] = w[0]
        w[1, h.abs().argmax()] += torch.sign(h[h.abs().argmax()]) * 2 ** -6 * w[0].abs().max()  # a tiny nudge up
        assert t(x).logits.dtype == torch.bfloat16
    weight = m.lm_head.weight
    assert fp32_logits(m) and isinstance(m.get_output_embeddings(), Fp32Head) and not fp32_logits(m)
    z = t(x).logits[0, -1]
    assert z.dtype == torch.float32 and m.get_output_embeddings().weight is weight
    torch.testing.assert_close(z, h @ weight.float().T, rtol=1e-5, atol=1e-4)
    assert z[1] > z[0]
    assert not fp32_logits(make_tiny_llama(len(tiny_tokenizer)))


def test_the_sampled_rank_test_passes_true_draws_and_fails_a_sharper_sampler():
    from eval.bench.certificate import chi2_uniform, pit

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(20, generator=gen).repeat(3000, 1) * 2
    true = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)[:, 0].tolist()
    sharp = torch.multinomial(torch.softmax(2 * z, -1), 1, generator=gen)[:, 0].tolist()  # T=0.5 passed off as T=1
    assert chi2_uniform(pit(z, true, 1.0, 1.0, 0, gen))["pass"] is True
    bad = chi2_uniform(pit(z, sharp, 1.0, 1.0, 0, gen))
    assert bad["pass"] is False and bad["p_value"] < 1e-6 and bad["tokens_checked"] == 3000
