"""data/chat.py: loading ShareGPT/OpenAI rows, assistant-only loss masks, malformed-data errors."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.chat import (
    MalformedRowError,
    build_chat_dataset,
    check_token_ids,
    load_conversations,
    load_rows,
    normalize_conversation,
    tokenize_conversation,
)

SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "You write Python."},
        {"from": "human", "value": "How do I add two numbers?"},
        {"from": "gpt", "value": "def add(a, b):\n    return a + b\n"},
        {"from": "human", "value": "And print it?"},
        {"from": "gpt", "value": "print(add(1, 2))"},
    ]},
    {"id": "b", "conversations": [
        {"from": "user", "value": "hi"},
        {"from": "chatgpt", "value": "Hello, how are you?"},
    ]},
]
OPENAI = [
    {"messages": [
        {"role": "user", "content": "What is the weather like today?"},
        {"role": "assistant", "content": "I am fine, thank you. "},  # trailing space is part of the reply
    ]},
    {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Loop?"},
        {"role": "assistant", "content": "for i in range(10):\n    print(i * i)\n"},
    ]},
]


def _write(tmp_path, name, rows):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text(json.dumps(rows))
    return path


def _masked_runs(tok, row):
    """Decoded text of each maximal run of loss_mask == 1."""
    runs, cur = [], []
    for t, m in zip(row["input_ids"], row["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


# ---------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", ["rows.json", "rows.jsonl", "rows.parquet"])
@pytest.mark.parametrize("rows", [SHAREGPT, OPENAI], ids=["sharegpt", "openai"])
def test_load_conversations_from_local_files(tmp_path, name, rows):
    path = _write(tmp_path, name, rows)
    convs, stats = load_conversations(str(path))
    assert stats == {"rows": 2, "kept": 2, "skipped": 0, "first_error": None}
    assert convs == [normalize_conversation(r, i) for i, r in enumerate(rows)]


def test_load_rows_json_data_key_and_jsonl_named_json(tmp_path):
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": OPENAI}))
    assert load_rows(str(tmp_path / "wrapped.json")) == OPENAI
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in OPENAI))
    assert load_rows(str(tmp_path / "lines.json")) == OPENAI


def test_load_rows_missing_path_and_unloadable_id(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    # Offline, so the hub lookup fails at once instead of retrying the network (the env var from
    # conftest comes after huggingface_hub has read its constants).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="not a local file and could not be loaded") as e:
        load_rows("no-such-user/no-such-dataset-draftsmith")
    assert "\n" not in str(e.value)


def test_load_rows_bad_jsonl_line_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(OPENAI[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_rows(str(p))


def test_normalize_sharegpt_role_names():
    names = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
    turns = [{"from": n, "value": f"v{i}"} for i, n in enumerate(names)]
    out = normalize_conversation({"conversations": turns}, 0)
    assert [m["role"] for m in out] == list(names.values())
    assert [m["content"] for m in out] == [f"v{i}" for i in range(len(names))]


@pytest.mark.parametrize("row, message", [
    ({"text": "hi"}, "row 7: has neither 'messages'"),
    ({"messages": "hi"}, "row 7: field 'messages' must be a list (got str)"),
    ({"conversations": [{"from": "human", "value": "q"}, 3]},
     "row 7: field 'conversations[1]' must be an object (got int)"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 5}]},
     "row 7: field 'conversations[1].value' must be a string (got int)"),
    ({"conversations": [{"value": "q"}]}, "row 7: field 'conversations[0].from' is missing"),
    ({"messages": [{"role": "user", "content": None}]},
     "row 7: field 'messages[0].content' must be a string (got null)"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "row 7: field 'messages[0].role' has unknown role 'tool'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "row 7: field 'messages' has no assistant turn"),
    ({"messages": []}, "row 7: field 'messages' has no assistant turn"),
])
def test_normalize_malformed_names_row_and_field(row, message):
    with pytest.raises(MalformedRowError) as e:
        normalize_conversation(row, 7)
    assert str(e.value).startswith(message)
    assert e.value.index == 7


def test_malformed_rows_raise_or_are_skipped_and_counted(tmp_path):
    bad = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 17}]}
    path = _write(tmp_path, "mixed.jsonl", [SHAREGPT[0], bad, {"nothing": 1}, SHAREGPT[1]])
    with pytest.raises(MalformedRowError, match=r"row 1: field 'conversations\[1\]\.value' must be a string"):
        load_conversations(str(path))
    convs, stats = load_conversations(str(path), skip_malformed=True)
    assert len(convs) == 2 and convs[1][1]["content"] == "Hello, how are you?"
    assert stats["rows"] == 4 and stats["kept"] == 2 and stats["skipped"] == 2
    assert stats["first_error"].startswith("row 1: field 'conversations[1].value'")
    convs, stats = load_conversations(str(path), skip_malformed=True, max_rows=1)
    assert stats == {"rows": 1, "kept": 1, "skipped": 0, "first_error": None}


def test_no_usable_conversations_is_an_error(tmp_path):
    path = _write(tmp_path, "bad.json", [{"messages": [{"role": "user", "content": "q"}]}] * 3)
    with pytest.raises(ValueError, match=r"no usable conversations in .*bad.json \(3 rows, 3 skipped: first error "
                                         r"row 0: field 'messages' has no assistant turn"):
        load_conversations(str(path), skip_malformed=True)
    with pytest.raises(ValueError, match="no usable conversations"):
        build_chat_dataset(None, str(path), max_len=64, skip_malformed=True)
    empty = _write(tmp_path, "empty.jsonl", [])
    with pytest.raises(ValueError, match=r"no usable conversations in .*empty.jsonl \(0 rows, 0 skipped\)"):
        load_conversations(str(empty))


# ------------------------------------------------------------------------------------- loss masks

NO_NEWLINE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(params=["default", "no-newline"])
def chat_tok(request, tiny_tokenizer):
    if request.param == "default":
        return tiny_tokenizer
    tok = copy.deepcopy(tiny_tokenizer)  # the session fixture is shared: never mutate it
    tok.chat_template = NO_NEWLINE_TEMPLATE
    return tok


@pytest.mark.parametrize("rows", [SHAREGPT, OPENAI], ids=["sharegpt", "openai"])
def test_mask_covers_exactly_the_assistant_turns(chat_tok, rows):
    for i, row in enumerate(rows):
        messages = normalize_conversation(row, i)
        out = tokenize_conversation(chat_tok, messages, max_len=4096)
        assert len(out["input_ids"]) == len(out["loss_mask"])
        # the ids are the plain tokenization of the rendered template, with a single bos
        full = chat_tok.apply_chat_template(messages, tokenize=False)
        assert out["input_ids"] == chat_tok(full, add_special_tokens=False)["input_ids"]
        assert out["input_ids"][0] == chat_tok.bos_token_id and out["input_ids"].count(chat_tok.bos_token_id) == 1
        assistant = [m["content"] + "<|end|>" for m in messages if m["role"] == "assistant"]
        assert _masked_runs(chat_tok, out) == assistant


def test_empty_assistant_reply_still_learns_the_turn_end(tiny_tokenizer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    out = tokenize_conversation(tiny_tokenizer, msgs, max_len=64)
    assert _masked_runs(tiny_tokenizer, out) == ["<|end|>"]


def test_truncation_keeps_a_prefix_and_reports_nothing_left(tiny_tokenizer):
    messages = normalize_conversation(SHAREGPT[0], 0)
    full = tokenize_conversation(tiny_tokenizer, messages, max_len=4096)
    first = full["loss_mask"].index(1)
    cut = tokenize_conversation(tiny_tokenizer, messages, max_len=first + 3)
    assert cut == {"input_ids": full["input_ids"][:first + 3], "loss_mask": full["loss_mask"][:first + 3]}
    assert sum(cut["loss_mask"]) == 3
    # cut before the first assistant token: nothing to train on → None (documented)
    assert tokenize_conversation(tiny_tokenizer, messages, max_len=first) is None
    with pytest.raises(ValueError, match="max_len"):
        tokenize_conversation(tiny_tokenizer, messages, max_len=0)


def test_template_that_rewrites_history_is_masked_and_one_that_drops_a_turn_is_refused(tiny_tokenizer):
    from data.chat_spans import ChatMaskError

    tok = copy.deepcopy(tiny_tokenizer)
    # marks the last message: the render of a prefix is then not a prefix of the whole render (the old
    # prefix-diff method refused this); each turn is still in the one full render, so its mask is exact
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['content'] }}<|end|>"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = normalize_conversation(OPENAI[0], 0)
    out = tokenize_conversation(tok, messages, max_len=4096)
    assert _masked_runs(tok, out) == [m["content"] + "<|end|>" for m in messages if m["role"] == "assistant"]
    # a template that leaves the assistant's reply out cannot give a mask: one clear error naming the turn
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}<|end|>{% endif %}"
                         "{% endfor %}")
    with pytest.raises(ChatMaskError, match=r"turn \d \(assistant\) is not in the chat template's render"):
        tokenize_conversation(tok, messages, max_len=64)


def test_build_chat_dataset_from_file_and_list(tmp_path, tiny_tokenizer):
    path = _write(tmp_path, "rows.jsonl", SHAREGPT + OPENAI)
    ds = build_chat_dataset(tiny_tokenizer, str(path), max_len=4096)
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) == 4
    ds2 = build_chat_dataset(tiny_tokenizer, [normalize_conversation(r, i) for i, r in enumerate(SHAREGPT + OPENAI)],
                             max_len=4096)
    assert ds2["input_ids"] == ds["input_ids"] and ds2["loss_mask"] == ds["loss_mask"]
    # raw rows in a list are validated the same way
    with pytest.raises(MalformedRowError, match="row 1: field 'messages' must be a list"):
        build_chat_dataset(tiny_tokenizer, [OPENAI[0], {"messages": 3}], max_len=64)
    # every conversation truncated before its first assistant token → nothing usable
    with pytest.raises(ValueError, match="no usable conversations .*no assistant token within max_len=2"):
        build_chat_dataset(tiny_tokenizer, str(path), max_len=2)


def test_check_token_ids_names_the_row(tiny_tokenizer):
    rows = [tokenize_conversation(tiny_tokenizer, normalize_conversation(r, i), 4096)
            for i, r in enumerate(SHAREGPT + OPENAI)]
    check_token_ids(rows, len(tiny_tokenizer))  # own tokenizer: fine
    top = max(max(r["input_ids"]) for r in rows)
    first_bad = next(i for i, r in enumerate(rows) if max(r["input_ids"]) >= top)
    # a target with a smaller vocabulary than the tokenizer that produced the data
    with pytest.raises(ValueError, match=rf"row {first_bad}: token id {top} is outside the target vocabulary "
                                         rf"\[0, {top}\)"):
        check_token_ids(rows, top)
    with pytest.raises(ValueError, match=r"row 1: token id -1"):
        check_token_ids([{"input_ids": [1, 2]}, {"input_ids": [3, -1]}], 10)
