"""Continuous batching for regeneration: a row that finishes hands its slot to the next prompt.

``generate_batch`` runs a fixed batch until its longest reply ends; replies vary from a few tokens to the cap, so
most steps run a batch that is mostly empty (SmolLM2 on ShareGPT, batch 64: 72-117 reply tokens/s against ~200
when every row is busy). Here the batch stays full: finished rows are dead until an eighth of the batch is, then
the waiting prompts are prefilled together and written into the dead rows' slots of the same KV buffer.

The buffer is ``[B, kv_heads, columns, head_dim]`` per layer (models/core/generate.py's ``GrowingLayer``): every
row appends one column a step; a prompt of W tokens admitted at column ``c`` fills columns ``[c - W, c)`` of its
slot, and the attention mask hides everything left of them (a dead row's old K/V included). Keys are stored after
RoPE, so moving columns changes nothing; position ids are per row. When the oldest column any live row reads is
far behind, the buffer is shifted left (one copy, amortised).

Each request samples from its own ``torch.Generator`` seeded by the caller, so its tokens do not depend on which
requests share its batch or when it was admitted: a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from models.core.generate import GrowingCache
from models.core.hf_compat import cache_kwargs

# columns the KV buffer grows by, and dead columns on its left it tolerates before a trim: attention reads the
# whole buffer (models/core/attention.py), so its width is kept near what the live rows read
GROW = 64
# a prefill group's padded area may exceed its prompts' tokens by this factor: one left-padded forward over prompts
# of 20 to 500 tokens computed mostly padding (prefill was 37 % of a conversation regeneration's time, SmolLM2 bf16)
PAD_SLACK = 1.25


@dataclass
class Request:
    tag: Any  # the caller's handle, given back with the reply
    prompt: Sequence[int]
    seed: int


def prefill_groups(reqs: list[Request], slack: float = PAD_SLACK) -> list[list[Request]]:
    """``reqs`` in groups of similar prompt length, longest first: a group's rows × its longest prompt stays within
    ``slack`` × its tokens (a group of one never pads)."""
    groups: list[list[Request]] = []
    tokens = 0
    for r in sorted(reqs, key=lambda r: len(r.prompt), reverse=True):
        if groups and (len(groups[-1]) + 1) * len(groups[-1][0].prompt) <= slack * (tokens + len(r.prompt)):
            groups[-1].append(r)
            tokens += len(r.prompt)
        else:
            groups.append([r])
            tokens = len(r.prompt)
    return groups


def _prefill(model: PreTrainedModel, reqs: list[Request], pad_id: int):
    """Left-padded forward of the new prompts → (last logits [n, V], their cache, attention mask [n, W], W)."""
    width = max(len(r.prompt) for r in reqs)
    ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt):] = torch.tensor(list(r.prompt), dtype=torch.long)
        attn[i, width - len(r.prompt):] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = GrowingCache(model.config.num_hidden_layers, capacity=width + GROW, grow_step=GROW)
    logits = model(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                   position_ids=pos.to(model.device), use_cache=True, logits_to_keep=1,
                   **cache_kwargs(model, cache)).logits[:, -1]
    return logits, cache, attn.to(model.device), width


class _Batch:
    """The live rows: a KV buffer shared by all, and per row its mask, next position, sampler and reply so far."""

    def __init__(self, model: PreTrainedModel, size: int, temperature: float):
        self.model, self.size, self.temperature = model, size, temperature
        self.cache: GrowingCache | None = None
        self.attn = torch.zeros((0, 0), dtype=torch.long, device=model.device)
        self.pos = torch.zeros(0, dtype=torch.long, device=model.device)
        self.logits: torch.Tensor | None = None
        self.reqs: list[Request | None] = []  # None: a dead slot
        self.gens: list[torch.Generator | None] = []
        self.outs: list[list[int]] = []

    def free_slots(self) -> list[int]:
        return [s for s, r in enumerate(self.reqs) if r is None] + list(range(len(self.reqs), self.size))

    def live(self) -> int:
        return sum(r is not None for r in self.reqs)

    def admit(self, reqs: list[Request], pad_id: int) -> None:
        """Prefill ``reqs`` (in groups of similar length: ``prefill_groups``) into free slots."""
        for group in prefill_groups(reqs):
            self._admit(group, pad_id)

    def _admit(self, reqs: list[Request], pad_id: int) -> None:
        logits, fresh, mask, width = _prefill(self.model, reqs, pad_id)
        if self.cache is None:  # the first prompts: their prefill cache is the buffer
            self.cache, self.attn, self.logits = fresh, mask, logits
            self.reqs, self.outs = list(reqs), [[] for _ in reqs]
            self.pos = mask.sum(-1)
            self.gens = [self._gen(r) for r in reqs]
            return
        cols = self.attn.shape[1]
        if width > cols:  # room on the left for the new prompt
            self._pad_left(width - cols)
            cols = width
        slots = self.free_slots()[: len(reqs)]
        grow = [s for s in slots if s >= len(self.reqs)]
        if grow:  # the batch is below its size: new rows (a copy of the buffer, only while it fills up)
            self._add_rows(len(grow))
        idx = torch.tensor(slots, device=self.attn.device)
        for main, new in zip(self.cache.layers, fresh.layers):
            main._k[idx, :, cols - width : cols] = new._k[:, :, :width]
            main._v[idx, :, cols - width : cols] = new._v[:, :, :width]
        self.attn[idx] = 0
        self.attn[idx, cols - width :] = mask
        self.pos[idx] = mask.sum(-1)
        self.logits[idx] = logits.to(self.logits.dtype)
        for s, r in zip(slots, reqs):
            self.reqs[s], self.outs[s], self.gens[s] = r, [], self._gen(r)

    def _gen(self, r: Request) -> torch.Generator | None:
        if self.temperature <= 0:
            return None
        return torch.Generator(device=self.model.device).manual_seed(int(r.seed))

    def _add_rows(self, n: int) -> None:
        for layer in self.cache.layers:
            for name in ("_k", "_v"):
                buf = getattr(layer, name)
                setattr(layer, name, torch.cat([buf, buf.new_zeros(n, *buf.shape[1:])]))
            layer.keys, layer.values = layer._k[:, :, : layer.length], layer._v[:, :, : layer.length]
        self.attn = torch.cat([self.attn, self.attn.new_zeros(n, self.attn.shape[1])])
        self.pos = torch.cat([self.pos, self.pos.new_zeros(n)])
        self.logits = torch.cat([self.logits, self.logits.new_zeros(n, self.logits.shape[1])])
        self.reqs += [None] * n
        self.outs += [[] for _ in range(n)]
        self.gens += [None] * n

    def _pad_left(self, n: int) -> None:
        for layer in self.cache.layers:
            for name in ("_k", "_v"):
                buf = getattr(layer, name)
                new = buf.new_zeros(buf.shape[0], buf.shape[1], layer.capacity + n, buf.shape[3])
                new[:, :, n : n + layer.length] = buf[:, :, : layer.length]
                setattr(layer, name, new)
            layer.capacity += n
            layer.length += n
            layer.keys, layer.values = layer._k[:, :, : layer.length], layer._v[:, :, : layer.length]
        self.attn = torch.cat([self.attn.new_zeros(self.attn.shape[0], n), self.attn], dim=1)

    def trim_left(self) -> None:
        """Drop the columns no live row reads once there are ``GROW`` of them: attention reads every column of the
        buffer a step, so dead ones cost as much as live ones (one copy every ``GROW`` steps at most)."""
        alive = [s for s, r in enumerate(self.reqs) if r is not None]
        if not alive:
            return
        first = int(self.attn[alive].argmax(-1).min())  # the first column a live row reads
        if first < GROW:
            return
        for layer in self.cache.layers:
            keep = layer.length - first
            for name in ("_k", "_v"):
                buf = getattr(layer, name)
                new = buf.new_zeros(buf.shape[0], buf.shape[1], keep + GROW, buf.shape[3])
                new[:, :, :keep] = buf[:, :, first : layer.length]
                setattr(layer, name, new)
            layer.capacity, layer.length = keep + GROW, keep
            layer.keys, layer.values = layer._k[:, :, :keep], layer._v[:, :, :keep]
        self.attn = self.attn[:, first:].contiguous()

    def pick(self) -> list[int | None]:
        """One token per live row from its logits (None for a dead slot). Sampling is by inverse CDF: one uniform
        per row from the row's own generator, then one batched search over the rows' cumulative probabilities
        (a multinomial per row was a fifth of a batch-64 step)."""
        live = [r is not None for r in self.reqs]
        if self.temperature <= 0:
            toks = self.logits.argmax(-1).tolist()
        else:
            probs = torch.softmax(self.logits.float() / self.temperature, dim=-1)
            u = torch.tensor([float(torch.rand(1, generator=g)) if ok else 0.0 for ok, g in zip(live, self.gens)],
                             device=probs.device)
            cdf = probs.cumsum(-1)
            toks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[-1] - 1)
            toks = toks[:, 0].tolist()
        return [t if ok else None for t, ok in zip(toks, live)]

    def step(self, toks: list[int | None]) -> None:
        """Every row (dead ones too: they are overwritten at the next admission) appends one token."""
        tok = torch.tensor([t if t is not None else 0 for t in toks], dtype=torch.long, device=self.attn.device)
        self.attn = torch.cat([self.attn, self.attn.new_ones(len(toks), 1)], dim=1)
        self.logits = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=self.pos[:, None],
                                 use_cache=True, **cache_kwargs(self.model, self.cache)).logits[:, -1]
        self.pos = self.pos + 1


@torch.no_grad()
def generate_refill(model: PreTrainedModel, pull: Callable[[int], list[Request]],
                    finish: Callable[[Any, list[int]], None], stops: Sequence[int], pad_id: int,
                    max_new_tokens: int, batch_size: int = 64, temperature: float = 0.0,
                    refill_at: float = 0.125) -> None:
    """Replies to every request ``pull(n)`` hands out (up to ``n`` at a time; fewer or none when none is ready), each
    passed to ``finish(tag, new_tokens)`` as soon as it ends (cut after its first stop token, which is kept).
    ``finish`` may make new requests ready (a conversation's next turn); generation ends when ``pull`` has none and
    no row is live."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batch = _Batch(model, batch_size, temperature)
    stop = {int(s) for s in stops}
    while True:
        free = len(batch.free_slots())
        if free and (batch.live() == 0 or free >= max(1, refill_at * batch_size)):
            reqs = pull(free)
            if any(len(r.prompt) == 0 for r in reqs):
                raise ValueError("empty prompt: generation needs at least one token of context")
            if reqs:
                batch.admit(reqs, pad_id)
        if batch.live() == 0:
            return
        toks = batch.pick()
        for s, t in enumerate(toks):
            if t is None:
                continue
            batch.outs[s].append(t)
            if t in stop or len(batch.outs[s]) >= max_new_tokens:
                req, batch.reqs[s] = batch.reqs[s], None
                finish(req.tag, batch.outs[s])
        if batch.live() == 0:
            continue  # nothing to step: admit what is ready, or end
        batch.trim_left()
        batch.step(toks)
