"""Batched generation from a frozen HF causal LM at the cost of its arithmetic: a preallocated KV cache and
finished rows dropped from the batch.

``model.generate`` with transformers' ``DynamicCache`` concatenates every layer's K/V at every step, so a batch of
64 rows at 256 tokens spends two thirds of its time in ``torch.cat`` (measured on SmolLM2-135M, 2 CPU threads), and
it keeps computing rows that already ended until the longest one does. Here:

- ``GrowingCache``: one buffer per layer, ``[B, kv_heads, capacity, head_dim]``, written in place; attention reads
  the filled prefix as a view (SDPA takes its strides), and the buffer grows by doubling, so a step copies only
  its own new K/V.
- ``generate_batch``: left-padded prefill, then one token per step for the live rows. A row that emits a stop token
  is finished; finished rows are dropped from the batch (and the cache) once they are a quarter of it, so the cost
  of a compaction is paid O(log B) times, not once per finished row.

Sampling is pure temperature (no top-k/top-p), drawn from a ``torch.Generator`` seeded by the caller: the same
prompts, batch and seed give the same tokens on every run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from models.core.hf_compat import cache_kwargs


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose K/V live in a preallocated buffer (amortised doubling), returned as views."""

    def __init__(self, capacity: int = 256, grow_step: int = 0):
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.grow_step = grow_step  # 0: double when full; else grow to the need plus this many columns
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        # zeros, not empty: attention may read the whole buffer with the unfilled columns masked
        # (models/core/attention.py), and a masked NaN would still poison its weighted sum
        self._k = key_states.new_zeros(b, h, self.capacity, d)
        self._v = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _grow(self, need: int) -> None:
        cap = self.capacity
        while cap < need:
            cap = need + self.grow_step if self.grow_step else cap * 2
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = cap

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.length, key_states.shape[-2]
        if n + t > self.capacity:
            self._grow(n + t)
        self._k[:, :, n : n + t] = key_states
        self._v[:, :, n : n + t] = value_states
        self.length = n + t
        self.keys, self.values = self._k[:, :, : n + t], self._v[:, :, : n + t]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only ``rows`` (batch indices) stay; one copy of the filled prefix."""
        if self.is_initialized:
            self._k = self._k[rows, :, : self.capacity].contiguous()
            self._v = self._v[rows, :, : self.capacity].contiguous()
            self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keep_rows(indices)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]


class GrowingCache(Cache):
    """A transformers ``Cache`` of ``GrowingLayer``s, one per decoder layer."""

    def __init__(self, num_layers: int, capacity: int = 256, grow_step: int = 0):
        super().__init__(layers=[GrowingLayer(capacity, grow_step) for _ in range(num_layers)])

    def keep_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep_rows(rows)


def pick_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] logits → [B] tokens: argmax at T=0, else one draw from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]], stops: Sequence[int], pad_id: int,
                   max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                   compact_at: float = 0.25) -> list[list[int]]:
    """New tokens per prompt, each cut after its first stop token (the stop token kept)."""
    if not prompts:
        return []
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt: generation needs at least one token of context")
    n_rows, width = len(prompts), max(len(p) for p in prompts)
    device = model.device
    # Left padding: every row's last prompt token sits at the last column, so new tokens append in lockstep;
    # position ids count only real tokens, so a padded row sees the positions it would see alone.
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n_rows, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        attn[r, width - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = GrowingCache(model.config.num_hidden_layers, capacity=width + min(max_new_tokens, 64))
    gen = torch.Generator(device=device).manual_seed(int(seed)) if temperature > 0 else None
    stop_t = torch.tensor(sorted({int(s) for s in stops}), dtype=torch.long, device=device)

    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                   **cache_kwargs(model, cache)).logits[:, -1]
    next_pos = pos[:, -1] + 1
    live = torch.arange(n_rows, device=device)  # original index of each batch row
    done = torch.zeros(n_rows, dtype=torch.bool, device=device)  # per batch row: already stopped
    out: list[list[int]] = [[] for _ in range(n_rows)]
    for step in range(max_new_tokens):
        tok = pick_tokens(logits, temperature, gen)
        for r, t in zip(live[~done].tolist(), tok[~done].tolist()):
            out[r].append(t)
        done = done | torch.isin(tok, stop_t)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if int(done.sum()) >= compact_at * len(live):
            keep = (~done).nonzero().squeeze(-1)
            cache.keep_rows(keep)
            live, tok, attn, next_pos, done = live[keep], tok[keep], attn[keep], next_pos[keep], done[keep]
        attn = torch.cat([attn, attn.new_ones(len(live), 1)], dim=1)
        logits = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None], use_cache=True,
                       **cache_kwargs(model, cache)).logits[:, -1]
        next_pos = next_pos + 1
    return out
