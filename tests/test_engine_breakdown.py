"""The llama-server round in parts: its trace statistics read back, repetitions pooled, the round split into draft,
bookkeeping, verify and rest, and the draft GGUF type that served fastest carried into the export."""

import json

import pytest

from eval.engines import breakdown as B
from eval.engines import llamacpp_server as LS

# lines as llama-server (llama-cpp-python 0.3.36 sources) logs them at -lv 4, captured from a real run
LOG = """\
0.01.554.874 I slot print_timing: id  0 | task 0 | draft acceptance = 0.20000 (    3 accepted /    15 generated), mean len =  1.38
0.01.554.874 I slot print_timing: id  0 | task 0 |      acc per pos = (0.250, 0.125)
0.01.554.914 I spec common_specu: statistics     ngram-simple: #calls(b,g,a) =    1      8      0, #gen drafts =      0, #acc drafts =     0, #gen tokens =      0, #acc tokens =     0, dur(b,g,a) = 0.001, 0.009, 0.000 ms
0.01.554.926 I spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    1      8      8, #gen drafts =      8, #acc drafts =     2, #gen tokens =     15, #acc tokens =     3, #mean acc len = 1.38, #acc rate/pos = (0.250, 0.125), dur(b,g,a) = 0.003, 31.081, 0.011 ms
"""  # noqa: E501


def test_spec_stats_reads_every_implementation_and_the_latest_wins():
    s = LS.spec_stats(LOG)
    assert set(s) == {"ngram-simple", "draft-eagle3"}
    assert s["draft-eagle3"] == {"calls_b": 1, "calls_g": 8, "calls_a": 8, "gen_tokens": 15, "acc_tokens": 3,
                                 "ms_b": 0.003, "ms_g": 31.081, "ms_a": 0.011}
    later = LOG.replace("31.081", "40.000").replace("=    1      8      8", "=    2     16     16")
    assert LS.spec_stats(LOG + later)["draft-eagle3"]["ms_g"] == 40.0  # cumulative: the last line is the total


def test_stats_delta_drops_the_warm_up_request():
    before = LS.spec_stats(LOG)
    after = LS.spec_stats(LOG.replace("31.081", "131.081").replace("#gen tokens =     15", "#gen tokens =     45"))
    d = LS.stats_delta(after, before)
    assert d["draft-eagle3"]["ms_g"] == pytest.approx(100.0) and d["draft-eagle3"]["gen_tokens"] == 30
    assert LS.stats_delta(after, {})["draft-eagle3"]["ms_g"] == pytest.approx(131.081)  # no warm-up snapshot


def test_acceptance_by_position_is_pooled_over_requests_by_their_rounds():
    assert LS.acc_per_pos(LOG) == [[0.25, 0.125]]
    # request 1: 8 rounds, accepted at depth 1 twice; request 2: 2 rounds, accepted at depth 1 twice
    assert LS.pooled_rates([[0.25, 0.125], [1.0, 0.5]], [8, 2]) == pytest.approx([4 / 10, 2 / 10])
    assert LS.pooled_rates([[0.25]], [8, 2]) is None  # a request's line missing: no rates rather than wrong ones


def _row(k=3, rounds=10, draft_n=30, round_ms=(50.0, 60.0, 55.0), g=(100.0, 120.0, 110.0)):
    return {"num_speculative_tokens": k, "engine_counts": {"rounds": rounds, "draft_n": draft_n},
            "round_ms_reps": list(round_ms),
            "spec_ms_reps": [{"draft-eagle3": {"ms_b": 0.0, "ms_g": x, "ms_a": 1.0}} for x in g]}


def test_round_parts_split_a_round_and_scale_the_forward_to_the_servers_ar_step():
    forward = {1: 40.0, 2: 48.0, 3: 56.0, 4: 64.0}
    p = B.round_parts(_row(), forward, ar_step_ms=20.0)  # the server's step is half llama-bench's width-1 forward
    assert p["round_ms"] == 55.0 and p["draft_ms"] == pytest.approx(11.0)  # medians over repetitions, per round
    assert p["bookkeeping_ms"] == pytest.approx(0.1) and p["verify_width"] == 4.0
    assert p["verify_ms"] == pytest.approx(32.0)  # 64 ms at width 4, halved
    assert p["rest_ms"] == pytest.approx(55.0 - 11.0 - 0.1 - 32.0)
    ar = B.round_parts({"step_ms_reps": [20.0, 21.0, 19.0]}, forward, ar_step_ms=20.0)
    assert ar["verify_ms"] == pytest.approx(20.0) and ar["rest_ms"] == pytest.approx(0.0)
    assert B.round_parts({"ok": False}, forward, 20.0) is None
    # a round that drafted 1.5 tokens on average verifies 2.5 positions: between the measured widths
    assert B.round_parts(_row(draft_n=15), forward, 20.0)["verify_ms"] == pytest.approx(26.0)


def test_widths_cover_every_round_width_and_llama_bench_json_is_read():
    assert B.widths([{"num_speculative_tokens": None}, {"num_speculative_tokens": 3}]) == {1, 2, 3, 4}
    out = json.dumps([{"n_prompt": 1, "n_gen": 0, "avg_ns": 19813119}, {"n_prompt": 4, "n_gen": 0, "avg_ns": 4e7},
                      {"n_prompt": 0, "n_gen": 16, "avg_ns": 1e9}])
    assert B.parse(out) == {1: pytest.approx(19.813119), 4: pytest.approx(40.0)}
    assert B.interpolate({1: 10.0, 2: 20.0}, 5.0) == 20.0  # past the widest measured: the widest


def test_render_lists_each_rows_parts_in_ar_steps():
    res = {"repetitions": 3, "breakdown_depth": 300, "forward_ms": {"1": 40.0},
           "methods": {"ar": {"breakdown": {"round_ms": 20.0, "draft_ms": 0.0, "bookkeeping_ms": 0.0,
                                            "verify_ms": 20.0, "verify_width": 1.0, "rest_ms": 0.0}},
                       "eagle3": {"breakdown": {"round_ms": 50.0, "draft_ms": 10.0, "bookkeeping_ms": 0.5,
                                                "verify_ms": 30.0, "verify_width": 4.0, "rest_ms": 9.5}},
                       "refused": {"ok": False}}}
    text = "\n".join(B.render(res))
    assert "| eagle3 | 50.00 | 2.50 | 10.00 | 0.50 | 30.00 (4.00) | 9.50 |" in text
    assert "median of 3 repetition(s)" in text and "after 300 cached tokens" in text
    assert B.render({"methods": {"ar": {}}}) == []


def test_the_fastest_rows_draft_type_reaches_the_export(tmp_path):
    from models.export import llamacpp as G
    from models.export.shared.common import engine_best

    res = {"engine": "llama-server", "target_type": "bf16", "methods": {
        "eagle3_k2_f32": {"ok": True, "method": "eagle3", "num_speculative_tokens": 2, "draft_type": "f32",
                          "tokens_per_s": {"1": 30.0}, "speedup_vs_engine_ar": {"1": 1.1}, "lossless": True},
        "eagle3_k2_q8_0": {"ok": True, "method": "eagle3", "num_speculative_tokens": 2, "draft_type": "q8_0",
                           "tokens_per_s": {"1": 33.0}, "speedup_vs_engine_ar": {"1": 1.2}, "lossless": True}}}
    f = tmp_path / "results.json"
    f.write_text(json.dumps(res))
    best = engine_best([f], "eagle3")
    assert best["draft_type"] == "q8_0" and best["num_speculative_tokens"] == 2
    with pytest.raises(G.ExportError, match="draft GGUF type 'q4_0'"):
        G.export_gguf(None, tmp_path / "out", None, target_name="tiny-code", outtype="q4_0")
    assert G.DEFAULT_OUTTYPE in G.OUTTYPES


def test_agreement_reports_where_the_engine_parts_from_the_harness_and_at_what_gaps():
    from eval.engines.agreement import render
    res = {"target": "gemma3_270m", "gguf": "g.gguf", "prompts": "humaneval", "n_prompts": 2, "max_new_tokens": 4,
           "threads": 1, "identical": 1,
           "rows": [{"prompt_tokens": 9, "diverges_at": None},
                    {"prompt_tokens": 7, "diverges_at": 3, "harness_gap": 0.0123, "engine_gap": 0.0456}]}
    text = render(res)
    assert "**1 of 2**" in text and "| 1 | 7 | 3 | 0.0123 | 0.0456 |" in text and "| 0 |" not in text
    res.update(tokens_compared=8, median_gap=1.5, share_of_positions_at_or_below_it=0.125, max_gap_at_divergence=0.0123)
    assert "median gap is 1.50 and 12.5% of them are at or below" in render(res)


def test_agreement_gaps_in_one_forward_are_each_positions_own():
    """harness_gaps: one teacher-forced forward gives, before each continuation token, the top-2 gap that a forward
    of the prefix up to it gives (a tiny Gemma 3 built in code)."""
    import torch

    from eval.engines.agreement import harness_gaps
    from models.core.target import FrozenTarget
    from tests.families import make_family

    model, tok = make_family("gemma3")
    target = FrozenTarget(model, tok)
    prompt, cont = [2, 11, 12, 13, 14], [21, 22, 23, 24]
    gaps = harness_gaps(target, prompt, cont)
    assert len(gaps) == len(cont)
    for i, g in enumerate(gaps):
        with torch.no_grad():
            top = torch.topk(model(torch.tensor([prompt + cont[:i]])).logits[0, -1].float(), 2).values
        assert g == pytest.approx(float(top[0] - top[1]), abs=1e-4)


def test_an_engine_that_stops_at_eos_is_judged_on_the_tokens_before_it():
    from eval.engines.bench_vllm import same_until_eos

    assert same_until_eos([5, 6, 2], [5, 6, 2, 9, 9], eos=2)  # stopped where the harness chose eos too
    assert not same_until_eos([5, 6, 2], [5, 7, 2, 9, 9], eos=2)  # differs before it
    assert not same_until_eos([5, 6], [5, 6, 2, 9], eos=2)  # stopped early without an eos
    assert not same_until_eos([5, 6, 2], [5, 6, 2, 9], eos=None) and same_until_eos([1, 2], [1, 2], eos=None)
