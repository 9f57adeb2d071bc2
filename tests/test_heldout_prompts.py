"""scripts/heldout_prompts.py: the prompt file it writes holds exactly the conversations that build_rows holds out
(their contexts render to the prefixes of the validation rows), none that a training row comes from."""

import importlib.util
import json
from pathlib import Path

import pytest

from data.chat import render_chat
from data.sources import DataConfig, build_rows

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("heldout_prompts", ROOT / "scripts" / "heldout_prompts.py")
heldout_prompts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heldout_prompts)


def _prefix(tok, messages) -> list[int]:
    return tok(render_chat(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def test_heldout_prompts_are_the_validation_rows_contexts(tmp_path, tiny_llama, tiny_tokenizer):
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i} " + "x " * (i % 5)},
                                                         {"from": "gpt", "value": f"answer {i}"}]}) + "\n"
                           for i in range(14)))
    cfg = DataConfig(kind="chat", source=str(src), max_len=128, val_rows=3, regenerate=8, regen_only=True,
                     regen_temperature=[0.0, 1.0], regen_new_tokens=3, regen_batch_size=2, regen_extra=[4],
                     regen_extra_dtype="float32", cache_dir=str(tmp_path / "cache"))
    train, val = build_rows(cfg, tiny_tokenizer, tiny_llama)
    rows = heldout_prompts.heldout_rows(cfg, tiny_tokenizer)
    assert len(rows) == len(val) == 3
    assert [r["question_id"] for r in rows] == sorted(r["question_id"] for r in rows)
    assert {r["category"] for r in rows} <= {"T0", "T1"}
    for r, v in zip(rows, val):
        p = _prefix(tiny_tokenizer, r["messages"])
        assert v["input_ids"][: len(p)] == p
    for r in rows:  # no training row starts with a held-out context
        p = _prefix(tiny_tokenizer, r["messages"])
        assert not any(t["input_ids"][: len(p)] == p for t in train), r["question_id"]
    with pytest.raises(ValueError, match="data.regen_only=true"):
        heldout_prompts.heldout_rows(DataConfig(**{**vars(cfg), "regen_only": False}), tiny_tokenizer)


def test_main_writes_a_prompt_file_eval_reads(tmp_path, monkeypatch, tiny_tokenizer):
    from eval.bench.setup import load_prompts

    rows = [{"question_id": 7, "category": "T0", "messages": [{"role": "user", "content": "why is the sky blue?"}]}]
    monkeypatch.setattr(heldout_prompts, "heldout_messages", lambda overrides: rows)
    out = tmp_path / "p" / "heldout.jsonl"
    assert heldout_prompts.main(["--out", str(out), "+recipe=x"]) == 0
    got = load_prompts(tiny_tokenizer, 1, 64, out)
    assert len(got) == 1 and got[0].ids == _prefix(tiny_tokenizer, rows[0]["messages"])


def test_a_held_out_conversation_repeating_a_training_one_is_dropped(tmp_path, tiny_llama, tiny_tokenizer):
    """ShareGPT repeats conversations: a held-out row whose first context (case and whitespace aside) is a training
    row's is dropped from the held-out side, in build_rows and in the prompt file alike; the training rows stay."""
    convs = [[{"from": "human", "value": f"question {i} " + "x " * (i % 5)}, {"from": "gpt", "value": f"answer {i}"}]
             for i in range(14)]
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))
    cfg = DataConfig(kind="chat", source=str(src), max_len=128, val_rows=3, regenerate=8, regen_only=True,
                     regen_temperature=[0.0, 1.0], regen_new_tokens=3, regen_batch_size=2,
                     cache_dir=str(tmp_path / "cache"))
    train, val = build_rows(cfg, tiny_tokenizer, tiny_llama)
    held = heldout_prompts.heldout_rows(cfg, tiny_tokenizer, train)
    assert len(val) == len(held) == 3
    # the same data, with one held-out conversation's question copied from a training one, louder and spaced out
    trained = next(i for i in range(14) if i not in {r["question_id"] for r in held}
                   and f"question {i} " in tiny_tokenizer.decode(train[0]["input_ids"]))
    dup = held[0]["question_id"]
    convs[dup] = [{"from": "human", "value": "  " + convs[trained][0]["value"].upper().replace(" ", "   ")},
                  {"from": "gpt", "value": "another answer"}]
    src.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))
    cfg2 = DataConfig(**{**vars(cfg), "cache_dir": str(tmp_path / "cache2")})
    stats: dict = {}
    train2, val2 = build_rows(cfg2, tiny_tokenizer, tiny_llama, stats)
    assert len(val2) == 2 and stats["held_out_duplicates_dropped"] == 1 and len(train2) == len(train)
    rows2 = heldout_prompts.heldout_rows(cfg2, tiny_tokenizer, train2)
    assert [r["question_id"] for r in rows2] == [r["question_id"] for r in held if r["question_id"] != dup]


def test_text_data_heldout_prompts_are_the_held_out_continuations_prompts(tmp_path):
    """data.kind=text (a base model, tiny Gemma 3): the prompt file holds the plain text each held-out continuation
    was asked of, in the split's order, read from the plan without generating."""
    from tests.families import make_family
    from tests.test_text_continuations import _cfg, _no_template

    model, tok = make_family("gemma3")
    tok = _no_template(tok)
    tok.add_tokens([f"<unused{i}>" for i in range(model.config.vocab_size - len(tok))])
    cfg = _cfg(tmp_path)
    train, val = build_rows(cfg, tok, model)
    rows = heldout_prompts.heldout_text_rows(cfg, tok)
    assert len(rows) == len(val) == cfg.val_rows and {r["category"] for r in rows} <= {"T0", "T1"}
    for r, v in zip(rows, val):
        asked = [t for t, m in zip(v["input_ids"], v["loss_mask"]) if not m]
        assert r["prompt"] == tok.decode(asked, skip_special_tokens=True)
    trained = {tok.decode([t for t, m in zip(x["input_ids"], x["loss_mask"]) if not m], skip_special_tokens=True)
               for x in train}
    assert not {r["prompt"] for r in rows} & trained
