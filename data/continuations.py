"""The target's continuations of token prompts, and the plain-text prompts a base model's on-policy data continues.

``continue_prompts`` serves the code corpus (prefixes of training windows) and ``data.kind=text`` alike: fixed
batches through data/regenerate.py, resumable, into a cache file keyed by everything the text depends on
(data/regen_cache.py), which ``python -m train.regenerate --ship`` can pack.

``data.kind=text`` is for a base model (no chat template), whose on-policy data is its own continuations of real
text: ``text_prompts`` makes one plain-text prompt per conversation (ShareGPT), its first user turn or (for a seeded
``reply_opening_share``) that turn, a blank line and the dataset's reply, so that the prompt runs into the reply's
opening; either cut to ``regen_prompt_len`` tokens, the tokenizer's bos first. No template is rendered: a base model
has none, and is served plain text. Left out: user turns of fewer than MIN_WORDS words, prompts holding a special
token (a text that spells one out), and any prompt sharing a run of BENCH_NGRAM words with a benchmark prompt shipped in
eval/prompts/ (MT-Bench, HumanEval, ood_python: the drafter is measured on those). data/sources.py ``text_plan``
deduplicates them by content, picks, and splits the picks over the temperatures.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

from data.regen_cache import regen_cache_path
from data.regen_vllm import regen_generator
from data.regenerate import regenerate_continuations

# A first user turn shorter than this is mostly "hi" or "continue": little text of its own to go on from
MIN_WORDS = 8
# GPT-3's contamination test: a text sharing a run of 13 words with a benchmark prompt counts as that prompt
# (a shorter benchmark prompt, e.g. an MT-Bench second turn, counts when it is contained whole)
BENCH_NGRAM = 13
# eval/bench/setup.py's PROMPTS_DIR, read here as files: data sits below the benchmark's layer
BENCHMARK_DIR = Path(__file__).resolve().parents[1] / "eval" / "prompts"


def continue_prompts(cfg, model, tok, kind: str, prompts: list[list[int]], temp: float,
                     stats: dict | None = None) -> list[dict]:
    """The target's continuation of each token prompt at ``temp`` (rows with the loss on the continuation; ``cfg``:
    a data.sources.DataConfig), batched and resumable in the keyed cache file of ``kind``; ``stats`` (if given) gets
    what it cost."""
    out = regen_cache_path(cfg, model, tok, kind, prompts, temp)
    t0 = time.time()
    counts: dict = {}  # what was read back whole vs generated now (a torn or partial batch is generated)
    got = regenerate_continuations(model, tok, prompts, out, batch_size=cfg.regen_batch_size,
                                   max_new_tokens=cfg.regen_new_tokens, temperature=temp, seed=cfg.seed,
                                   stats=counts, generator=regen_generator(cfg, model))
    secs = time.time() - t0
    if stats is not None:
        made = counts["generated"]
        stats.setdefault("regenerated", []).append({
            "temperature": temp, "continuations": len(prompts), "from_cache": len(prompts) - made,
            "generated_now": made, "seconds": round(secs, 1), "target_tokens": sum(sum(r["loss_mask"]) for r in got),
            "items_per_s": round(made / secs, 2) if made and secs > 0 else None, "cache": str(out)})
    return got


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def benchmark_index(prompts_dir: Path = BENCHMARK_DIR) -> tuple[set[tuple[str, ...]], list[str]]:
    """The benchmark prompts as (every run of BENCH_NGRAM words of the longer ones, the shorter ones whole as
    ``" w1 w2 ... "``)."""
    grams: set[tuple[str, ...]] = set()
    short: list[str] = []
    for path in sorted(prompts_dir.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line) if line.strip() else {}
            texts = list(row.get("turns") or []) + [m.get("content", "") for m in row.get("messages") or []]
            texts += [row[k] for k in ("prompt", "text") if isinstance(row.get(k), str)]
            for w in map(_words, texts):
                if len(w) >= BENCH_NGRAM:
                    grams.update(tuple(w[i : i + BENCH_NGRAM]) for i in range(len(w) - BENCH_NGRAM + 1))
                elif w:
                    short.append(" " + " ".join(w) + " ")
    return grams, short


def is_benchmark(text: str, index: tuple[set[tuple[str, ...]], list[str]]) -> bool:
    """Whether ``text`` shares a run of BENCH_NGRAM words with a benchmark prompt, or holds a shorter one whole."""
    grams, short = index
    w = _words(text)
    if any(tuple(w[i : i + BENCH_NGRAM]) in grams for i in range(len(w) - BENCH_NGRAM + 1)):
        return True
    joined = " " + " ".join(w) + " "
    return any(s in joined for s in short)


def plain_text(conv: list[dict], opening: bool) -> str | None:
    """The first user turn, with ``opening`` followed by a blank line and the reply to it; None when the
    conversation has no user turn, or its first has fewer than MIN_WORDS words."""
    j = next((k for k, m in enumerate(conv) if m["role"] == "user"), None)
    if j is None or len(conv[j]["content"].split()) < MIN_WORDS:
        return None
    user = conv[j]["content"].strip()
    has_reply = j + 1 < len(conv) and conv[j + 1]["role"] == "assistant" and conv[j + 1]["content"].strip()
    return f"{user}\n\n{conv[j + 1]['content'].strip()}" if opening and has_reply else user


def _head_tokens(tok, text: str, n: int) -> list[int]:
    """The first ``n`` tokens of ``text``. A long text (a ShareGPT reply can be 100k characters) is tokenized from
    a clipped copy; a clip changes only the tokens near it, so the copy must reach well past ``n`` tokens."""
    clip = text[: 64 * n + 4096]
    ids = tok(clip, add_special_tokens=False)["input_ids"]
    if len(clip) < len(text) and len(ids) < n + 16:
        ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids[:n]


def text_prompts(cfg, tok, convs: list[list[dict]]) -> dict[int, list[int]]:
    """Each conversation's plain-text prompt by conversation index, none for those left out (module docstring);
    ``cfg``: a data.sources.DataConfig."""
    if not 0.0 <= cfg.reply_opening_share <= 1.0:
        raise ValueError(f"data.reply_opening_share={cfg.reply_opening_share}: give a share in [0, 1]")
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    special, index = set(tok.all_special_ids), benchmark_index()
    rng = random.Random(cfg.seed + 2)
    prompts: dict[int, list[int]] = {}
    for i, conv in enumerate(convs):
        opening = rng.random() < cfg.reply_opening_share  # drawn for every conversation: a skip shifts no other's
        text = plain_text(conv, opening)
        if text is None:
            continue
        ids = bos + _head_tokens(tok, text, cfg.regen_prompt_len - len(bos))
        if not special & set(ids[len(bos) :]) and not is_benchmark(tok.decode(ids), index):
            prompts[i] = ids
    return prompts
