"""Training data written by the target itself.

A drafter imitates the target; trained on the target's *own* outputs rather than a fixed dataset's
answers, it learns the distribution it will be verified against and gets more tokens accepted.

Both entry points are batched over items (left padding, ``model.generate``) and resumable: each
finished item is appended to a JSON-lines file as ``{"index": i, ...}`` (flushed per batch); a rerun
reads that file, checks the stored items still match the inputs, and generates only the missing ones.

Greedy (``temperature=0``) output does not depend on where a run was interrupted. Sampling (pure
temperature, no top-k/top-p, ``models.core.generate``) is seeded per batch from ``seed`` and the batch's first
index; batches are fixed (``range(b, b + batch_size)``) and a batch the cache holds only part of is generated
again whole, so a resumed run draws exactly the samples of an uninterrupted one (same ``batch_size``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data.chat import render_chat
from data.chat_spans import closing_token, special_strings
from models.core.checkpoint import out_of_space_as_error
from models.core.generate import generate_batch

_PROBE = "Zq7 probe reply"  # a reply text no template contains, to find what closes a turn


# ------------------------------------------------------------------------------------ jsonl resume


def load_done(out_path: Path, repair: bool = True) -> dict[int, dict]:
    """Finished items by index. A torn last line (crash mid-write) is cut off so appends stay valid jsonl
    (``repair=False``: only skipped, for a reader beside a running writer)."""
    done: dict[int, dict] = {}
    if not out_path.exists():
        return done
    raw = out_path.read_bytes()
    good_end = 0
    pos = 0
    for line in raw.splitlines(keepends=True):
        start, pos = pos, pos + len(line)
        if not line.strip():
            good_end = pos
            continue
        try:
            rec = json.loads(line)
            complete = line.endswith(b"\n")
        except json.JSONDecodeError:
            rec, complete = None, False
        if rec is None or not complete:
            if pos < len(raw):  # not the last line: the file is corrupt, not merely torn
                raise ValueError(f"{out_path}: line starting at byte {start} is not valid JSON; "
                                 "fix or delete the file to regenerate")
            break
        if not isinstance(rec, dict) or not isinstance(rec.get("index"), int):
            raise ValueError(f"{out_path}: record at byte {start} has no integer 'index'")
        done[rec["index"]] = rec
        good_end = pos
    if repair and good_end < len(raw):
        with open(out_path, "r+b") as fh:
            fh.truncate(good_end)
    return done


def _append(out_path: Path, records: list[dict]) -> None:
    """One batch's records in a single write (a kill leaves all of them or a torn tail that load_done cuts)."""
    if not records:
        return
    data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode()
    with out_of_space_as_error(out_path, "free space, or set data.cache_dir on a larger disk"):
        fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # a regular file takes it in one call; loop only for a short write
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------ gpt-oss (harmony)

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
_HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")


def split_harmony(text: str) -> dict[str, str] | None:
    """A gpt-oss reply in harmony form (``<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final
    <|message|>…``) → ``{"thinking": analysis text, "content": final text}``, the fields gpt-oss's template takes
    (it refuses ``<|channel|>`` inside ``content``). None when ``text`` has no channel header (plain reply).
    Commentary (tool-call) channels count as content; a reply cut before its final channel has empty content."""
    if CHANNEL not in text:
        return None
    thinking, content = [], []
    for part in text.split(CHANNEL)[1:]:
        header, sep, body = part.partition(MESSAGE)
        if not sep:
            continue  # a header the generation never finished
        cut = min([body.find(e) for e in _HARMONY_ENDS if e in body] or [len(body)])
        body = body[:cut]
        if START in body:  # a next message began without a closing token
            body = body[: body.find(START)]
        name = header.strip().split(" ")[0]
        (thinking if name == "analysis" else content).append(body)
    return {"thinking": "".join(thinking).replace(MESSAGE, ""), "content": "".join(content).replace(MESSAGE, "")}


# ------------------------------------------------------------------------------------- generation


def turn_end_token_id(tok: PreTrainedTokenizerBase, chat_template: str | None = None,
                      enable_thinking: bool | None = None) -> int | None:
    """The special token the chat template writes right after an assistant reply that ends the conversation
    (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, gpt-oss ``<|return|>`` — not the ``<|end|>`` that closes
    its analysis channel), read off a rendered probe conversation; None when the template writes none."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        full = render_chat(tok, msgs, False, chat_template, enable_thinking)
    except (ValueError, TypeError):
        return None
    at = full.rfind(_PROBE)
    if at < 0:
        return None
    end = at + len(_PROBE)
    stop = closing_token(full, end, special_strings(tok))
    if stop == end:
        return None
    tid = tok.convert_tokens_to_ids(full[end:stop].strip())
    return tid if isinstance(tid, int) and tid != tok.unk_token_id else None


def stop_token_ids(tok: PreTrainedTokenizerBase, model: PreTrainedModel | None = None,
                   turn_end: bool = True, chat_template: str | None = None,
                   enable_thinking: bool | None = None) -> list[int]:
    """eos (tokenizer's and the model's generation config) plus the chat template's turn-closing token."""
    ids: list[int] = []
    cands: list[Any] = [tok.eos_token_id]
    if model is not None and getattr(model, "generation_config", None) is not None:
        cands.append(model.generation_config.eos_token_id)
    if turn_end:
        cands.append(turn_end_token_id(tok, chat_template, enable_thinking))
    for c in cands:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("neither the tokenizer nor the model defines an eos token; generation would never stop")
    return ids


def _generate_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    stops: list[int],
    pad_id: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> list[list[int]]:
    """New tokens per prompt, cut after the first stop token (the stop token is kept): models/core/generate.py's loop
    (a preallocated KV cache, finished rows dropped), 2-3x ``model.generate`` at regeneration's batch sizes."""
    return generate_batch(model, prompts, stops, pad_id, max_new_tokens, temperature, seed)


def _pad_id(tok: PreTrainedTokenizerBase, stops: list[int]) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else stops[0]


def _batch_seed(seed: int, first_index: int) -> int:
    return (seed * 1_000_003 + first_index) % (2**62)


def _run_resumable(
    items: Sequence[Any],
    out_path: Path,
    batch_size: int,
    same_input: Callable[[Any, dict], bool],
    process_batch: Callable[[list[int]], list[dict]],
    desc: str,
    stats: dict | None = None,
) -> dict[int, dict]:
    """Items in fixed batches (``range(b, b + batch_size)``), each seeded by its first index: a batch the cache
    holds only part of (a kill between its records) is generated again whole, so every item's sample is the one
    an uninterrupted run draws, however far an earlier run got. ``stats`` gets ``generated`` / ``from_cache``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = load_done(out_path)
    for i, rec in done.items():
        if i >= len(items) or not same_input(items[i], rec):
            raise ValueError(f"{out_path}: stored item {i} does not match input item {i}; the file was written for "
                             "other inputs — use another out_path or delete it")
    batches = [list(range(b, min(b + batch_size, len(items)))) for b in range(0, len(items), batch_size)]
    todo = [idx for idx in batches if not all(i in done for i in idx)]
    n_todo = sum(len(idx) for idx in todo)
    if stats is not None:
        stats.update(generated=n_todo, from_cache=len(items) - n_todo)
    ledger = ledger_path(out_path)
    with tqdm(total=len(items), initial=len(items) - n_todo, desc=desc, unit="item") as bar:
        for idx in todo:
            t0 = time.time()
            records = process_batch(idx)
            _append(out_path, records)
            # the throughput ledger: what each batch generated and how long it took, across resumed runs
            _append(ledger, [{"first": idx[0], "items": len(idx), "seconds": round(time.time() - t0, 2),
                              "new_tokens": sum(r.get("new_tokens", 0) for r in records),
                              "threads": torch.get_num_threads()}])
            for rec in records:
                done[rec["index"]] = rec
            bar.update(len(idx))
    return done


def ledger_path(out_path: Path) -> Path:
    """The per-batch throughput records beside a regeneration file (``ledger_<its name>``: a glob for the cache
    files, ``regen_*.jsonl``, does not take it for one)."""
    out_path = Path(out_path)
    return out_path.with_name("ledger_" + out_path.name)


def _same_conversation(conv: list[dict], rec: dict) -> bool:
    """Resuming: a stored record answers this conversation when its turns match, assistant contents aside (those
    are what was regenerated)."""
    stored = rec.get("messages")
    if not isinstance(stored, list) or len(stored) != len(conv):
        return False
    return all(s.get("role") == m["role"] and (m["role"] == "assistant" or s.get("content") == m["content"])
               for s, m in zip(stored, conv))


# ----------------------------------------------------------------------------------- public API


def regenerate_conversations(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[dict]],
    out_path: Path,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    chat_template: str | None = None,
    enable_thinking: bool | None = None,
    stats: dict | None = None,
    max_prompt_tokens: int | None = None,
) -> list[list[dict]]:
    """Every assistant turn replaced by the target's own reply to the (already regenerated) context before it.

    System and user turns are kept verbatim. Conversations are batched; a batch advances one assistant
    turn per ``generate`` call. Output is in input order; ``out_path`` holds one line per conversation.
    ``max_prompt_tokens``: a turn whose prompt is longer (a ShareGPT second question can be thousands of tokens)
    is kept verbatim with the turns after it: its reply would start past a training row of that length, and its
    prompt would pad and slow its whole batch.
    """
    convs = [[{"role": m["role"], "content": m["content"]} for m in c] for c in conversations]
    stops = stop_token_ids(tok, model, chat_template=chat_template, enable_thinking=enable_thinking)
    pad_id = _pad_id(tok, stops)
    harmony = all(t in special_strings(tok) for t in (CHANNEL, MESSAGE))

    def process_batch(idx: list[int]) -> list[dict]:
        work = {i: [dict(m) for m in convs[i]] for i in idx}
        # an assistant turn before any user turn (ShareGPT has some) has no prompt to answer: kept verbatim
        pending = {i: [j for j, m in enumerate(convs[i]) if m["role"] == "assistant"
                       and any(p["role"] == "user" for p in convs[i][:j])] for i in idx}
        n_new = dict.fromkeys(idx, 0)  # tokens generated per conversation (the ledger's count)
        step = 0
        while any(pending.values()):
            active, prompts = [], []
            for i in [i for i in idx if pending[i]]:
                text = render_chat(tok, work[i][: pending[i][0]], True, chat_template, enable_thinking)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                    pending[i] = []  # this reply and later ones start past the training window: kept verbatim
                    continue
                active.append(i)
                prompts.append(ids)
            if not active:
                break
            outs = _generate_batch(model, prompts, stops, pad_id, max_new_tokens, temperature,
                                   _batch_seed(seed, idx[0]) + step)
            for i, new in zip(active, outs):
                n_new[i] += len(new)
                j = pending[i].pop(0)
                if new and new[-1] in stops:
                    new = new[:-1]  # the template writes the turn-closing token itself
                text = tok.decode(new, skip_special_tokens=False)
                split = split_harmony(text) if harmony else None
                if split is None:
                    work[i][j]["content"] = text
                else:  # gpt-oss: the analysis channel goes to "thinking", the final one to "content"
                    work[i][j].update(split)
            step += 1
        return [{"index": i, "messages": work[i], "new_tokens": n_new[i]} for i in idx]

    done = _run_resumable(convs, out_path, batch_size, _same_conversation, process_batch,
                          "regenerate conversations", stats)
    return [done[i]["messages"] for i in range(len(convs))]


def regenerate_continuations(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    out_path: Path,
    batch_size: int = 8,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    stats: dict | None = None,
) -> list[dict]:
    """The target's continuation of each token prefix (e.g. code): ``{"input_ids", "loss_mask"}`` rows.

    ``input_ids = prompt + generated``; ``loss_mask`` is 0 on the prompt and 1 on the generated tokens,
    including the eos the target produced (predicting the end is part of its behaviour).
    """
    items = [[int(t) for t in p] for p in prompts]
    stops = stop_token_ids(tok, model, turn_end=False)  # plain text continuations end at eos only
    pad_id = _pad_id(tok, stops)

    def same_input(prompt: list[int], rec: dict) -> bool:
        ids, mask = rec.get("input_ids"), rec.get("loss_mask")
        return (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask)
                and ids[:len(prompt)] == prompt and not any(mask[:len(prompt)]))

    def process_batch(idx: list[int]) -> list[dict]:
        outs = _generate_batch(model, [items[i] for i in idx], stops, pad_id, max_new_tokens, temperature,
                               _batch_seed(seed, idx[0]))
        return [{"index": i, "input_ids": items[i] + new, "loss_mask": [0] * len(items[i]) + [1] * len(new),
                 "new_tokens": len(new)} for i, new in zip(idx, outs)]

    done = _run_resumable(items, out_path, batch_size, same_input, process_batch, "regenerate continuations",
                          stats)
    return [{"input_ids": done[i]["input_ids"], "loss_mask": done[i]["loss_mask"]} for i in range(len(items))]
