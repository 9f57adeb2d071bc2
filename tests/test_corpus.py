import json

from data import corpus
from models.core.target import EMBEDDED_DIR


def test_split_is_by_whole_file_and_deterministic():
    files = corpus.iter_stdlib_files()
    train, held = corpus.split_files(files)
    assert held and train
    assert {f.path for f in train}.isdisjoint({f.path for f in held})
    assert all(corpus.is_heldout(f.path) for f in held)
    assert not any(p.startswith(("encodings/", "pydoc_data/", "test/")) for p in (f.path for f in files))


def test_shipped_heldout_matches_rule_and_manifest():
    held = corpus.load_heldout()
    assert 100_000 < sum(len(f.text.encode()) for f in held) < 1_000_000
    assert all(corpus.is_heldout(f.path) for f in held)
    manifest = json.loads((EMBEDDED_DIR / "manifest.json").read_text())
    assert [m["path"] for m in manifest["heldout_files"]] == [f.path for f in held]
    assert [m["sha256"] for m in manifest["heldout_files"]] == [f.sha256 for f in held]


def test_windows_and_prompts(tiny_tokenizer):
    files = [corpus.SourceFile("a.py", "x = 1\n" * 200), corpus.SourceFile("b.py", "def f():\n    pass\n" * 50)]
    rows = corpus.file_windows(tiny_tokenizer, files, max_len=64)
    assert all(len(r["input_ids"]) <= 64 and len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)
    assert rows[0]["input_ids"][0] == tiny_tokenizer.bos_token_id
    prompts = corpus.heldout_prompts(tiny_tokenizer, n=10, prompt_tokens=32)
    assert len(prompts) == 10 and all(len(p["input_ids"]) == 32 for p in prompts)
    assert prompts == corpus.heldout_prompts(tiny_tokenizer, n=10, prompt_tokens=32)


def test_rows_as_datasets(tiny_tokenizer):
    import pytest

    files = [corpus.SourceFile("a.py", "x = 1\n" * 100)]
    ds = corpus.as_dataset(corpus.file_windows(tiny_tokenizer, files, max_len=32))
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) > 1
    prompts = corpus.as_dataset(corpus.heldout_prompts(tiny_tokenizer, n=4, prompt_tokens=16))
    assert len(prompts) == 4 and "path" in prompts.column_names
    with pytest.raises(ValueError, match="no rows"):
        corpus.as_dataset([])
