"""Training data written by the target itself.

A drafter imitates the target; trained on the target's *own* outputs rather than a fixed dataset's
answers, it learns the distribution it will be verified against and gets more tokens accepted.

Both entry points are resumable (data/resumable.py): each finished item is appended to a JSON-lines file as
``{"index": i, ...}`` (flushed in batches); a rerun reads that file, checks the stored items still match the inputs,
and generates only the missing ones.

Conversations go through continuous batching (``refill=True``, models/core/refill.py): a reply that ends hands
its row to the next prompt, and reply ``t`` of conversation ``i`` samples with a seed of its own, so a record is the
same whatever batch it ran in and wherever a run was cut. Fixed batches (``refill=False``; continuations always):
items in ``range(b, b + batch_size)``, sampling seeded per batch from ``seed`` and the batch's first index, and a
batch the cache holds only part of is generated again whole, so a resumed run draws exactly the samples of an
uninterrupted one (same ``batch_size``). Greedy output does not depend on either. Sampling is pure temperature
(no top-k/top-p).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data import resumable
from data.chat import render_chat
from data.chat_spans import closing_token, special_strings
from models.core.generate import generate_batch

_PROBE = "Zq7 probe reply"  # a reply text no template contains, to find what closes a turn


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


def _same_conversation(conv: list[dict], rec: dict) -> bool:
    """Resuming: a stored record answers this conversation when its turns match, assistant contents aside (those
    are what was regenerated)."""
    stored = rec.get("messages")
    if not isinstance(stored, list) or len(stored) != len(conv):
        return False
    return all(s.get("role") == m["role"] and (m["role"] == "assistant" or s.get("content") == m["content"])
               for s, m in zip(stored, conv))


# ----------------------------------------------------------------------------------- public API


class _Conversations:
    """The per-conversation state of a regeneration: the turns so far, the assistant turns still to answer, the
    tokens generated; ``prompt`` renders the context before the next reply, ``answer`` puts a reply in."""

    def __init__(self, tok, convs: list[list[dict]], stops: list[int], chat_template, enable_thinking,
                 max_prompt_tokens: int | None):
        self.tok, self.convs, self.stops = tok, convs, stops
        self.template, self.thinking, self.max_prompt = chat_template, enable_thinking, max_prompt_tokens
        self.harmony = all(t in special_strings(tok) for t in (CHANNEL, MESSAGE))
        self.work: dict[int, list[dict]] = {}
        self.pending: dict[int, list[int]] = {}
        self.n_new: dict[int, int] = {}

    def start(self, i: int) -> None:
        self.work[i] = [dict(m) for m in self.convs[i]]
        # an assistant turn before any user turn (ShareGPT has some) has no prompt to answer: kept verbatim
        self.pending[i] = [j for j, m in enumerate(self.convs[i]) if m["role"] == "assistant"
                           and any(p["role"] == "user" for p in self.convs[i][:j])]
        self.n_new[i] = 0

    def prompt(self, i: int) -> list[int] | None:
        """The token ids that prompt conversation ``i``'s next reply; None when nothing is left to answer (a turn
        whose prompt outgrows ``max_prompt_tokens`` ends it: that reply and later ones keep their dataset text)."""
        if not self.pending[i]:
            return None
        text = render_chat(self.tok, self.work[i][: self.pending[i][0]], True, self.template, self.thinking)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if self.max_prompt is not None and len(ids) > self.max_prompt:
            self.pending[i] = []
            return None
        return ids

    def answer(self, i: int, new: list[int]) -> None:
        self.n_new[i] += len(new)
        j = self.pending[i].pop(0)
        if new and new[-1] in self.stops:
            new = new[:-1]  # the template writes the turn-closing token itself
        text = self.tok.decode(new, skip_special_tokens=False)
        split = split_harmony(text) if self.harmony else None
        if split is None:
            self.work[i][j]["content"] = text
        else:  # gpt-oss: the analysis channel goes to "thinking", the final one to "content"
            self.work[i][j].update(split)

    def record(self, i: int) -> dict:
        rec = {"index": i, "messages": self.work.pop(i), "new_tokens": self.n_new.pop(i)}
        del self.pending[i]
        return rec


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
    refill: bool = False,
    generator=None,
) -> list[list[dict]]:
    """Every assistant turn replaced by the target's own reply to the (already regenerated) context before it.

    System and user turns are kept verbatim. Output is in input order; ``out_path`` holds one line per conversation.
    ``max_prompt_tokens``: a turn whose prompt is longer (a ShareGPT second question can be thousands of tokens)
    is kept verbatim with the turns after it: its reply would start past a training row of that length, and its
    prompt would pad and slow its whole batch.
    ``refill``: continuous batching (models/core/refill.py; ``_refill_conversations``), each reply sampled with a
    seed of its own; else fixed batches of conversations, one assistant turn per ``generate`` call.
    ``generator``: another engine (data/regen_vllm.py) in place of ours; it batches continuously itself, and every
    reply is sampled with its conversation's and turn's own seed, so its records do not depend on ``refill``.
    """
    convs = [[{"role": m["role"], "content": m["content"]} for m in c] for c in conversations]
    stops = stop_token_ids(tok, model, chat_template=chat_template, enable_thinking=enable_thinking)
    pad_id = _pad_id(tok, stops)
    state = _Conversations(tok, convs, stops, chat_template, enable_thinking, max_prompt_tokens)
    if refill or generator is not None:
        done = _refill_conversations(model, state, out_path, batch_size, max_new_tokens, temperature, seed, pad_id,
                                     stats, generator)
        return [done[i]["messages"] for i in range(len(convs))]

    def process_batch(idx: list[int]) -> list[dict]:
        for i in idx:
            state.start(i)
        step = 0
        while True:
            active, prompts = [], []
            for i in idx:
                ids = state.prompt(i)
                if ids is not None:
                    active.append(i)
                    prompts.append(ids)
            if not active:
                break
            outs = _generate_batch(model, prompts, stops, pad_id, max_new_tokens, temperature,
                                   resumable.batch_seed(seed, idx[0]) + step)
            for i, new in zip(active, outs):
                state.answer(i, new)
            step += 1
        return [state.record(i) for i in idx]

    done = resumable.run_resumable(convs, out_path, batch_size, _same_conversation, process_batch,
                          "regenerate conversations", stats)
    return [done[i]["messages"] for i in range(len(convs))]


def _refill_conversations(model, state: _Conversations, out_path: Path, batch_size: int, max_new_tokens: int,
                          temperature: float, seed: int, pad_id: int, stats: dict | None,
                          generator=None) -> dict[int, dict]:
    """Continuous batching over conversations (``_RefillRun``), resumable: conversations the file holds are
    skipped, the others generated (by ``generator`` when given: ``batch_size`` requests a call)."""
    from models.core.refill import generate_refill

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = resumable.load_done(out_path)
    resumable.check_done(state.convs, done, out_path, _same_conversation)
    run = _RefillRun(state, done, out_path, seed)
    if stats is not None:
        stats.update(generated=len(run.todo), from_cache=len(state.convs) - len(run.todo))
    try:
        if generator is None:
            generate_refill(model, run.pull, run.finish, state.stops, pad_id, max_new_tokens, batch_size, temperature)
        else:
            while reqs := run.pull(batch_size):
                outs = generator.generate([r.prompt for r in reqs], state.stops, max_new_tokens, temperature,
                                          [r.seed for r in reqs])
                for r, new in zip(reqs, outs):
                    run.finish(r.tag, new)
        run.flush()
    finally:
        run.bar.close()
    return done


class _RefillRun:
    """A reply that ends frees its row for the next prompt (a waiting conversation's next turn first); a
    conversation's record is written once its last turn is answered, ``flush_every`` at a time (a kill loses only
    those in flight), with a ledger line each. Reply ``t`` of conversation ``i`` samples with a seed of its own, so
    every record is the same however the run was cut and resumed. Records land in completion order."""

    def __init__(self, state: _Conversations, done: dict[int, dict], out_path: Path, seed: int,
                 flush_every: int = 16):
        from collections import deque

        self.state, self.done, self.out_path, self.seed, self.flush_every = state, done, out_path, seed, flush_every
        self.todo = deque(i for i in range(len(state.convs)) if i not in done)
        self.follow_ups: deque = deque()
        self.turn: dict[int, int] = {}
        self.ready: list[dict] = []
        self.t_flush = time.time()
        self.bar = tqdm(total=len(state.convs), initial=len(state.convs) - len(self.todo),
                        desc="regenerate conversations", unit="item")

    def request(self, i: int):
        from models.core.refill import Request

        ids = self.state.prompt(i)
        if ids is None:  # nothing (more) to answer: the conversation is complete
            self.ready.append(self.state.record(i))
            self.bar.update(1)
            if len(self.ready) >= self.flush_every:
                self.flush()
            return None
        return Request(i, ids, (resumable.batch_seed(self.seed, i) * 1_000_003 + self.turn[i]) % (2**62))

    def pull(self, n: int) -> list:
        reqs: list = []
        while len(reqs) < n and (self.follow_ups or self.todo):
            if self.follow_ups:
                r = self.follow_ups.popleft()
            else:
                i = self.todo.popleft()
                self.state.start(i)
                self.turn[i] = 0
                r = self.request(i)
            if r is not None:
                reqs.append(r)
        return reqs

    def finish(self, i: int, new: list[int]) -> None:
        self.state.answer(i, new)
        self.turn[i] += 1
        r = self.request(i)
        if r is not None:
            self.follow_ups.append(r)

    def flush(self) -> None:
        if not self.ready:
            return
        resumable.append(self.out_path, self.ready)
        now = time.time()
        resumable.append(resumable.ledger_path(self.out_path), [{
            "first": min(r["index"] for r in self.ready), "items": len(self.ready),
            "seconds": round(now - self.t_flush, 2), "new_tokens": sum(r["new_tokens"] for r in self.ready),
            "threads": torch.get_num_threads(), "refill": True}])
        self.t_flush = now
        self.done.update((r["index"], r) for r in self.ready)
        self.ready.clear()


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
    generator=None,
) -> list[dict]:
    """The target's continuation of each token prefix (e.g. code): ``{"input_ids", "loss_mask"}`` rows.

    ``input_ids = prompt + generated``; ``loss_mask`` is 0 on the prompt and 1 on the generated tokens,
    including the eos the target produced (predicting the end is part of its behaviour). ``generator``: another
    engine (data/regen_vllm.py) in place of ours, each prompt sampled with a seed of its own index.
    """
    items = [[int(t) for t in p] for p in prompts]
    stops = stop_token_ids(tok, model, turn_end=False)  # plain text continuations end at eos only
    pad_id = _pad_id(tok, stops)

    def same_input(prompt: list[int], rec: dict) -> bool:
        ids, mask = rec.get("input_ids"), rec.get("loss_mask")
        return (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask)
                and ids[:len(prompt)] == prompt and not any(mask[:len(prompt)]))

    def process_batch(idx: list[int]) -> list[dict]:
        if generator is not None:
            outs = generator.generate([items[i] for i in idx], stops, max_new_tokens, temperature,
                                      [resumable.batch_seed(seed, i) for i in idx])
        else:
            outs = _generate_batch(model, [items[i] for i in idx], stops, pad_id, max_new_tokens, temperature,
                                   resumable.batch_seed(seed, idx[0]))
        return [{"index": i, "input_ids": items[i] + new, "loss_mask": [0] * len(items[i]) + [1] * len(new),
                 "new_tokens": len(new)} for i, new in zip(idx, outs)]

    done = resumable.run_resumable(items, out_path, batch_size, same_input, process_batch, "regenerate continuations",
                          stats)
    return [{"input_ids": done[i]["input_ids"], "loss_mask": done[i]["loss_mask"]} for i in range(len(items))]
