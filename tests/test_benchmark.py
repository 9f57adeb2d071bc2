"""The evaluation harness (eval/bench/benchmark.py, eval/bench/report.py, python -m eval) on tiny models built in code.

What is checked:
- end to end, every method (AR, n-gram, draft model, EAGLE-3 chain and tree, Medusa, MTP; tiny checkpoints
  trained for 2 steps) on the same prompts: the results carry τ, acceptance by position, draft/verify time,
  tokens/s, speedup with spread, the cost-model bound and efficiency, HF peers, the batch sweep with crossover
  and dynamic K, the recommendation the exporter reads; every method is lossless; τ agrees with the token
  count; strict JSON; the markdown table and PNGs are written;
- the lossless check flags a method whose tokens are perturbed, and an engine whose verifier accepts every
  draft, and the CLI then exits 1;
- (crossover, the dynamic-K policy and the other hand-made tables: tests/test_bench_accounting.py)
- conversation prompts: chat template, round-robin over categories, per-category results;
- one-line errors: temperature / top_p out of range, a checkpoint for another target or of another method,
  unknown methods; missing checkpoints are skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from eval.bench.benchmark import all_lossless, run_benchmark, write_json
from eval.bench.cost_model import choose_k, crossover_batch_size
from eval.bench.report import console_summary, markdown, write_report
from eval.bench.setup import BenchSettings, Method, Prompt, build_methods, load_prompts
from eval.decode import ladder
from eval.decode.single import speculative_decode
from models import registry
from models.core.target import FrozenTarget
from tests.conftest import make_tiny_llama
from train.loop import run as train_run

KINDS = list(registry.proposers())  # every method the registry knows, AR (the baseline) first
CONF = Path(__file__).resolve().parent.parent / "conf"
MAX_NEW = 8
PROMPT_TEXTS = ["def add(a, b):\n    return a + b\ndef add(a, b):\n", "for i in range(10):\n    print(i * i)\nfor i in"]


def _train(target_dir: Path, out: Path, method: str) -> str:
    over = [f"target.name_or_path={target_dir}", f"output_dir={out}", "tracking=none", "data.max_rows=8",
            "data.val_rows=2", "data.max_len=48", f"data.cache_dir={out}/data", "train.steps=2",
            "train.batch_size=2", "train.ckpt_every=100", "train.log_every=1", "train.eval_every=100",
            "optim.warmup_steps=1", f"draft={method}"]
    if method == "eagle3":
        over += ["draft.config.draft_vocab_size=200", "draft.config.ttt_steps=2", "draft.config.layer_ids=[1,2,3]"]
    if method == "mtp":
        over += ["draft.config.num_modules=2"]
    if method == "dflash":
        over += ["draft.config.layer_ids=[1,2,3]", "draft.config.block_size=4", "draft.config.num_anchors=4"]
    if method == "peagle":
        over += ["draft.config.layer_ids=[1,2,3]", "draft.config.num_depths=3"]
    if method == "medusa":  # rank accuracies saved with the checkpoint: the bench sizes the tree from them
        over += ["draft.config.metric_top_k=3", "draft.config.tree_nodes=8"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        train_run(compose(config_name="config", overrides=over))
    return str(out / "final")


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("bench")
    tiny_llama.save_pretrained(d / "target")
    tiny_tokenizer.save_pretrained(d / "target")
    draft = make_tiny_llama(len(tiny_tokenizer), layers=1, hidden=16, seed=3)
    draft.save_pretrained(d / "draft")
    tiny_tokenizer.save_pretrained(d / "draft")
    ckpts = {m: _train(d / "target", d / m, m) for m in registry.trainable_methods()}
    target = FrozenTarget.from_pretrained(str(d / "target"))
    prompts = [Prompt(tiny_tokenizer(t, add_special_tokens=False)["input_ids"], "code", str(i))
               for i, t in enumerate(PROMPT_TEXTS)]
    return SimpleNamespace(dir=d, target=target, ckpts=ckpts, draft=str(d / "draft"), prompts=prompts,
                           tok=tiny_tokenizer)


# small CPU-sized trees: the engine's cost grows with nodes
OPTIONS = {"eagle3": {"num_speculative_tokens": 3}, "eagle3_tree": {"depth": 3, "top_k": 3, "total_tokens": 8},
           "medusa": {"top_k": 3, "num_nodes": "auto", "max_nodes": 8}, "ngram": {"num_speculative_tokens": 3},
           "draft_model": {"num_speculative_tokens": 3}}


def settings(**kw) -> BenchSettings:
    base = dict(max_new_tokens=MAX_NEW, temperatures=[0, 1], repetitions=2, warmup=1, batch_sizes=[1, 2],
                cost_reps=2, threads=1, progress=False)
    return BenchSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def full(env):
    methods, skipped = build_methods(env.target, list(KINDS), env.ckpts, env.draft, OPTIONS)
    assert not skipped
    return run_benchmark(env.target, methods, env.prompts, settings())


def test_medusa_tree_is_sized_by_the_cost_model(full, env):
    """num_nodes=auto: the tree is the checkpoint's greedy tree of the size that maximises expected τ / v(n)."""
    from eval.bench.cost_model import interp
    from models.core.tree import expected_tree_tau
    from models.methods.medusa.tree import build_medusa_tree, load_rank_accuracy

    o = full["methods"]["medusa"]["options"]
    pred = {int(k): v for k, v in o["choices_sized"]["predicted_bound"].items()}
    # the size with the highest predicted bound (the recorded values are rounded: a tie there is either size)
    assert sorted(pred) == list(range(1, 9)) and pred[o["num_nodes"]] == max(pred.values())
    acc = load_rank_accuracy(env.ckpts["medusa"])
    v = {int(k): x for k, x in full["cost_model"]["verify"].items()}
    for n in (1, 8):
        assert pred[n] == pytest.approx(expected_tree_tau(acc, build_medusa_tree(acc, n)) / interp(v, n), abs=1e-3)
    assert all(e["k_mean"] <= o["num_nodes"] for e in full["runs"] if e["method"] == "medusa")


def test_end_to_end_results_have_every_measurement(full, env):
    r = full
    reps, n = 2, len(env.prompts)
    assert list(r["methods"]) == list(KINDS)
    assert r["lossless"] is True and all_lossless(r)
    assert len(r["ar_tokens_sha256"]) == 64  # the T=0 output digest two runs compare
    assert all(m["lossless"] and m["n_mismatches"] == 0 for m in r["methods"].values())
    assert r["env"]["threads"] == 1 and r["env"]["torch"] == torch.__version__
    assert len(r["runs"]) == len(KINDS) * 2
    for e in r["runs"]:
        assert e["tokens"] == n * MAX_NEW
        # accounting: every generated token is the prefill's first one or one of a round's accepted + 1
        assert e["rounds"] * e["tau"] + reps * n == pytest.approx(e["tokens"] * reps)
        sp = e["speedup"]
        assert 0 < sp["min"] <= sp["median"] <= sp["max"] and len(sp["values"]) == reps
        assert sp["spread"] == pytest.approx((sp["max"] - sp["min"]) / 2)
        assert e["tokens_per_s"]["median"] > 0 and e["bound"] > 0
        assert e["efficiency"] == pytest.approx(e["decode_speedup"]["median"] / e["bound"])
        if e["method"] != "ar":  # AR's fixed per-step overhead is charged once a round, the forward v̄ times
            step = r["cost_model"]["t_ar_step_s"][e["temperature"]]
            share = min(1.0, r["cost_model"]["t_target_s"] / step)
            assert e["forward_share"] == pytest.approx(share) and 0 < share <= 1
            assert e["bound"] == pytest.approx(e["tau"] / (e["k_mean"] * e["c"] + share * e["v"] + 1 - share))
        assert all(math.isnan(a) or 0 <= a <= 1 for a in e["acceptance_by_pos"])
        win = e["tau_by_window"]  # every round under one reply window, the same τ in all
        assert sum(win["rounds"]) == e["rounds"]
        assert sum(t * n for t, n in zip(win["tau"], win["rounds"])) == pytest.approx(e["tau"] * e["rounds"])
        # the free baseline: the fastest training-free row at this temperature (here n-gram, the only one)
        ngram = next(x for x in r["runs"] if x["method"] == "ngram" and x["temperature"] == e["temperature"])
        assert e["best_free"] == "ngram" and e["vs_best_free"] == pytest.approx(
            e["tokens_per_s"]["median"] / ngram["tokens_per_s"]["median"])
        # every emitted token certified: T=0 against the argmax on its own prefix, T>0 by the χ² rank test
        cert = e["certificate"]
        assert e["lossless"] is True and cert["pass"] is True
        assert cert["tokens_checked"] == e["tokens"] * r["settings"]["repetitions"]
        assert (e["vs_hf_prompt_lookup"] is not None) == (e["temperature"] == 0)
        assert set(e["by_category"]) == {"code"}
        if e["kind"] == "ar":
            assert e["tau"] == 1.0 and sp["values"] == [1.0, 1.0] and e["acceptance_by_pos"] == []
        else:
            assert e["tau"] >= 1.0 and e["draft_s"] > 0 and e["verify_s"] > 0 and e["k_mean"] > 0 and e["c"] > 0
            k = r["methods"][e["method"]]["num_speculative_tokens"]
            if k is not None:  # chains never try deeper than K
                assert len(e["acceptance_by_pos"]) <= k and e["k_mean"] <= k
    # the reduced-vocabulary drafters (draft_ids) and only they: the share of AR's tokens they can draft
    with_vocab = {m.name for m in build_methods(env.target, list(KINDS), env.ckpts, env.draft, OPTIONS)[0]
                  if getattr(m.model, "draft_ids", None) is not None}
    assert set(r["draft_vocab"]) == with_vocab and with_vocab
    assert all(0 <= v["covers_ar_tokens"] <= 1 and v["size"] > 0 for v in r["draft_vocab"].values())
    cm = r["cost_model"]
    assert cm["verify"][0] == 1.0 and {8, 3} <= set(cm["verify"])  # tree size 8 and chain K=3 were measured
    assert set(cm["batch"]) == {1, 2} and cm["t_ar_step_s"][0.0] > 0
    # HF peers on the same target and prompts: greedy, prompt lookup and assisted generation all keep AR's tokens
    assert set(r["peers"]) == {"hf_greedy", "hf_prompt_lookup", "hf_assisted"}
    assert all(p["matches_ar"] and p["tokens_per_s"]["median"] > 0 for p in r["peers"].values())
    assert r["peers"]["hf_prompt_lookup"]["settings"]["prompt_lookup_num_tokens"] == 3


def test_batch_sweep_and_recommendation(full):
    b = full["batch"]
    assert b["batch_sizes"] == [1, 2] and set(b["ar_tokens_per_s"]) == {1, 2}
    assert set(b["methods"]) == {"ngram", "draft_model", "eagle3", "mtp", "dflash", "peagle"}  # chains only
    for name, m in b["methods"].items():
        assert m["lossless"] is True
        rows = m["by_batch"]
        assert [x["batch_size"] for x in rows] == [1, 2]
        assert m["crossover_batch_size"] == crossover_batch_size([1, 2], [x["speedup"]["median"] for x in rows])
        pol = full["policy"][name]
        for x in rows:
            kstar = x["dynamic"]["num_speculative_tokens"]
            assert 0 <= kstar <= m["num_speculative_tokens"] == x["num_speculative_tokens"]
            assert m["recommended_num_speculative_tokens"][x["batch_size"]] == kstar
            # K* really is the argmax of the policy's own predictions
            pred = pol["predicted_speedup"][x["batch_size"]]
            assert pred[kstar] == max(pred.values()) and pred[0] == 1.0
            # ...with the measured batched drafting cost per round, recorded with what the runs spent
            draft = pol["draft_per_round"][x["batch_size"]]
            assert set(draft) == set(range(1, m["num_speculative_tokens"] + 1)) and all(v > 0 for v in draft.values())
            w = full["cost_model"]["batch"][x["batch_size"]]
            assert pred == pytest.approx(choose_k(pol["acceptance_by_pos"], pol["c"], w, x["batch_size"],
                                                  m["num_speculative_tokens"], draft=draft)[1])
            assert set(full["cost_model"]["draft_s_per_round"][name][x["batch_size"]]) == set(draft)
            assert x["draft_s_per_round"]["median"] > 0 and len(x["draft_s_per_round"]["values"]) == 2
            fixed = x["num_speculative_tokens"]
            assert x["dynamic"]["measured_as"] == ("ar" if kstar == 0 else "fixed" if kstar == fixed else "run")
            if kstar == 0:
                assert x["dynamic"]["speedup"]["values"] == [1.0, 1.0]
    assert full["recommended_for"] == "eagle3"
    k = full["recommended_num_speculative_tokens"]
    star = full["policy"]["eagle3"]["recommended_num_speculative_tokens"]
    assert isinstance(k, int) and 0 <= k <= 3 and k == star[1]  # 0: AR is faster
    assert 1 <= full["best_positive_num_speculative_tokens"] <= 3
    assert full["recommended_num_speculative_tokens_by_batch"] == star
    assert full["speculation_pays_at_batch_1"] == (star[1] > 0)


def test_json_report_and_plots_are_written(full, tmp_path):
    from models.export.shared.common import num_speculative_tokens_from_results

    path = write_json(full, tmp_path / "results.json")
    on_disk = json.loads(path.read_text())  # strict JSON: write_json refuses NaN, so untried positions are null
    assert on_disk["recommended_num_speculative_tokens"] == full["recommended_num_speculative_tokens"]
    if full["recommended_num_speculative_tokens"]:
        # what the exporter reads
        assert num_speculative_tokens_from_results(path) == full["recommended_num_speculative_tokens"]
    else:  # speculation slower than AR: the exporter refuses to bake a slowdown into the serving snippet
        with pytest.raises(ValueError, match="is 0"):
            num_speculative_tokens_from_results(path)
    files = write_report(on_disk, tmp_path)
    assert set(files) == {"results.md", "tau_speedup.png", "acceptance.png", "batch_speedup.png", "learning_curve.png"}
    for name, f in files.items():
        if name.endswith(".png"):
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000
    md = files["results.md"].read_text()
    assert "| method | T | τ | speedup | tokens/s | bound | efficiency |" in md
    for name in KINDS:
        assert f"| {name} | 0 |" in md and f"| {name} | 1 |" in md
    assert "every method reproduced AR's tokens" in md and "hf_prompt_lookup" in md and "crossover" in md
    bw = on_disk["env"]["bandwidth"]  # AR judged against this machine's memory-bandwidth ceiling
    ar = next(e for e in on_disk["runs"] if e["method"] == "ar" and e["temperature"] == 0)
    assert bw["ar_tokens_per_s_bound"] > 0 and f"allows {bw['ar_tokens_per_s_bound']:.0f} tokens/s" in md
    assert f"AR ran at {100 * ar['tokens_per_s']['median'] / bw['ar_tokens_per_s_bound']:.0f} %" in md
    assert markdown(full) == md  # in-memory and on-disk results render alike
    assert "recommended_num_speculative_tokens=" in console_summary(full)


def _perturb_last(target, proposer, ids, max_new, **kw):
    r = speculative_decode(target, proposer, ids, max_new, **kw)
    r.tokens[-1] = (r.tokens[-1] + 1) % target.vocab_size
    return r


def test_methods_take_turns_on_each_prompt_so_drift_falls_on_all_alike(env):
    """A machine that slows for a stretch must not slow one method's whole block of prompts: within a repetition
    every method decodes prompt i before any decodes prompt i + 1."""
    calls = []

    def recording(name):
        def decode(target, proposer, ids, max_new, **kw):
            calls.append((name, ids.shape[1]))
            return speculative_decode(target, proposer, ids, max_new, **kw)
        return decode

    methods, _ = build_methods(env.target, ["ngram"], options=OPTIONS)
    ng = methods[1]
    methods[1:] = [Method(n, "ngram", ng.make, num_speculative_tokens=ng.num_speculative_tokens, options=ng.options,
                          decode=recording(n)) for n in ("first", "second")]
    run_benchmark(env.target, methods, env.prompts, settings(temperatures=[0], repetitions=1, batch_sizes=[],
                                                             peers=False, warmup=0))
    lens = [len(p.ids) for p in env.prompts]
    assert calls == [(n, n_tok) for n_tok in lens for n in ("first", "second")]


def test_lossless_check_flags_perturbed_tokens(env):
    methods, _ = build_methods(env.target, ["ngram"], options=OPTIONS)
    ng = methods[1]
    methods.append(Method("broken", "ngram", ng.make, num_speculative_tokens=ng.num_speculative_tokens,
                          options=ng.options, decode=_perturb_last))
    r = run_benchmark(env.target, methods, env.prompts, settings(temperatures=[0], batch_sizes=[], peers=False))
    assert r["methods"]["ngram"]["lossless"] is True and r["methods"]["ar"]["lossless"] is True
    bad = r["methods"]["broken"]
    # every rep, every prompt: against AR's tokens, and by the certificate on the run's own prefix
    where = [m["where"] for m in bad["mismatches"]]
    assert bad["lossless"] is False and where.count("single") == where.count("certificate") == 2 * len(env.prompts)
    assert {m["first_diff"] for m in bad["mismatches"]} == {MAX_NEW - 1}
    assert r["lossless"] is False and not all_lossless(r)
    assert "LOSSLESS CHECK FAILED for broken" in markdown(r)


def test_the_baseline_is_plain_decoding_chosen_by_its_spec(env, monkeypatch):
    """AR is a registered method (``ProposerSpec.baseline``), yet the harness times it with ``decode_ar`` /
    ``decode_ar_batch`` — not a speculative loop over its empty drafts — and always runs it first."""
    import eval.bench.batch_sweep as bs
    import eval.bench.benchmark as bm

    assert [p.name for _, p in registry.proposers().values() if p.baseline] == ["ar"] == [registry.baseline().name]
    calls = {"ar": 0, "ar_batch": 0, "spec": []}
    ar, ar_batch, spec = bm.decode_ar, bs.decode_ar_batch, bm.speculative_decode
    monkeypatch.setattr(bm, "decode_ar", lambda *a, **kw: (calls.__setitem__("ar", calls["ar"] + 1), ar(*a, **kw))[1])
    monkeypatch.setattr(bs, "decode_ar_batch", lambda *a, **kw: (calls.__setitem__("ar_batch", calls["ar_batch"] + 1),
                                                                  ar_batch(*a, **kw))[1])
    monkeypatch.setattr(bm, "speculative_decode",
                        lambda t, p, *a, **kw: (calls["spec"].append(type(p).__name__), spec(t, p, *a, **kw))[1])
    methods, _ = build_methods(env.target, ["ngram", "ar"], options=OPTIONS)
    assert [m.name for m in methods] == ["ar", "ngram"] and methods[0].baseline and not methods[1].baseline
    r = run_benchmark(env.target, methods, env.prompts, settings(temperatures=[0], repetitions=1, batch_sizes=[2],
                                                                 peers=False, warmup=0))
    assert calls["ar"] == len(env.prompts) and set(calls["spec"]) == {"NGramProposer"}
    assert calls["ar_batch"] == 1  # the batch sweep's baseline at B=2
    assert r["methods"]["ar"]["kind"] == "ar" and r["runs"][0]["method"] == "ar"  # result files keep the name
    with pytest.raises(ValueError, match="start with the one baseline"):
        run_benchmark(env.target, methods[1:], env.prompts, settings())


def _accept_everything(proposal, logits, sampling):
    """A broken verifier: takes every drafted token without looking at the target."""
    n = proposal.size
    return list(range(n)), int(logits[n].argmax())


def test_lossless_check_catches_a_broken_verifier(env, monkeypatch):
    methods, _ = build_methods(env.target, ["eagle3"], env.ckpts, options=OPTIONS)
    monkeypatch.setattr(ladder, "accept_proposal", _accept_everything)
    r = run_benchmark(env.target, methods, env.prompts, settings(temperatures=[0], repetitions=1, batch_sizes=[],
                                                                 peers=False))
    assert r["methods"]["ar"]["lossless"] is True  # AR never verifies
    assert r["methods"]["eagle3"]["lossless"] is False and r["lossless"] is False


def test_conversation_prompts_by_category(env, tmp_path):
    from data.chat import render_chat

    rows = [{"category": "writing", "turns": ["Hello, how are you?", "And the weather?"]},
            {"category": "writing", "turns": ["What is the weather like today?"]},
            {"category": "coding", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "def add(a, b):"},
                                                {"role": "assistant", "content": "return a + b"}]},
            {"turns": ["for i in range(10):"]},
            {"category": "long", "turns": ["print(i * i) " * 200]}]
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(env.tok, 3, 64, path)
    assert [p.category for p in prompts] == ["writing", "coding", "default"]  # round-robin, the long one skipped
    want = render_chat(env.tok, [{"role": "user", "content": "Hello, how are you?"}], add_generation_prompt=True)
    assert prompts[0].ids == env.tok(want, add_special_tokens=False)["input_ids"]
    coding = env.tok.decode(prompts[1].ids)
    assert "Be brief." in coding and "return a + b" not in coding and coding.endswith("<|assistant|>\n")

    methods, _ = build_methods(env.target, ["ngram"], options=OPTIONS)
    r = run_benchmark(env.target, methods, prompts, settings(temperatures=[0], repetitions=1, batch_sizes=[],
                                                             peers=False), prompt_source=str(path))
    assert r["prompts"]["categories"] == {"writing": 1, "coding": 1, "default": 1}
    for e in r["runs"]:
        assert set(e["by_category"]) == {"writing", "coding", "default"}
        assert all(c["n_prompts"] == 1 and c["tokens_per_s"] > 0 for c in e["by_category"].values())
    assert "## Per category" in markdown(r)

    path.write_text(json.dumps({"category": "x", "question": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: needs 'prompt' or 'text'"):
        load_prompts(env.tok, 3, 64, path)
    path.write_text(json.dumps({"category": "x", "prompt": 5}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: 'prompt' must be a non-empty string"):
        load_prompts(env.tok, 3, 64, path)


def test_completion_prompt_files(env, tmp_path):
    """{"prompt"} / {"text"} rows (optional category) are raw completion prompts: tokenized as is, cut to their
    first prompt_tokens tokens (no chat template), reported per category; the shipped out-of-domain set loads."""
    code = "def add(a, b):\n    return a + b\n" * 20
    rows = [{"prompt": code, "category": "humaneval", "source": "HumanEval/0"}, {"text": "for i in range(10):\n"},
            {"prompt": "class Point:\n", "category": "humaneval"}]
    path = tmp_path / "completions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(env.tok, 3, 16, path)
    assert [p.category for p in prompts] == ["humaneval", "default", "humaneval"]
    assert prompts[0].ids == env.tok(code)["input_ids"][:16] and prompts[0].label == "HumanEval/0"
    assert prompts[1].ids == env.tok("for i in range(10):\n")["input_ids"]
    methods, _ = build_methods(env.target, ["ngram"], options=OPTIONS)
    r = run_benchmark(env.target, methods, prompts, settings(temperatures=[0], repetitions=1, batch_sizes=[],
                                                             peers=False), prompt_source=str(path))
    assert r["lossless"] and r["prompts"]["categories"] == {"humaneval": 2, "default": 1}
    assert all(set(e["by_category"]) == {"humaneval", "default"} for e in r["runs"])
    ood = Path(__file__).resolve().parent.parent / "eval" / "prompts" / "ood_python.jsonl"
    shipped = load_prompts(env.tok, 8, 64, ood)
    assert len(shipped) == 8 and {p.category for p in shipped} == {"hydra", "click", "filelock", "packaging"}


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="temperature") as e:
        BenchSettings(temperatures=[0, -1])
    _one_line(e)
    with pytest.raises(ValueError, match="top_p") as e:
        BenchSettings(top_p=1.5)
    _one_line(e)
    with pytest.raises(ValueError, match="batch_temperature"):
        BenchSettings(temperatures=[0, 1], batch_temperature=0.7)
    with pytest.raises(ValueError, match="batch_sizes"):
        BenchSettings(batch_sizes=[1, 0])
    assert BenchSettings(temperatures=[1]).temperatures == [0.0, 1.0]  # T=0, the lossless check, always runs


def test_bad_checkpoints_and_methods(env, caplog):
    other = FrozenTarget(make_tiny_llama(len(env.tok), seed=5))  # same shapes, other weights
    with pytest.raises(ValueError, match="trained for another target") as e:
        build_methods(other, ["eagle3"], env.ckpts)
    _one_line(e)
    with pytest.raises(ValueError, match="is a medusa checkpoint, not eagle3"):
        build_methods(env.target, ["eagle3"], {"eagle3": env.ckpts["medusa"]})
    with pytest.raises(ValueError, match="unknown method"):
        build_methods(env.target, ["eagle4"])
    with caplog.at_level(logging.WARNING, logger="eval.bench.benchmark"):
        methods, skipped = build_methods(env.target, ["ngram", "mtp", "draft_model"],
                                         {"mtp": str(env.dir / "missing")})
    assert [m.name for m in methods] == ["ar", "ngram"] and set(skipped) == {"mtp", "draft_model"}
    assert "skipping mtp" in caplog.text


def _cli_overrides(env, out: Path, *extra: str) -> list[str]:
    return [f"target.name_or_path={env.dir / 'target'}", f"checkpoints.eagle3={env.ckpts['eagle3']}",
            f"checkpoints.medusa={env.ckpts['medusa']}", f"checkpoints.mtp={env.dir / 'none'}",
            f"checkpoints.dflash={env.dir / 'none'}", "n_prompts=2",
            "prompt_tokens=12", f"max_new_tokens={MAX_NEW}", "repetitions=1", "warmup=0", "cost_reps=1",
            "threads=1", "progress=false", "options.eagle3_tree.total_tokens=8", "options.medusa.num_nodes=8",
            "draft_model=null", "decode_step=eager", f"out_dir={out}", *extra]


def test_cli_run_writes_report(env, tmp_path):
    from eval.__main__ import run

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=_cli_overrides(env, tmp_path, "batch_sizes=[1]",
                                                                   "temperatures=[0]", "peers=false"))
    res = run(cfg)
    assert set(res["skipped"]) == {"draft_model", "mtp", "dflash", "peagle"}
    assert set(res["methods"]) == {"ar", "ngram", "eagle3", "eagle3_bf16", "eagle3_int8", "eagle3_lookup",
                                   "eagle3_tree", "eagle3_tree_t1", "eagle3_tree_lookup", "medusa"}
    assert res["lossless"] and res["methods"]["eagle3_int8"]["options"]["weights"] == "int8"  # conf variants
    assert {p.name for p in tmp_path.iterdir()} >= {"results.json", "results.md", "tau_speedup.png",
                                                     "acceptance.png", "batch_speedup.png", "learning_curve.png"}
    assert json.loads((tmp_path / "results.json").read_text())["prompts"]["n"] == 2


def _main_exit(monkeypatch, argv: list[str]) -> int:
    from eval.__main__ import main

    monkeypatch.setattr(sys, "argv", ["eval", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code


def test_cli_exit_status(env, tmp_path, monkeypatch, capsys):
    assert _main_exit(monkeypatch, _cli_overrides(env, tmp_path, "top_p=1.5")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: top_p")
    # a verifier that accepts every draft: the harness notices and the CLI fails
    monkeypatch.setattr(ladder, "accept_proposal", _accept_everything)
    argv = _cli_overrides(env, tmp_path, "methods=[ar,eagle3]", "batch_sizes=[]", "temperatures=[0]", "peers=false")
    assert _main_exit(monkeypatch, argv) == 1
    assert "lossless check failed for eagle3" in capsys.readouterr().err


def test_variants_run_a_method_with_other_options_as_its_own_row(env):
    """``variants``: eagle3 drafting in bf16 is its own batch-1 row (kind eagle3, weights bfloat16, lossless),
    kept out of the batch sweep; a variant of an unknown method or with a method's own name is a one-line error."""
    variants = {"eagle3_bf16": {"method": "eagle3", "weights": "bfloat16"}}
    methods, _ = build_methods(env.target, ["eagle3", "eagle3_bf16"], env.ckpts, options=OPTIONS, variants=variants)
    by = {m.name: m for m in methods}
    assert by["eagle3_bf16"].kind == "eagle3" and by["eagle3_bf16"].variant_of == "eagle3"
    assert by["eagle3_bf16"].options == {**by["eagle3"].options, "weights": "bfloat16"}
    assert by["eagle3_bf16"].num_speculative_tokens == 3  # the base method's options, then the variant's
    r = run_benchmark(env.target, methods, env.prompts, settings(temperatures=[0], repetitions=1, batch_sizes=[1],
                                                                 peers=False))
    assert r["methods"]["eagle3_bf16"]["lossless"] and r["methods"]["eagle3_bf16"]["variant_of"] == "eagle3"
    assert any(e["method"] == "eagle3_bf16" for e in r["runs"])
    assert set(r["policy"]) == {"eagle3"}  # the sweep and the policy take the methods, not their variants
    with pytest.raises(ValueError, match="variants.x.method"):
        build_methods(env.target, ["x"], env.ckpts, variants={"x": {"method": "eagle4"}})
    with pytest.raises(ValueError, match="own name"):
        build_methods(env.target, ["eagle3"], env.ckpts, variants={"eagle3": {"method": "eagle3"}})
    with pytest.raises(ValueError, match="weights"):
        build_methods(env.target, ["x"], env.ckpts, variants={"x": {"method": "eagle3", "weights": "fp4"}})


def test_a_variant_with_its_own_checkpoint_runs_that_drafter_beside_its_method(env, tmp_path):
    """``checkpoints.<variant>``: a second drafter of one method (DSpark beside DFlash) in the same run, loaded from
    its own directory and reported under its own name, training record included."""
    other = _train(env.dir / "target", tmp_path / "other", "eagle3")
    variants = {"eagle3_b": {"method": "eagle3"}}
    ckpts = {**env.ckpts, "eagle3_b": other}
    methods, _ = build_methods(env.target, ["eagle3", "eagle3_b"], ckpts, options=OPTIONS, variants=variants)
    by = {m.name: m for m in methods}
    assert by["eagle3_b"].checkpoint == other and by["eagle3"].checkpoint == env.ckpts["eagle3"]
    assert by["eagle3_b"].model is not by["eagle3"].model
    r = run_benchmark(env.target, methods, env.prompts, settings(temperatures=[0], repetitions=1, batch_sizes=[],
                                                                 peers=False))
    assert r["lossless"] and set(r["training"]) == {"eagle3", "eagle3_b"}
    assert r["training"]["eagle3_b"]["steps"] == 2
    # without one, the variant shares its method's drafter and is reported once, under the method
    methods, _ = build_methods(env.target, ["eagle3", "eagle3_b"], env.ckpts, options=OPTIONS, variants=variants)
    assert {m.checkpoint for m in methods if not m.baseline} == {env.ckpts["eagle3"]}


def test_training_cost_and_learning_curve_come_from_the_run_directories(full, env, tmp_path):
    """results["training"]: per trained drafter the steps, training minutes (metrics.jsonl elapsed_s), the
    held-out curve (val.jsonl) and the data cost (data_stats.json); the report draws learning_curve.png."""
    from eval.bench.report import markdown, plot

    t = full["training"]
    trained = {registry.proposer(k)[0].name for k in KINDS[1:]} & set(registry.trainable_methods())
    assert set(t) == trained  # eagle3_tree shares eagle3's checkpoint: reported once
    for name, s in t.items():
        metrics = [json.loads(x) for x in (Path(env.ckpts[name]).parent / "metrics.jsonl").read_text().splitlines()]
        assert s["steps"] == 2 and s["train_minutes"] == round(max(r["elapsed_s"] for r in metrics) / 60, 1)
        assert len(s["curve"]) == 1 and s["curve"][0]["step"] == 2 and s["curve"][0]["sim_tau"] >= 1
        assert s["train_rows"] > 0 and s["regen_minutes"] == 0
    assert "## Training cost and learning curve" in markdown(full)
    assert (tmp_path / "learning_curve.png") in plot(full, tmp_path)


@pytest.mark.parametrize("size_for", [0, 1])
def test_eagle2_tree_is_sized_by_the_cost_model(env, size_for):
    """total_tokens auto: prepared at max_nodes (so the cost tables cover it), then the n whose static rank tree
    (held-out greedy hits at T=0, target mass at T=1) maximises τ(n) / (root pass + (D−1) passes of W + v(n))."""
    from models.core.tree import build_rank_tree, expected_tree_tau
    from models.methods.eagle3 import eagle_rank_accuracy

    opts = {"eagle3_tree": {"depth": 3, "top_k": 3, "total_tokens": "auto", "max_nodes": 10, "size_for": size_for}}
    (_, m), _ = build_methods(env.target, ["eagle3_tree"], env.ckpts, options=opts)
    assert m.nodes == 10  # the largest tree until sized
    v = lambda n: 1.0 + 0.05 * n  # noqa: E731  a verify cost growing with width
    m.size_tree(env.target, v, t1_s=1e-3)
    o = m.options
    sized = o["tree_sized"]
    pred = {int(k): x for k, x in sized["predicted_bound"].items()}
    assert o["total_tokens"] == max(pred, key=pred.get) == m.nodes and sorted(pred) == list(range(1, 11))
    ev = json.loads((Path(env.ckpts["eagle3"]) / "eval.json").read_text())
    acc = eagle_rank_accuracy(ev, 2, size_for)[:, :3]  # the checkpoint's 2 TTT steps cap depth 3
    passes = {int(k): x for k, x in sized["pass_cost"].items()}
    for n in (1, 4, 10):
        tree = build_rank_tree(acc, n)
        d, w = max(len(c) for c in tree), max(max(c) for c in tree) + 1
        assert pred[n] == pytest.approx(expected_tree_tau(acc, tree) / (passes[1] + (d - 1) * passes[w] + v(n)),
                                        rel=1e-3, abs=1e-3)
    tree = build_rank_tree(acc, o["total_tokens"])
    assert (o["depth"], o["top_k"]) == (max(len(c) for c in tree), max(max(c) for c in tree) + 1)
    p = m.make(None)
    assert (p.depth, p.top_k, p.total_tokens) == (o["depth"], o["top_k"], o["total_tokens"])
    assert "mass1_0" in ev and "top1_0" in ev


def test_hf_peer_does_not_stop_at_the_models_own_eos_when_we_do_not(tiny_llama, tiny_tokenizer):
    """stop_at_eos=false: the HF peer must generate max_new_tokens like our AR, even when the model's
    generation_config names an eos it emits (transformers fills an unset eos_token_id from it: SmolLM2 stopped at
    <|im_end|> and its peer rows read "same tokens: NO")."""
    from types import SimpleNamespace

    from eval.bench.peers import hf_generate
    from eval.decode.single import decode_ar
    from models.core.target import FrozenTarget

    target = FrozenTarget(tiny_llama, tiny_tokenizer)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    ours = [int(x) for x in decode_ar(target, ids[0], 8).tokens][-8:]
    old = tiny_llama.generation_config.eos_token_id
    tiny_llama.generation_config.eos_token_id = ours[1]  # the model "ends" at its second token
    try:
        toks, _ = hf_generate(target, ids, SimpleNamespace(max_new_tokens=8), None, {})
    finally:
        tiny_llama.generation_config.eos_token_id = old
    assert toks == ours


def test_auto_dtype_is_probed_at_the_benchmark_threads_and_reported(env, tmp_path):
    """target.dtype=auto times each dtype at the thread count the benchmark decodes with (not the process
    default), and results.md shows its t(w)/t(1) table and choice."""
    from eval.__main__ import run

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=_cli_overrides(
            env, tmp_path, "target.dtype=auto", "methods=[ar,ngram]", "batch_sizes=[]", "temperatures=[0]",
            "peers=false"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        res = run(cfg)
    finally:
        torch.set_num_threads(before)
    probe = res["env"]["dtype_probe"]
    assert probe["threads"] == 1 == res["env"]["threads"]
    md = (tmp_path / "results.md").read_text()
    assert f"`target.dtype=auto` chose **{probe['chosen']}**" in md
    assert all(f"| {d} | " in md for d in probe["dtypes"])


def test_every_run_records_whether_it_was_quiet_and_a_contended_one_says_so(full):
    """results.json ``quiet`` (eval/bench/quiet.py): the signals and thresholds; the report opens with a contended
    run's reasons and the terminal summary leads with them."""
    from eval.bench.quiet import verdict

    q = full["quiet"]
    assert {"contended", "reasons", "other_cores", "ar_rate_drift", "t1_s", "thresholds"} <= set(q)
    assert len(q["t1_s"]) == 2 and all(t > 0 for t in q["t1_s"]) and set(q["ar_rate_drift"]) == {"0", "1"}
    r = dict(full)
    cpu = {k: q[k] for k in ("wall_s", "cpus", "loadavg_start", "loadavg_end")}
    r["quiet"] = verdict({**cpu, "other_cores": 0.9}, {0.0: [20.0]}, (0.05, 0.05), {})
    assert "**Contended run: its timings are not results to quote.** other processes used 0.90 cores" in markdown(r)
    assert console_summary(r).startswith("CONTENDED RUN")
    r["quiet"] = verdict({**cpu, "other_cores": 0.0}, {0.0: [20.0]}, (0.05, 0.05), {})
    assert "Contended" not in markdown(r) and "CONTENDED" not in console_summary(r)
