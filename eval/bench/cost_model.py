"""The cost model: the target's forward-cost microbenchmark and the speculation policy built on it.

``measure_costs`` times v(K) (a (K+1)-token verify forward) and w_B(K) (a B-row one) in units of one single-token
forward; ``predicted_speedup`` / ``choose_k`` turn per-position acceptance (models/core/acceptance.py ``chain_tau``)
and the draft cost into K*(B); ``crossover_batch_size`` finds where speculation stops paying (formulas:
eval/bench/benchmark.py's docstring). ``measure_draft_costs`` times one batched drafting round (propose + accept for
all B rows, through the method's batched proposer) per B and K, so the policy uses the measured cost of drafting
a batch instead of assuming B·K·c (B proposers one after another; a batched drafter such as DFlash costs about
one forward).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from eval.decode.ladder import batch_mask, new_cache, prefill
from eval.decode.result import device_time
from eval.decode.window import apply_window, batch_key_positions
from models.core.acceptance import best_by_cost, chain_tau
from models.core.proposal import Sampling
from models.core.target import FrozenTarget


@torch.no_grad()
def measure_costs(
    target: FrozenTarget,
    prefix_len: int,
    widths: Sequence[int] = (1,),
    batch_sizes: Sequence[int] = (1,),
    k_max_batch: int = 0,
    reps: int = 5,
    seed: int = 0,
) -> dict:
    """Microbenchmark the target's forward cost on a KV cache of ``prefix_len`` entries (random ids: the cost
    does not depend on them).

    Returns ``t_target_s`` = t1 (one row, one token, seconds), ``verify`` {K: cost of one row x (K+1) tokens
    / t1} for every K+1 in ``widths`` (and 1..k_max_batch+1), and ``batch`` {B: {K: cost of B rows x (K+1)
    tokens / t1}} for K = 0..k_max_batch (w_B(0) = one batched AR step). Each entry is the fastest of ``reps``
    timed forwards after an untimed one; the cache is cropped back to ``prefix_len`` after each.
    """
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
    device = target.model.device
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size

    def timed(b: int, ws: Sequence[int]) -> dict[int, float]:
        cache = new_cache(target, b)
        target(torch.randint(vocab, (b, prefix_len), generator=g).to(device), cache=cache, use_cache=True,
               logits_to_keep=1)
        out = {}
        for w in sorted(set(ws)):
            x = torch.randint(vocab, (b, w), generator=g).to(device)
            pos = torch.arange(prefix_len, prefix_len + w, device=device)[None].expand(b, -1)
            # the batched engine always passes its 4D mask (eval/decode/single.py); B=1 chains use plain causal
            # attention
            mask = None if b == 1 else batch_mask(torch.full((b,), prefix_len, device=device), prefix_len, w,
                                                   target.model.dtype)
            if mask is not None:  # the batched engine's windowed masks (eval/decode/window.py), so the timing is its
                mask = apply_window(target.model.config, mask, pos,
                                    batch_key_positions(torch.full((b,), prefix_len, device=device), prefix_len, w))
            samples = []
            for r in range(reps + 1):
                t = device_time(device)
                target(x, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
                dt = device_time(device) - t
                cache.crop(-w)  # transformers 5: a negative count removes that many entries
                if r:
                    samples.append(dt)
            out[w] = min(samples)  # the intrinsic cost: noise on a shared machine only ever adds time
        return out

    batch_ws = range(1, k_max_batch + 2)
    t_b1 = timed(1, sorted({1, *widths, *batch_ws}))
    t1 = t_b1[1]
    batch = {}
    for b in sorted(set(batch_sizes)):
        tb = t_b1 if b == 1 else timed(b, batch_ws)
        batch[b] = {w - 1: tb[w] / t1 for w in batch_ws}
    return {"prefix_len": prefix_len, "reps": reps, "t_target_s": t1,
            "verify": {w - 1: t / t1 for w, t in t_b1.items()}, "batch": batch}


def interp(table: Mapping[int, float], x: float) -> float:
    """Piecewise-linear interpolation of a {K: cost} table; past the last point the last segment's slope
    continues (verify cost keeps growing with width), below the first point the first value holds."""
    ks = sorted(table)
    if x <= ks[0] or len(ks) == 1:
        return table[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    a, b = ks[-2], ks[-1]
    return table[b] + (table[b] - table[a]) * (x - b) / (b - a)


@torch.no_grad()
def measure_draft_costs(target: FrozenTarget, make_batch: Callable[[int, int], Any], prompts: Sequence[Tensor],
                        batch_sizes: Sequence[int], ks: Sequence[int], reps: int = 3) -> dict[int, dict[int, float]]:
    """Seconds of one batched drafting round {B: {K: s}}: B rows (the prompts cycled, [T] each) begin on a
    prefilled target, then ``reps`` timed rounds of propose(K for every row) + accept(one token per row) through
    ``make_batch(K, B)`` (eval's ``Method.make_batch``: the method's batched form for B rows) — the same proposer
    object the batched engine drives. The fastest round
    after an untimed one (noise only ever adds time). Each accept hands every row its first draft + one more
    token (a round that accepted one) and copies of a prompt's hidden row (shapes, not values, set the cost)."""
    device = target.model.device
    out: dict[int, dict[int, float]] = {}
    for b in sorted(set(batch_sizes)):
        rows = [prompts[i % len(prompts)].reshape(-1) for i in range(b)]
        out[b] = {}
        for k in sorted(set(ks)):
            bp = make_batch(k, b)
            pre, _, logits = prefill(target, rows, new_cache(target, len(rows)), list(bp.layer_ids))
            first = logits.argmax(-1)
            bp.begin([torch.cat([r, first[i : i + 1]]) for i, r in enumerate(rows)], pre.hidden, Sampling())
            samples = []
            for r in range(reps + 1):
                t = device_time(device)
                props = bp.propose([k] * b)
                # as in a round: the first draft accepted (when there is one) + the target's next token
                new = [torch.cat([p.tokens[:1].to(device), first[i : i + 1]]) for i, p in enumerate(props)]
                width = max(x.shape[0] for x in new)
                bp.accept(new, {h: v[:, :1].expand(-1, width, -1) for h, v in pre.hidden.items()})
                if r:
                    samples.append(device_time(device) - t)
            out[b][k] = min(samples)
    return out


# --------------------------------------------------------------------------------------------- policy
def predicted_speedup(acceptance: Sequence[float], c: float, w: Mapping[int, float], batch_size: int, k: int,
                      draft: Mapping[int, float] | None = None) -> float:
    """Throughput of K-token chains over batched AR at batch B (cost model; w in units of one single-token
    forward): E(K) · w_B(0) / (d_B(K) + w_B(K)), d_B(K) the cost of drafting one round for all B rows — the
    measured ``draft`` {K: d_B(K)} (same units) when given, else B·K·c (c per drafted token, the B proposers one
    after another). K = 0 → 1."""
    if k == 0:
        return 1.0
    d = interp(draft, k) if draft else batch_size * k * c
    return chain_tau(acceptance, k) * interp(w, 0) / (d + interp(w, k))


def choose_k(
    acceptance: Sequence[float], c: float, w: Mapping[int, float], batch_size: int, k_max: int, k_min: int = 0,
    draft: Mapping[int, float] | None = None,
) -> tuple[int, dict[int, float]]:
    """K* = argmax over K in k_min..k_max of ``predicted_speedup`` (K = 0: speculation off; ties → smaller K).
    Returns (K*, {K: predicted speedup})."""
    return best_by_cost(range(k_min, k_max + 1), lambda k: predicted_speedup(acceptance, c, w, batch_size, k, draft),
                        lambda _k: 1.0)


def draft_round_costs(c: float, k_ref: int, seconds: Mapping[int, Mapping[int, float]]) -> dict[int, dict[int, float]]:
    """{B: {K: d_B(K)}} in the units of c: the in-situ B=1 cost of a K_ref round (K_ref·c, measured while
    decoding) scaled by the microbenchmark's d_B(K) / d_1(K_ref) — so the shape over B and K is measured and the
    level is the real engine's (B=1, K_ref reproduces K_ref·c exactly)."""
    ref = seconds[1][k_ref]
    return {b: {k: k_ref * c * s / ref if ref > 0 else 0.0 for k, s in by_k.items()} for b, by_k in seconds.items()}


def crossover_batch_size(batch_sizes: Sequence[int], speedups: Sequence[float]) -> int | None:
    """The first batch size (ascending) whose speedup is below 1 — where speculation stops paying — or None."""
    for b, s in sorted(zip(batch_sizes, speedups)):
        if s < 1.0:
            return int(b)
    return None
