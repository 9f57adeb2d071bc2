"""A completion prompt is cut to a character bound (16 per prompt token, more when that holds too few tokens) before
it is tokenized: a 12.5 MB prompt tokenized in full took 2.9 GB before its cut to `prompt_tokens`. The cut falls
before a whitespace that follows a non-space, so the kept tokens are the ones the whole text gives."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eval.bench.setup import PROMPTS_DIR, load_prompts
from models.core.target import EMBEDDED_DIR

ODD = ["x" * 3000, " " * 2000 + "def f():" + "\n" * 900 + "    pass", "é" * 1500 + " ü" * 1500,
       "a = 1\t\t\t\n" * 400, "word " * 900 + "z" * 5000, "\n\n" + "-" * 4000 + " end"]


def _texts():
    rows = [json.loads(x) for f in ("humaneval", "ood_python") for x in (PROMPTS_DIR / f"{f}.jsonl").open()]
    heldout = [json.loads(x)["text"] for x in (EMBEDDED_DIR / "heldout.jsonl").open()]
    return [r["prompt"] for r in rows[:40]] + heldout[:20] + ODD


@pytest.fixture(scope="module", params=["embedded", "tiny"])
def tok(request, tiny_tokenizer):
    return AutoTokenizer.from_pretrained(EMBEDDED_DIR) if request.param == "embedded" else tiny_tokenizer


def _write(path, texts):
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


@pytest.mark.parametrize("n", [1, 3, 16, 64, 300])
def test_cut_prompts_are_the_tokens_the_whole_text_gives(tok, tmp_path, n):
    texts = _texts()
    got = load_prompts(tok, len(texts), n, _write(tmp_path / "p.jsonl", texts))
    assert [p.ids for p in got] == [tok(t)["input_ids"][:n] for t in texts]


def test_a_huge_prompt_is_cut_before_tokenizing(tok, tmp_path):
    code = (EMBEDDED_DIR / "heldout.jsonl").open().readline()
    text = json.loads(code)["text"]
    big = text * (12_500_000 // len(text) + 1)
    seen = []

    class Recording:
        def __call__(self, t, **kw):
            seen.append(len(t))
            return tok(t, **kw)

        def __getattr__(self, name):
            return getattr(tok, name)

    n = 64
    got = load_prompts(Recording(), 1, n, _write(tmp_path / "big.jsonl", [big]))
    assert got[0].ids == tok(text * 4)["input_ids"][:n]
    assert max(seen) <= 16 * n, seen
