"""Bad files and bad inputs: named file and line, skip-and-count, bounded giant rows, keyed regeneration, exports
that never delete what they did not write, batched decoding finishing at prefill, stall-resistant speedups,
eval refusing a named method that cannot run."""

from __future__ import annotations

import json
import time

import pytest
import torch

from data.chat import load_conversations, tokenize_conversation
from data.sources import DataConfig, build_rows
from tests.conftest import make_tiny_llama

GOOD = {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello, how are you"}]}


def _jsonl(path, n_good, bad_lines):
    lines = [json.dumps(GOOD).encode()] * n_good + bad_lines
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_non_utf8_line_names_file_and_line(tmp_path):
    p = _jsonl(tmp_path / "sg.jsonl", 3, [b'{"conversations": "\xff\xfe"}'])
    with pytest.raises(ValueError, match=r"sg.jsonl:4: not valid UTF-8"):
        load_conversations(str(p))


def test_skip_malformed_skips_undecodable_and_invalid_json_and_counts(tmp_path, tiny_tokenizer, capsys):
    p = _jsonl(tmp_path / "sg.jsonl", 8, [b'{"conversations": "\xff"}', b"{not json"])
    convs, stats = load_conversations(str(p), skip_malformed=True)
    assert len(convs) == 8 and stats["skipped"] == 2 and "sg.jsonl:9" in stats["first_error"]
    cfg = DataConfig(kind="chat", source=str(p), skip_malformed=True, max_len=64, val_rows=0)
    build_rows(cfg, tiny_tokenizer)
    assert "skipped 2 of 10 malformed rows" in capsys.readouterr().out


def test_mostly_bad_file_is_an_error_even_with_skip(tmp_path):
    p = _jsonl(tmp_path / "sg.jsonl", 1, [b"{bad"] * 9)
    with pytest.raises(ValueError, match=r"9 of 10 rows are malformed"):
        load_conversations(str(p), skip_malformed=True)


def test_non_utf8_json_file_names_the_file(tmp_path):
    p = tmp_path / "sg.json"
    p.write_bytes(b'[{"conversations": "\xff"}]')
    with pytest.raises(ValueError, match=r"sg.json: not valid UTF-8"):
        load_conversations(str(p))


def test_all_rows_beyond_max_len_names_the_setting(tmp_path, tiny_tokenizer):
    row = {"conversations": [{"from": "human", "value": "x " * 400}, {"from": "gpt", "value": "ok"}]}
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"no assistant token within data.max_len=16"):
        build_rows(DataConfig(kind="chat", source=str(p), max_len=16, val_rows=0), tiny_tokenizer)


def test_giant_row_is_clipped_before_rendering_and_exact(tiny_tokenizer):
    long = [{"role": "user", "content": "def f(x):\n    return x + 1\n" * 400},
            {"role": "assistant", "content": "print(i * i)\n" * 300}]
    clipped = tokenize_conversation(tiny_tokenizer, long, max_len=64)
    from data.chat import _tokenize_masked

    ids, mask = _tokenize_masked(tiny_tokenizer, long)  # the unclipped reference
    assert clipped == {"input_ids": ids[:64], "loss_mask": mask[:64]} or (clipped is None and not any(mask[:64]))
    giant = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a = 1\n" * 2_000_000}]  # 12 MB
    t = time.time()
    row = tokenize_conversation(tiny_tokenizer, giant, max_len=64)
    assert time.time() - t < 5 and len(row["input_ids"]) == 64 and any(row["loss_mask"])


def test_regeneration_cache_is_keyed_by_target_and_sampling(tmp_path, tiny_llama, tiny_tokenizer):
    base = dict(max_rows=6, max_len=32, val_rows=1, regenerate=2, regen_prompt_len=8, regen_new_tokens=3,
                regen_batch_size=2, cache_dir=str(tmp_path))
    build_rows(DataConfig(**base), tiny_tokenizer, tiny_llama)
    files = set(tmp_path.glob("regen_code_*.jsonl"))
    assert len(files) == 1
    build_rows(DataConfig(**base), tiny_tokenizer, tiny_llama)  # same settings: reused
    assert set(tmp_path.glob("regen_code_*.jsonl")) == files
    build_rows(DataConfig(**base, regen_temperature=1.0), tiny_tokenizer, tiny_llama)
    build_rows(DataConfig(**base, seed=1), tiny_tokenizer, tiny_llama)
    other = make_tiny_llama(len(tiny_tokenizer), seed=7)  # same shape, other weights: another target
    build_rows(DataConfig(**base), tiny_tokenizer, other)
    assert len(set(tmp_path.glob("regen_code_*.jsonl"))) == 4


def test_default_regeneration_cache_lives_in_the_run(target_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    from tests.faults.fault_helpers import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", [f"output_dir={tmp_path}/run"])
    assert cfg.data.cache_dir == f"{tmp_path}/run/data_cache"


def _export(args):
    from train.export import main

    return main(args)


def test_export_force_never_deletes_the_run_directory(target_dir, trained, capsys):
    before = sorted(p.name for p in trained.iterdir())
    rc = _export([str(trained / "final"), "--format", "eagle3", "--out", str(trained), "--force"])
    assert rc == 2 and "contains the checkpoint being exported" in capsys.readouterr().err
    assert sorted(p.name for p in trained.iterdir()) == before
    rc = _export([str(trained / "final"), "--format", "eagle3", "--out", str(trained / "final"), "--force"])
    assert rc == 2 and (trained / "final" / "model.safetensors").exists()


def test_export_force_refuses_foreign_files_and_replaces_previous_export(target_dir, trained, tmp_path, capsys):
    out = tmp_path / "exp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc = _export([str(trained / "final"), "--format", "eagle3", "--out", str(out), "--force"])
    assert rc == 2 and "not a previous export" in capsys.readouterr().err and (out / "notes.txt").exists()
    out2 = tmp_path / "exp2"
    assert _export([str(trained / "final"), "--format", "eagle3", "--out", str(out2)]) == 0
    assert _export([str(trained / "final"), "--format", "eagle3", "--out", str(out2), "--force"]) == 0


def test_export_missing_target_path_is_one_line(trained, capsys):
    rc = _export([str(trained / "final"), "--format", "eagle3", "--out", str(trained / "x"),
                  "--target", "/nonexistent/model"])
    assert rc == 2 and "'/nonexistent/model' does not exist" in capsys.readouterr().err


def test_truncated_feature_shard_names_the_path(target_dir, tmp_path):
    from data.features import FeatureCache
    from models.core.target import FrozenTarget

    target = FrozenTarget.from_pretrained(str(target_dir))
    rows, _ = build_rows(DataConfig(max_rows=4, max_len=32, val_rows=1), target.tokenizer)
    cache = FeatureCache(tmp_path / "feat", target, rows, [1, 2], dtype="float32", shard_rows=2)
    cache.build(show_progress=False)
    p = cache.shard_path(0)
    p.write_bytes(p.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"shard_?0*\.safetensors: unreadable feature shard|unreadable feature shard"):
        cache.get(0)


@pytest.mark.parametrize("n,eos_first", [(1, False), (4, True)])
def test_batched_decode_rows_all_finished_at_prefill(tiny_llama, n, eos_first):
    from eval.decode.batch import decode_ar_batch, speculative_decode_batch
    from eval.decode.single import decode_ar, speculative_decode
    from models.core.target import FrozenTarget
    from models.methods.ngram import NGramProposer
    from tests.test_decode import batched

    target = FrozenTarget(tiny_llama)
    prompts = [torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8])]
    first = [decode_ar(target, p, 1).tokens[0] for p in prompts]
    eos = first[0] if eos_first else None
    if eos_first:
        prompts = [prompts[0], prompts[0].clone()]  # both rows' first token is eos
    got = decode_ar_batch(target, prompts, n, eos_id=eos)
    rows = [NGramProposer(num_speculative_tokens=2) for _ in prompts]
    spec = speculative_decode_batch(target, batched("ngram", rows), prompts, n, eos_id=eos)
    for p, a, s in zip(prompts, got, spec):
        ref = speculative_decode(target, NGramProposer(num_speculative_tokens=2), p, n, eos_id=eos).tokens
        assert a.tokens == ref == s.tokens and len(ref) == 1


def test_speedup_estimate_resists_a_stalled_repetition():
    from eval.bench.stats import paired_speedup

    # method 2x faster than AR; AR's second repetition stalled 50x on one prompt
    t_ar = [[1.0, 1.0], [50.0, 1.0]]
    single = {"ntoks": {("m", 0.0): [[10, 10]] * 2, ("ar", 0.0): [[10, 10]] * 2},
              "times": {("m", 0.0): [[0.5, 0.5], [0.5, 0.5]], ("ar", 0.0): t_ar}}
    r = paired_speedup(single, ("m", 0.0), ("ar", 0.0), range(2))
    assert r["min_time"] == pytest.approx(2.0) and r["paired_median"] == pytest.approx(2.0) and r["noisy"]
    calm = {"ntoks": single["ntoks"], "times": {**single["times"], ("ar", 0.0): [[1.0, 1.0], [1.02, 1.0]]}}
    assert not paired_speedup(calm, ("m", 0.0), ("ar", 0.0), range(2))["noisy"]


def test_eval_named_method_that_cannot_run_is_an_error(target_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    from eval.__main__ import explicit_methods
    from eval.__main__ import run as eval_run
    from tests.faults.fault_helpers import CONF

    over = ["methods=[ar,eagle3]", f"checkpoints.eagle3={tmp_path}/typo/final"]
    assert explicit_methods(over, ["ar", "eagle3"]) == ["eagle3"]
    assert explicit_methods(["n_prompts=2"], ["ar", "eagle3"]) == []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("eval", [*over, f"target.name_or_path={target_dir}", f"out_dir={tmp_path}/e", "n_prompts=1",
                               "max_new_tokens=2", "batch_sizes=[]", "peers=false", "repetitions=1"])
    with pytest.raises(ValueError, match=r"eagle3 was asked for but cannot run: no checkpoint at"):
        eval_run(cfg, explicit_methods(over, list(cfg.methods)))
    assert not (tmp_path / "e" / "results.json").exists()


def test_eval_infinite_temperature_refused_up_front():
    from eval.bench.setup import BenchSettings

    with pytest.raises(ValueError, match="temperatures: inf is not finite"):
        BenchSettings(temperatures=[0, float("inf")])


def test_regenerate_all_split_over_temperatures_with_cost_stats(tmp_path, tiny_llama, tiny_tokenizer):
    """data.regenerate=all: one continuation per training window; regen_temperature [0, 1]: the prefixes split
    round-robin, each temperature its own keyed cache; the stats say what was generated now and what was read."""
    base = dict(max_rows=5, max_len=32, val_rows=1, regen_prompt_len=8, regen_new_tokens=3, regen_batch_size=2,
                cache_dir=str(tmp_path), regenerate="all", regen_temperature=[0.0, 1.0])
    windows, _ = build_rows(DataConfig(**{**base, "regenerate": 0}), tiny_tokenizer, tiny_llama)
    stats: dict = {}
    train, _ = build_rows(DataConfig(**base), tiny_tokenizer, tiny_llama, stats)
    n = len(windows)
    assert len(train) == 2 * n  # every window plus its target continuation
    groups = stats["regenerated"]
    assert [g["temperature"] for g in groups] == [0.0, 1.0]
    assert [g["continuations"] for g in groups] == [(n + 1) // 2, n // 2]
    assert all(g["generated_now"] == g["continuations"] and g["from_cache"] == 0 for g in groups)
    assert len(set(tmp_path.glob("regen_code_*.jsonl"))) == 2
    regen = train[n:]
    prefixes = {tuple(w["input_ids"][:8]) for w in windows}
    assert all(tuple(r["input_ids"][:8]) in prefixes and sum(r["loss_mask"]) > 0 for r in regen)
    again: dict = {}
    train2, _ = build_rows(DataConfig(**base), tiny_tokenizer, tiny_llama, again)  # resumed: all from the caches
    assert train2 == train and all(g["generated_now"] == 0 for g in again["regenerated"])
    with pytest.raises(ValueError, match="'all'"):
        build_rows(DataConfig(**{**base, "regenerate": "most"}), tiny_tokenizer, tiny_llama)


# -------------------------- counts that stay true after a kill or a short input; bad settings refused up front
def _regen_cfg(tmp_path, **kw):
    base = dict(max_rows=6, max_len=32, val_rows=1, regenerate=4, regen_prompt_len=8, regen_new_tokens=3,
                regen_batch_size=2, cache_dir=str(tmp_path))
    return DataConfig(**{**base, **kw})


def test_torn_regeneration_line_is_counted_as_generated_not_cached(tmp_path, tiny_llama, tiny_tokenizer):
    cfg = _regen_cfg(tmp_path)
    first: dict = {}
    rows, _ = build_rows(cfg, tiny_tokenizer, tiny_llama, first)
    assert [(g["from_cache"], g["generated_now"]) for g in first["regenerated"]] == [(0, 4)]
    cache = next(tmp_path.glob("regen_code_*.jsonl"))
    raw = cache.read_bytes()
    cache.write_bytes(raw[: len(raw) - 20])  # a kill mid-write tore the last line
    again: dict = {}
    rows2, _ = build_rows(cfg, tiny_tokenizer, tiny_llama, again)
    assert rows2 == rows
    # the torn record's batch (items 2, 3) is generated again; only batch 0 came from the cache
    assert [(g["from_cache"], g["generated_now"]) for g in again["regenerated"]] == [(2, 2)]


def test_regeneration_resumed_after_a_partial_batch_draws_the_same_samples(tmp_path, tiny_llama, tiny_tokenizer):
    """T=1: a kill between two records of one batch (what the 2-3 writes of a batch used to allow) must not
    change what the resumed run samples."""
    whole, _ = build_rows(_regen_cfg(tmp_path / "a", regen_temperature=1.0), tiny_tokenizer, tiny_llama)
    cfg = _regen_cfg(tmp_path / "b", regen_temperature=1.0)
    build_rows(cfg, tiny_tokenizer, tiny_llama)
    cache = next((tmp_path / "b").glob("regen_code_*.jsonl"))
    lines = cache.read_bytes().splitlines(keepends=True)
    cache.write_bytes(b"".join(lines[:3]))  # batch 0 whole, batch 1 cut after its first record
    resumed, _ = build_rows(cfg, tiny_tokenizer, tiny_llama)
    assert resumed == whole


def test_conversation_dropped_beyond_max_len_is_counted(tmp_path, tiny_tokenizer, capsys):
    giant = {"conversations": [{"from": "human", "value": "x " * 400}, {"from": "gpt", "value": "ok"}]}
    p = tmp_path / "sg.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [GOOD] * 4 + [giant]))
    stats: dict = {}
    build_rows(DataConfig(kind="chat", source=str(p), max_len=32, val_rows=1), tiny_tokenizer, None, stats)
    assert stats["skipped"] == {"malformed": 0, "unmaskable": 0, "beyond_max_len": 1}
    assert "dropped 1 of 5 conversations" in capsys.readouterr().out


def test_eval_reads_sharegpt_prompt_files_as_training_does(tmp_path, tiny_tokenizer):
    from eval.bench.setup import load_prompts

    sg, oa = tmp_path / "sg.jsonl", tmp_path / "oa.jsonl"
    sg.write_text(json.dumps({**GOOD, "category": "chat"}) + "\n")
    oa.write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"},
                                           {"role": "assistant", "content": "hello"}], "category": "chat"}) + "\n")
    got, want = load_prompts(tiny_tokenizer, 1, 256, sg), load_prompts(tiny_tokenizer, 1, 256, oa)
    assert [p.ids for p in got] == [p.ids for p in want] and got[0].category == "chat"
    sg.write_text(json.dumps({"conversations": [{"from": "robot", "value": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"sg.jsonl line 1: conversations\[0\].from has unknown role 'robot'"):
        load_prompts(tiny_tokenizer, 1, 256, sg)


def _eval_cfg(target_dir, tmp_path, *over):
    from hydra import compose, initialize_config_dir

    from eval.bench.defaults import register
    from tests.faults.fault_helpers import CONF

    register()  # the registry's method rows (methods, checkpoints, options, ...) that conf/eval.yaml composes

    base = ["methods=[ar]", f"target.name_or_path={target_dir}", f"out_dir={tmp_path}/e", "max_new_tokens=2",
            "batch_sizes=[]", "peers=false", "repetitions=1", "warmup=0", "cost_reps=1", "temperatures=[0]",
            "progress=false", "draft_model=null", "decode_step=eager"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("eval", base + list(over))


def test_eval_with_fewer_prompts_than_asked_warns_and_records_both(target_dir, tmp_path, capsys):
    from eval.__main__ import run as eval_run

    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    res = eval_run(_eval_cfg(target_dir, tmp_path, f"prompts={p}", "n_prompts=50"))
    assert (res["prompts"]["n"], res["prompts"]["requested"]) == (3, 50)
    assert "warning: n_prompts=50 but" in capsys.readouterr().err
    saved = json.loads((tmp_path / "e" / "results.json").read_text())
    assert (saved["prompts"]["n"], saved["prompts"]["requested"]) == (3, 50)
    with pytest.raises(ValueError, match=r"n_prompts=50 but .* has only 3 usable prompts"):
        eval_run(_eval_cfg(target_dir, tmp_path, f"prompts={p}", "n_prompts=50", "require_n_prompts=true"))


def test_recommendation_of_zero_says_speculation_does_not_pay():
    from eval.bench.report import console_summary
    from tests.faults.fault_helpers import ROOT

    res = json.loads((ROOT / "bench" / "results" / "results.json").read_text())
    res.update(recommended_num_speculative_tokens=0, speculation_pays_at_batch_1=False)
    line = next(x for x in console_summary(res).splitlines() if x.startswith("recommended_num_speculative_tokens"))
    assert line.startswith("recommended_num_speculative_tokens=0") and "speculation does not pay" in line


@pytest.mark.parametrize("over,msg", [
    ("max_new_tokens=1", r"max_new_tokens=1: must be an integer >= 2"),
    ("seed=abc", r"seed='abc': must be an integer"),
])
def test_eval_settings_that_would_crash_after_the_benchmark_fail_up_front(target_dir, tmp_path, over, msg):
    from eval.__main__ import run as eval_run

    with pytest.raises(ValueError, match=msg):
        eval_run(_eval_cfg(target_dir, tmp_path, over))
    assert not (tmp_path / "e").exists()


def test_eval_variant_with_a_bad_option_names_the_variant(target_dir, trained, tmp_path):
    from eval.__main__ import run as eval_run

    cfg = _eval_cfg(target_dir, tmp_path, "methods=[ar,fast]", f"checkpoints.eagle3={trained}/final",
                    "+variants.fast={method: eagle3, num_speculative_tokens: abc}")
    with pytest.raises(ValueError,
                       match=r"^variants.fast: num_speculative_tokens must be a positive integer, got 'abc'"):
        eval_run(cfg)


def test_export_check_of_a_missing_path_and_a_bad_dtype(trained, tmp_path, capsys):
    assert _export(["--check", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --check {tmp_path / 'nope'}: no such file or directory"
    rc = _export([str(trained / "final"), "--format", "eagle3", "--out", str(tmp_path / "x"), "--dtype", "int8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --dtype int8: dtype 'int8' not understood")
    assert not (tmp_path / "x").exists()


def test_export_never_goes_inside_a_run_nor_touches_an_existing_tmp(trained, tmp_path, capsys):
    """An --out under final/ would be deleted by the next training run (final/ is replaced whole); an existing
    <out>.tmp is someone's directory, not the exporter's scratch space."""
    for out in (trained / "final" / "exp", trained / "checkpoints" / "exp"):
        assert _export([str(trained / "final"), "--format", "eagle3", "--out", str(out)]) == 2
        assert "training rewrites" in capsys.readouterr().err and not out.exists()
    out = tmp_path / "exp"
    (tmp_path / "exp.tmp").mkdir()
    (tmp_path / "exp.tmp" / "mine.txt").write_text("keep me")
    assert _export([str(trained / "final"), "--format", "eagle3", "--out", str(out)]) == 0
    assert (tmp_path / "exp.tmp" / "mine.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "exp.tmp"]  # no scratch directory left behind
