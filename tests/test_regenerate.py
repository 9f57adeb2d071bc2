"""data/regenerate.py with the tiny random Llama: shapes, greedy == a manual greedy loop, resume."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from data.chat import render_chat
from data.regenerate import regenerate_continuations, regenerate_conversations

CONVS = [
    [{"role": "system", "content": "You write Python."},
     {"role": "user", "content": "How do I add two numbers?"},
     {"role": "assistant", "content": "def add(a, b): return a + b"},
     {"role": "user", "content": "And print it?"},
     {"role": "assistant", "content": "print(add(1, 2))"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
    [{"role": "user", "content": "What is the weather like today?"}, {"role": "assistant", "content": "fine"}],
    [{"role": "user", "content": "Loop?"}, {"role": "assistant", "content": "for i in range(10): print(i)"},
     {"role": "user", "content": "thanks"}],
]
MAX_NEW = 6


def manual_greedy(model, ids: list[int], stops: set[int], max_new: int) -> list[int]:
    """Reference: one sequence, no padding, no cache, argmax of the full forward at each step."""
    seq = list(ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            new.append(nxt)
            if nxt in stops:
                break
    return new


class CountingGenerate:
    """Wraps data.regenerate's batched generation and records the prompts of every call."""

    def __init__(self):
        import data.regenerate as regen

        self.inner = regen.generate_batch
        self.prompts: list[list[int]] = []
        self.calls = 0

    def __call__(self, model, prompts, *args, **kw):
        self.calls += 1
        self.prompts += [list(p) for p in prompts]
        return self.inner(model, prompts, *args, **kw)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_conversations_shapes_and_greedy_equals_manual_loop(tmp_path, tiny_llama, tiny_tokenizer):
    tok = tiny_tokenizer
    out_path = tmp_path / "regen.jsonl"
    out = regenerate_conversations(tiny_llama, tok, CONVS, out_path, batch_size=3, max_new_tokens=MAX_NEW)
    assert len(out) == len(CONVS)
    for orig, new in zip(CONVS, out):
        assert [m["role"] for m in new] == [m["role"] for m in orig]
        for o, n in zip(orig, new):
            if o["role"] != "assistant":
                assert n["content"] == o["content"]
    assert [r["index"] for r in _lines(out_path)] == [0, 1, 2, 3]
    assert [r["messages"] for r in _lines(out_path)] == out
    # every assistant turn (including the second turn of conversation 0, whose context holds the
    # regenerated first reply) equals a greedy loop run on that context alone
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")}
    for new in out:
        for j, m in enumerate(new):
            if m["role"] != "assistant":
                continue
            prompt = tok(render_chat(tok, new[:j], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            ref = manual_greedy(tiny_llama, prompt, stops, MAX_NEW)
            if ref and ref[-1] in stops:
                ref = ref[:-1]
            assert m["content"] == tok.decode(ref, skip_special_tokens=False)
    # the random model does not simply echo the dataset
    assert [m["content"] for m in out[1]] != [m["content"] for m in CONVS[1]]


def test_continuations_shapes_and_greedy_equals_manual_loop(tmp_path, tiny_llama, tiny_tokenizer):
    tok = tiny_tokenizer
    prompts = [tok(t)["input_ids"] for t in ["def add(a, b):\n", "import os\nimport sys\n\nprint(", "class"]]
    rows = regenerate_continuations(tiny_llama, tok, prompts, tmp_path / "cont.jsonl", batch_size=3, max_new_tokens=8)
    assert len(rows) == 3
    for p, r in zip(prompts, rows):
        n_new = len(r["input_ids"]) - len(p)
        assert r["input_ids"][:len(p)] == p
        assert r["loss_mask"] == [0] * len(p) + [1] * n_new
        assert 1 <= n_new <= 8
        if n_new < 8:
            assert r["input_ids"][-1] == tok.eos_token_id
        # greedy in a left-padded batch == the unpadded manual loop
        assert r["input_ids"][len(p):] == manual_greedy(tiny_llama, p, {tok.eos_token_id}, 8)
    assert len({len(p) for p in prompts}) == 3  # the batch really needed padding


def test_continuations_resume_generates_only_missing_items(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch):
    tok = tiny_tokenizer
    prompts = [tok(t)["input_ids"] for t in ["def f(x):\n", "for i in", "import os\n", "Hello, how"]]
    full = regenerate_continuations(tiny_llama, tok, prompts, tmp_path / "a.jsonl", batch_size=2, max_new_tokens=5)

    path = tmp_path / "b.jsonl"
    regenerate_continuations(tiny_llama, tok, prompts, path, batch_size=2, max_new_tokens=5)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]))  # interrupted after the first batch

    counter = CountingGenerate()
    monkeypatch.setattr("data.regenerate.generate_batch", counter)
    resumed = regenerate_continuations(tiny_llama, tok, prompts, path, batch_size=2, max_new_tokens=5)
    assert resumed == full
    assert counter.calls == 1 and counter.prompts == [prompts[2], prompts[3]]
    assert sorted(r["index"] for r in _lines(path)) == [0, 1, 2, 3]

    # complete file: nothing is generated at all
    counter.calls = 0
    assert regenerate_continuations(tiny_llama, tok, prompts, path, batch_size=2, max_new_tokens=5) == full
    assert counter.calls == 0


def test_conversations_resume_and_torn_last_line(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch):
    tok = tiny_tokenizer
    full = regenerate_conversations(tiny_llama, tok, CONVS, tmp_path / "a.jsonl", batch_size=2,
                                    max_new_tokens=MAX_NEW)
    path = tmp_path / "b.jsonl"
    regenerate_conversations(tiny_llama, tok, CONVS, path, batch_size=2, max_new_tokens=MAX_NEW)
    lines = path.read_text().splitlines(keepends=True)
    # two finished lines plus half of a third (a crash mid-write)
    path.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])

    counter = CountingGenerate()
    monkeypatch.setattr("data.regenerate.generate_batch", counter)
    resumed = regenerate_conversations(tiny_llama, tok, CONVS, path, batch_size=2, max_new_tokens=MAX_NEW)
    assert resumed == full
    # items 2 and 3 have one assistant turn each: one batch, one generate call, their prompts only
    expected = [tok(render_chat(tok, CONVS[i][:1], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                for i in (2, 3)]
    assert counter.calls == 1 and counter.prompts == expected
    recs = _lines(path)  # the torn line was cut, every line parses
    assert sorted(r["index"] for r in recs) == [0, 1, 2, 3]


def test_resume_refuses_a_file_written_for_other_inputs(tmp_path, tiny_llama, tiny_tokenizer):
    tok = tiny_tokenizer
    path = tmp_path / "c.jsonl"
    regenerate_conversations(tiny_llama, tok, CONVS[:2], path, batch_size=2, max_new_tokens=2)
    other = [CONVS[1], CONVS[0]]
    with pytest.raises(ValueError, match="stored item 0 does not match input item 0"):
        regenerate_conversations(tiny_llama, tok, other, path, batch_size=2, max_new_tokens=2)
    cpath = tmp_path / "d.jsonl"
    regenerate_continuations(tiny_llama, tok, [[0, 5, 6]], cpath, max_new_tokens=2)
    with pytest.raises(ValueError, match="stored item 0 does not match"):
        regenerate_continuations(tiny_llama, tok, [[0, 5, 7]], cpath, max_new_tokens=2)


def test_sampling_is_seeded_and_leaves_global_rng_alone(tmp_path, tiny_llama, tiny_tokenizer):
    tok = tiny_tokenizer
    prompts = [tok(t)["input_ids"] for t in ["def add(a, b):\n", "for i in range(10):\n"]]
    state = torch.get_rng_state()
    run = lambda name, seed: regenerate_continuations(tiny_llama, tok, prompts, tmp_path / name, batch_size=2,
                                                      max_new_tokens=10, temperature=1.0, seed=seed)
    a, b, c = run("s0.jsonl", 0), run("s0b.jsonl", 0), run("s1.jsonl", 1)
    assert torch.equal(torch.get_rng_state(), state)
    assert a == b
    assert a != c
    greedy = regenerate_continuations(tiny_llama, tok, prompts, tmp_path / "g.jsonl", batch_size=2, max_new_tokens=10)
    assert a != greedy


def test_chat_regeneration_of_n_conversations_split_over_temperatures(tmp_path, tiny_llama, tiny_tokenizer):
    """data.regenerate=N (N > 1) on chat data: N conversations, split round-robin over regen_temperature=[0, 1],
    each group in its own keyed cache; the others keep their dataset replies; a reply-to-nothing turn (ShareGPT V3
    chunks open with one) is never regenerated and a long first prompt is not picked."""
    from data.sources import DataConfig, _regenerated_chat

    convs = [[{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(6)]
    convs.append([{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "long"}])
    convs.append([{"role": "assistant", "content": "a reply to nothing"}])
    cfg = DataConfig(kind="chat", max_len=128, regenerate=4, regen_temperature=[0.0, 1.0], regen_new_tokens=4,
                     regen_batch_size=2, cache_dir=str(tmp_path))
    stats: dict = {}
    out = _regenerated_chat(cfg, tiny_llama, tiny_tokenizer, convs, stats)
    groups = stats["regenerated"]
    assert [g["temperature"] for g in groups] == [0.0, 1.0]
    assert [g["continuations"] for g in groups] == [2, 2] and all(g["generated_now"] == 2 for g in groups)
    assert len({g["cache"] for g in groups}) == 2  # one keyed file per temperature
    changed = [i for i, (a, b) in enumerate(zip(convs, out)) if a != b]
    kept = [i for i in range(len(convs)) if out[i] == convs[i]]
    assert len(changed) <= 4 and len(kept) >= 4
    assert out[6] == convs[6] and out[7] == convs[7]  # the long prompt and the reply to nothing are left alone
    assert all(out[i][0] == convs[i][0] for i in range(6))  # user turns verbatim
    # a rerun reads both groups from their caches
    stats2: dict = {}
    assert _regenerated_chat(cfg, tiny_llama, tiny_tokenizer, convs, stats2) == out
    assert all(g["from_cache"] == 2 and g["generated_now"] == 0 for g in stats2["regenerated"])


def test_first_exchanges_drops_leading_replies_and_cuts_after_n():
    from data.sources import first_exchanges

    conv = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    assert [m["content"] for m in first_exchanges(conv, 1)] == ["s", "u1", "a1"]
    assert [m["content"] for m in first_exchanges(conv, 2)] == ["s", "u1", "a1", "u2", "a2"]
    with pytest.raises(ValueError, match="max_turns"):
        first_exchanges(conv, 0)


def test_on_policy_chat_data_extra_turns_regen_only_and_shipped(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch):
    """extra_turn_share keeps a second exchange for that share; regen_only trains on the regenerated conversations
    alone; a packed cache (pack_cache_file) is unpacked on a fresh cache_dir and nothing is generated again."""
    from data.regen_cache import pack_cache_file
    from data.sources import DataConfig, build_rows, chat_conversations

    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"question {i}?"}, {"from": "gpt", "value": f"answer {i}"},
        {"from": "human", "value": f"and {i}?"}, {"from": "gpt", "value": f"more {i}"}]}) + "\n" for i in range(8)))
    cfg = DataConfig(kind="chat", source=str(src), max_len=256, max_turns=1, extra_turn_share=0.5, val_rows=1,
                     regenerate=4, regen_only=True, regen_temperature=0.0, regen_new_tokens=3, regen_batch_size=2,
                     cache_dir=str(tmp_path / "cache"))
    convs, _ = chat_conversations(cfg)
    assert sorted(sum(m["role"] == "assistant" for m in c) for c in convs) == [1] * 4 + [2] * 4
    train, val = build_rows(cfg, tiny_tokenizer, tiny_llama)
    assert len(train) + len(val) == 4 and len(val) == 1  # only the 4 regenerated conversations

    cached = list((tmp_path / "cache").glob("regen_chat_*.jsonl"))
    assert len(cached) == 1
    ledger = [json.loads(x) for x in (cached[0].parent / ("ledger_" + cached[0].name)).read_text().splitlines()]
    # continuous batching (the default): one ledger line per 16 finished conversations and one for the rest
    assert [b["items"] for b in ledger] == [4] and all(b["seconds"] > 0 and b["refill"] for b in ledger)
    assert sum(b["new_tokens"] for b in ledger) == sum(json.loads(x)["new_tokens"]
                                                       for x in cached[0].read_text().splitlines()) > 0
    shipped = tmp_path / "shipped"
    assert len(pack_cache_file(cached[0], shipped / (cached[0].name + ".gz"))) == 4
    gz = shipped / (cached[0].name + ".gz")  # shipping again with nothing new leaves the bytes, even another header
    other = gzip.compress(gzip.decompress(gz.read_bytes()), mtime=12345)
    gz.write_bytes(other)
    assert len(pack_cache_file(cached[0], gz)) == 4 and gz.read_bytes() == other

    def no_generation(*a, **k):
        raise AssertionError("a shipped regeneration must not be generated again")

    monkeypatch.setattr("data.regenerate.generate_batch", no_generation)
    fresh = DataConfig(**{**vars(cfg), "cache_dir": str(tmp_path / "fresh"), "shipped_dir": str(shipped)})
    assert build_rows(fresh, tiny_tokenizer, tiny_llama) == (train, val)
    with pytest.raises(ValueError, match="regen_only=true needs data.regenerate"):
        build_rows(DataConfig(**{**vars(cfg), "regenerate": 0}), tiny_tokenizer, tiny_llama)


def test_a_turn_whose_prompt_outgrows_the_window_is_kept_verbatim(tmp_path, tiny_llama, tiny_tokenizer):
    """max_prompt_tokens: the first reply is the target's; the second, after a long question, keeps its dataset text
    (it would start past the training window), and so does everything after it."""
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old one"},
            {"role": "user", "content": "why " * 200}, {"role": "assistant", "content": "old two"}]
    out = regenerate_conversations(tiny_llama, tiny_tokenizer, [conv], tmp_path / "r.jsonl", max_new_tokens=3,
                                   max_prompt_tokens=64)[0]
    assert out[1]["content"] != "old one" and out[3]["content"] == "old two" and out[2] == conv[2]
    full = regenerate_conversations(tiny_llama, tiny_tokenizer, [conv], tmp_path / "s.jsonl", max_new_tokens=3)[0]
    assert full[1] == out[1] and full[3]["content"] != "old two"


def test_regenerate_then_ship_writes_packed_files_and_a_manifest(tmp_path, target_dir):
    """train.regenerate: one temperature group at a time, then --ship packs the cache with its ledger and a manifest
    (target identity, sampling, source indices, timed tokens/s).
    A prompt holding U+2028 (a line separator to str.splitlines, not to JSONL) is counted like any other."""
    from train.regenerate import regenerate, ship

    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}?\u2028and"},
                                                         {"from": "gpt", "value": f"a{i}"}]},
                                      ensure_ascii=False) + "\n"
                           for i in range(6)))
    over = [f"target.name_or_path={target_dir}", "data=sharegpt", f"data.source={src}", "data.regenerate=4",
            "data.regen_temperature=[0.0,1.0]", "data.regen_new_tokens=3", "data.regen_batch_size=2",
            f"data.cache_dir={tmp_path / 'cache'}", f"data.shipped_dir={tmp_path / 'shipped'}", "data.max_len=64"]
    got = regenerate(over, [0.0], threads=0)
    assert [g["temperature"] for g in got["groups"]] == [0.0]  # only the group asked for
    manifest = ship(over)
    files = {f["temperature"]: f for f in manifest["files"]}
    assert files[0.0]["done"] == 2 and 1.0 not in files  # T=1 not generated yet: nothing shipped for it
    assert files[0.0]["timed_batches"] == 1 and files[0.0]["new_tokens_per_s"] > 0
    assert manifest["target"]["embed_fingerprint"] and manifest["data_config"]["regenerate"] == 4
    assert (tmp_path / "shipped" / "manifest.json").exists()
    assert (tmp_path / "shipped" / files[0.0]["file"]).exists()
    # a cache unpacked from the shipped files has no ledger of its own: shipping again keeps the shipped one's timing
    for led in (tmp_path / "cache").glob("ledger_*"):
        led.unlink()
    again = {f["temperature"]: f for f in ship(over)["files"]}
    assert again[0.0]["timed_batches"] == 1 and again[0.0]["new_tokens_per_s"] == files[0.0]["new_tokens_per_s"]
    # a second tranche: its generated group ships beside the first's, marked, with its dtype and generator
    more = over + ["data.regen_extra=2", "data.regen_extra_dtype=bfloat16"]
    regenerate(more, [1.0], threads=0)
    extra = [f for f in ship(more)["files"] if f["extra"]]
    assert [(f["temperature"], f["done"], f["dtype"], f["refill"]) for f in extra] == [(1.0, 1, "bfloat16", True)]


def test_regenerate_fills_the_code_corpus_cache_a_training_run_then_reads(tmp_path, target_dir):
    """train.regenerate on the code corpus (data.kind=code) writes the continuations' keyed cache; building the
    same data afterwards generates nothing. --temperature is refused there (it picks chat groups)."""
    from data.sources import DataConfig, build_rows
    from models.core.target import FrozenTarget
    from train.regenerate import regenerate

    over = [f"target.name_or_path={target_dir}", "data.regenerate=3", "data.max_rows=6", "data.max_len=48",
            "data.regen_new_tokens=3", "data.regen_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}"]
    got = regenerate(over, None, threads=0)
    assert [(g["continuations"], g["generated_now"]) for g in got["groups"]] == [(3, 3)]
    tgt = FrozenTarget.from_pretrained(str(target_dir))
    stats: dict = {}
    build_rows(DataConfig(kind="code", max_len=48, max_rows=6, val_rows=2, regenerate=3, regen_new_tokens=3,
                          regen_batch_size=2, cache_dir=str(tmp_path / "cache")), tgt.tokenizer, tgt.model, stats)
    assert [(g["continuations"], g["generated_now"]) for g in stats["regenerated"]] == [(3, 0)]
    with pytest.raises(ValueError, match="--temperature picks chat groups"):
        regenerate(over, [0.0], threads=0)


def test_a_second_tranche_trains_only_and_leaves_the_first_and_its_held_out_rows_alone(tmp_path, tiny_llama,
                                                                                     tiny_tokenizer, capsys):
    """data.regen_extra=M: M more conversations, none of the first N, in their own keyed files (their dtype and
    generator in the key); the first N's files are read as they are and the held-out rows do not move; the new
    rows come after the old training rows (so the old feature-cache shards stay valid)."""
    from data.sources import DataConfig, build_rows, regen_plan

    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i}?"},
                                                         {"from": "gpt", "value": f"answer {i}"}]}) + "\n"
                           for i in range(14)))
    cfg = DataConfig(kind="chat", source=str(src), max_len=128, val_rows=2, regenerate=6, regen_only=True,
                     regen_temperature=[0.0, 1.0], regen_new_tokens=3, regen_batch_size=2, regen_refill=False,
                     cache_dir=str(tmp_path / "cache"))
    train, val = build_rows(cfg, tiny_tokenizer, tiny_llama)
    first = {p: p.read_bytes() for p in (tmp_path / "cache").glob("regen_chat_*.jsonl")}
    more = DataConfig(**{**vars(cfg), "regen_extra": 5, "regen_extra_dtype": "bfloat16"})
    stats: dict = {}
    train2, val2 = build_rows(more, tiny_tokenizer, tiny_llama, stats)
    assert val2 == val and train2[: len(train)] == train and len(train2) == len(train) + 5
    assert {p: p.read_bytes() for p in first} == first  # the first tranche's files untouched
    groups = stats["regenerated"]
    assert [(g["extra"], g["from_cache"], g["generated_now"]) for g in groups] == [
        (False, 3, 0), (False, 3, 0), (True, 0, 3), (True, 0, 2)]
    keys = [json.loads(p.with_suffix(".key.json").read_text()) for p in map(Path, (g["cache"] for g in groups[2:]))]
    assert all(k["dtype"] == "bfloat16" and k["generator"] == "draftsmith.refill/2" for k in keys)
    convs = [[{"role": "user", "content": f"question {i}?"}] for i in range(14)]
    a = {i for _, g in regen_plan(more, tiny_tokenizer, convs) for i in g}
    b = {i for _, g in regen_plan(more, tiny_tokenizer, convs, extra=1) for i in g}
    assert len(a) == 6 and len(b) == 5 and not a & b
    # more than are left: the rest, said
    rest = {i for _, g in regen_plan(DataConfig(**{**vars(more), "regen_extra": 50}), tiny_tokenizer, convs,
                                     extra=1) for i in g}
    assert rest == set(range(14)) - a and "only 8 of 14 conversations are left" in capsys.readouterr().out
    with pytest.raises(ValueError, match="regen_extra and data.regen_later need data.regen_only"):
        build_rows(DataConfig(**{**vars(more), "regen_only": False}), tiny_tokenizer, tiny_llama)
    with pytest.raises(ValueError, match="already takes all 14"):
        regen_plan(DataConfig(**{**vars(more), "regenerate": "all"}), tiny_tokenizer, convs, extra=1)
    third = DataConfig(**{**vars(more), "regen_extra": [5, 2]})
    stats3: dict = {}
    train3, val3 = build_rows(third, tiny_tokenizer, tiny_llama, stats3)
    assert val3 == val and train3[: len(train2)] == train2 and len(train3) == len(train2) + 2
    assert [(g["tranche"], g["from_cache"], g["generated_now"]) for g in stats3["regenerated"]] == [
        (0, 3, 0), (0, 3, 0), (1, 3, 0), (1, 2, 0), (2, 0, 1), (2, 0, 1)]
    c = {i for _, g in regen_plan(third, tiny_tokenizer, convs, extra=2) for i in g}
    assert {i for _, g in regen_plan(third, tiny_tokenizer, convs, extra=1) for i in g} == b
    assert len(c) == 2 and not c & (a | b)
    with pytest.raises(ValueError, match="each tranche a number of conversations"):
        regen_plan(DataConfig(**{**vars(more), "regen_extra": [5, 0]}), tiny_tokenizer, convs, extra=1)


def test_refill_regeneration_resumes_to_the_same_records(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch):
    """Continuous batching (refill=True): greedy replies equal the fixed-batch ones; sampled ones do not depend on
    the batch size; a run killed after its first records resumes to exactly an uninterrupted run's records."""
    import data.regenerate as regen
    from data import resumable

    convs = CONVS * 3
    kw = dict(max_new_tokens=MAX_NEW, max_prompt_tokens=200)
    fixed = regenerate_conversations(tiny_llama, tiny_tokenizer, convs, tmp_path / "f.jsonl", batch_size=3, **kw)
    assert regenerate_conversations(tiny_llama, tiny_tokenizer, convs, tmp_path / "r.jsonl", batch_size=3,
                                    refill=True, **kw) == fixed
    hot = dict(kw, temperature=1.0, seed=5, refill=True)
    whole = regenerate_conversations(tiny_llama, tiny_tokenizer, convs, tmp_path / "a.jsonl", batch_size=4, **hot)
    assert regenerate_conversations(tiny_llama, tiny_tokenizer, convs, tmp_path / "b.jsonl", batch_size=2,
                                    **hot) == whole
    real_append, calls = resumable.append, {"n": 0}

    def killed_after_first_flush(path, records):
        if path.name == "c.jsonl":
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
        real_append(path, records)

    monkeypatch.setattr(resumable, "append", killed_after_first_flush)
    monkeypatch.setattr(regen._RefillRun.__init__, "__defaults__", (4,))  # flush every 4 conversations
    with pytest.raises(KeyboardInterrupt):
        regenerate_conversations(tiny_llama, tiny_tokenizer, convs, tmp_path / "c.jsonl", batch_size=3, **hot)
    assert len(resumable.load_done(tmp_path / "c.jsonl")) == 4
    stats: dict = {}
    assert regenerate_conversations(tiny_llama, tiny_tokenizer, convs, tmp_path / "c.jsonl", batch_size=3,
                                    stats=stats, **hot) == whole
    assert stats == {"generated": len(convs) - 4, "from_cache": 4}


def test_later_turn_prompts_are_a_training_tranche_that_leaves_earlier_data_and_the_held_out_split_alone(
        tmp_path, tiny_llama, tiny_tokenizer):
    """data.regen_later=M: M conversations made of a later user turn alone (>= LATER_MIN_WORDS words; system turns
    kept), answered by the target, after every other tranche's rows; the first tranche, its held-out rows and its
    files stay as they were, and no later turn comes from a conversation the held-out split may hold."""
    from data.sources import LATER_KEY, DataConfig, build_rows, chat_conversations, later_plan, later_turns, regen_plan

    def conv(i):
        return [{"from": "system", "value": "Be brief."},
                {"from": "human", "value": f"question {i}?"}, {"from": "gpt", "value": f"answer {i}"},
                {"from": "human", "value": f"now please explain the same idea again in words number {i}"},
                {"from": "gpt", "value": f"reply {i}"},
                {"from": "human", "value": "thanks"}, {"from": "gpt", "value": "welcome"}]

    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": conv(i)}) + "\n" for i in range(14)))
    cfg = DataConfig(kind="chat", source=str(src), max_len=320, max_turns=1, val_rows=2, regenerate=6,
                     regen_only=True, regen_temperature=[0.0, 1.0], regen_new_tokens=3, regen_batch_size=2,
                     cache_dir=str(tmp_path / "cache"))
    train, val = build_rows(cfg, tiny_tokenizer, tiny_llama)
    first = {p: p.read_bytes() for p in (tmp_path / "cache").glob("regen_chat_*.jsonl")}

    more = DataConfig(**{**vars(cfg), "regen_later": 4})
    convs, _ = chat_conversations(more)
    assert len(convs) == 14 + 14  # one later turn of each is long enough; "thanks" is not
    assert convs[20] == [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "now please explain the same idea again in words number 6",
                          LATER_KEY: [6, 2]},
                         {"role": "assistant", "content": "reply 6"}]
    assert later_turns([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], 0) == []
    stats: dict = {}
    train2, val2 = build_rows(more, tiny_tokenizer, tiny_llama, stats)
    assert val2 == val and train2[: len(train)] == train and len(train2) == len(train) + 4
    assert {p: p.read_bytes() for p in first} == first
    assert [(g["tranche"], g["generated_now"]) for g in stats["regenerated"]] == [(0, 0), (0, 0), (1, 2), (1, 2)]
    records = [json.loads(x) for g in stats["regenerated"][2:] for x in Path(g["cache"]).read_text().splitlines()]
    assert all([m["role"] for m in r["messages"]] == ["system", "user", "assistant"] and
               r["messages"][1]["content"].startswith("now please explain") for r in records)

    plen = {i: 1 for i in range(len(convs))}  # every prompt fits
    picked = sorted(i for _, g in regen_plan(more, tiny_tokenizer, convs, plen=plen) for i in g)
    held = set(picked[-4:])  # the last 2 x val_rows of the first tranche, in dataset order
    a = {i for _, g in later_plan(more, convs, 1, plen) for i in g}
    two = DataConfig(**{**vars(more), "regen_later": [4, 50]})
    b = {i for _, g in later_plan(two, convs, 2, plen) for i in g}
    assert len(a) == 4 and not a & b and len(a | b) == 14 - len(held)
    assert all(i >= 14 and convs[i][1][LATER_KEY][0] not in held for i in a | b)
    with pytest.raises(ValueError, match="regen_later needs data.regenerate and data.regen_only"):
        chat_conversations(DataConfig(**{**vars(more), "regen_only": False}))
    with pytest.raises(ValueError, match="each tranche a number of prompts"):
        chat_conversations(DataConfig(**{**vars(more), "regen_later": [3, 0]}))
