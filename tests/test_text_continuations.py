"""data.kind=text (data/continuations.py, data/sources.py text_plan / text_rows): a base model's on-policy data, its
own continuations of plain-text prompts made from conversations, with tiny models built in code (no chat template)."""

from __future__ import annotations

import copy
import json

import pytest

from data.continuations import plain_text
from data.sources import DataConfig, build_rows, row_context_key, text_plan
from eval.bench.setup import PROMPTS_DIR
from tests.families import WINDOW, make_family
from tests.test_regenerate import CountingGenerate, manual_greedy

MT_BENCH = json.loads(PROMPTS_DIR.joinpath("mt_bench.jsonl").read_text().splitlines()[0])["turns"][0]
HUMANEVAL = json.loads(PROMPTS_DIR.joinpath("humaneval.jsonl").read_text().splitlines()[0])["prompt"]


def _source(tmp_path, n: int = 12) -> str:
    """n distinct conversations, one of them twice, a "hi", and two that hold benchmark prompts (an MT-Bench
    question verbatim, a HumanEval prompt in a request)."""
    convs = [(f"Please tell me about topic number {i} in some detail, with an example or two.",
              f"Topic {i} is about loops. For example: for i in range({i}): print(i)") for i in range(n)]
    convs[5:5] = [convs[3], ("hi", "Hello! How can I help you today?"), (MT_BENCH, "Aloha!"),
                  (HUMANEVAL + "\nFinish this function for me, please.", "Sure.")]
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": a}]})
                           + "\n" for u, a in convs))
    return str(src)


def _no_template(tok):
    """The tokenizer as a base model ships it: without a chat template."""
    tok = copy.deepcopy(tok)
    tok.chat_template = None
    return tok


def _cfg(tmp_path, **kw) -> DataConfig:
    base = dict(kind="text", source=_source(tmp_path), max_len=72, val_rows=3, regenerate="all", regen_prompt_len=64,
                regen_new_tokens=8, regen_batch_size=3, regen_temperature=[0.0, 1.0], reply_opening_share=0.5,
                cache_dir=str(tmp_path / "cache"))
    return DataConfig(**{**base, **kw})


def test_prompts_are_plain_text_cut_to_the_budget_deduplicated_and_never_benchmark(tmp_path, tiny_tokenizer):
    from data.sources import chat_conversations
    from models.core.tokenizer import ROLE_TOKENS

    tok = _no_template(tiny_tokenizer)
    cfg = _cfg(tmp_path, reply_opening_share=1.0, regen_prompt_len=160, max_len=168)  # ~1 char a token
    convs, _ = chat_conversations(cfg)
    prompts = text_plan(cfg, tok, convs)[0]
    # the repeat, "hi" and both benchmark prompts are left out; the 12 distinct ones remain
    assert sorted(prompts) == [i for i in range(16) if i not in (5, 6, 7, 8)]
    roles = set(tok.convert_tokens_to_ids(ROLE_TOKENS))
    for i, ids in prompts.items():
        text = f"{convs[i][0]['content']}\n\n{convs[i][1]['content']}"  # the user turn runs into the reply
        assert ids == [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"][:159]
        assert not roles & set(ids)
    assert "\n\n" not in plain_text(convs[0], opening=False)
    assert sorted(text_plan(DataConfig(**{**vars(cfg), "reply_opening_share": 0.0}), tok, convs)[0]) == sorted(prompts)
    with pytest.raises(ValueError, match="data.max_len=72"):
        text_plan(_cfg(tmp_path, regen_new_tokens=9), tok, convs)
    with pytest.raises(ValueError, match="needs data.regenerate"):
        build_rows(_cfg(tmp_path, regenerate=0), tok)


def test_rows_mask_the_continuation_hold_out_by_content_and_greedy_is_the_targets(tmp_path, monkeypatch):
    """A tiny Gemma 3 (sliding window 16: prompt + continuation run past it) continues every prompt; at T=0 it is
    the target's greedy continuation. A killed regeneration resumes to the same rows, generating only the rest."""
    from data.regenerate import stop_token_ids
    from data.sources import chat_conversations

    model, tok = make_family("gemma3")
    tok = _no_template(tok)
    # the real Gemma tokenizer names every row of the model's vocabulary (<unusedN> too); random weights sample them
    tok.add_tokens([f"<unused{i}>" for i in range(model.config.vocab_size - len(tok))])
    cfg = _cfg(tmp_path)
    train, val = build_rows(cfg, tok, model)
    prompts, groups = text_plan(cfg, tok, chat_conversations(cfg)[0])
    by_index = dict(zip(sorted(prompts), train + val))
    assert len(train) + len(val) == len(prompts) and len(val) == 3 and len(prompts[0]) > WINDOW
    stops = set(stop_token_ids(tok, model, turn_end=False))
    assert not {row_context_key(tok, r) for r in val} & {row_context_key(tok, r) for r in train}
    greedy = dict(groups)[0.0]
    for i, row in by_index.items():
        p = prompts[i]
        n_new = len(row["input_ids"]) - len(p)
        assert row["input_ids"][: len(p)] == p and row["loss_mask"] == [0] * len(p) + [1] * n_new
        assert 1 <= n_new <= cfg.regen_new_tokens
        if i in greedy:
            assert row["input_ids"][len(p) :] == manual_greedy(model, p, stops, cfg.regen_new_tokens)

    cache = sorted((tmp_path / "cache").glob("regen_text_*.jsonl"))
    assert len(cache) == 2
    lines = cache[0].read_text().splitlines(keepends=True)
    cache[0].write_text("".join(lines[:3]) + lines[3][:20])  # killed mid-write, after the first batch of 3
    counter = CountingGenerate()
    monkeypatch.setattr("data.regenerate.generate_batch", counter)
    assert build_rows(cfg, tok, model) == (train, val)
    assert len(counter.prompts) == len(lines) - 3 and counter.calls == -(-len(counter.prompts) // 3)


def test_regenerate_one_temperature_then_ship_and_a_fresh_machine_unpacks(tmp_path, target_dir, monkeypatch):
    """train.regenerate on conf/data/sharegpt_gemma3_continuations.yaml (shrunk): one temperature's group, then
    --ship packs it with a manifest; a fresh cache_dir reads the shipped rows and generates nothing."""
    from models.core.target import FrozenTarget
    from train.regenerate import regenerate, ship

    src = _source(tmp_path)
    over = [f"target.name_or_path={target_dir}", "data=sharegpt_gemma3_continuations", f"data.source={src}",
            "data.regenerate=6", "data.val_rows=2", "data.max_len=72", "data.regen_prompt_len=64",
            "data.regen_new_tokens=4", "data.regen_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}",
            f"data.shipped_dir={tmp_path / 'shipped'}"]
    assert [g["temperature"] for g in regenerate(over, [0.0], threads=0)["groups"]] == [0.0]
    regenerate(over, [1.0], threads=0)
    manifest = ship(over)
    assert [(f["temperature"], f["prompts"], f["done"]) for f in manifest["files"]] == [(0.0, 3, 3), (1.0, 3, 3)]
    assert all(f["continuation_tokens"] > 0 and f["file"].startswith("regen_text_") for f in manifest["files"])
    assert manifest["data_config"]["kind"] == "text" and "Gemma Terms of Use" in manifest["license"]

    def no_generation(*a, **k):
        raise AssertionError("shipped continuations must not be generated again")

    tgt = FrozenTarget.from_pretrained(str(target_dir))
    cfg = dict(kind="text", source=src, regenerate=6, val_rows=2, max_len=72, regen_prompt_len=64,
               regen_new_tokens=4, regen_batch_size=2, regen_temperature=[0.0, 1.0])
    rows = build_rows(DataConfig(**cfg, cache_dir=str(tmp_path / "cache")), tgt.tokenizer, tgt.model)
    monkeypatch.setattr("data.regenerate.generate_batch", no_generation)
    fresh = DataConfig(**cfg, cache_dir=str(tmp_path / "fresh"), shipped_dir=str(tmp_path / "shipped"))
    assert build_rows(fresh, tgt.tokenizer, tgt.model) == rows and len(rows[1]) == 2
