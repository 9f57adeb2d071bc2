"""The batch sweep: ``speculative_decode_batch`` at the fixed K and at the dynamic policy's K*(B) against
``decode_ar_batch`` per batch size, with the crossover batch sizes and the batched lossless check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from eval.bench.cost_model import crossover_batch_size
from eval.bench.precision import Judge, failures, first_diff
from eval.bench.setup import BenchSettings, Method
from eval.bench.stats import Pooled, stats_of
from eval.decode.batch import decode_ar_batch, speculative_decode_batch
from eval.decode.result import DecodeResult
from models.core.proposal import Sampling
from models.core.target import FrozenTarget


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def batch_sweep(target: FrozenTarget, base: Method, chains: Sequence[Method], ids: Sequence[Tensor],
                s: BenchSettings, policy: Mapping[str, dict], eos: int | None, mismatches: dict[str, list],
                judge: Judge | None = None) -> dict:
    """``speculative_decode_batch`` (fixed K and the policy's K*) vs the baseline ``base`` (``decode_ar_batch``) per
    batch size. Rows cycle through the prompts; every run at T=0 must reproduce batched AR row for row. The ladder:
    per batch size ``configs`` → ``measure_batch`` (warmup, then every repetition of every config) →
    ``by_batch_row`` per method; then ``method_summary`` per method."""
    n_runs = sum(len(configs(b, base, chains, policy)) for b in s.batch_sizes)
    bar = tqdm(total=n_runs * s.repetitions, desc="batch", disable=not s.progress, leave=False)
    ar_tps: dict[int, list[float]] = {}
    per: dict[str, list[dict]] = {m.name: [] for m in chains}
    for b in s.batch_sizes:
        got = measure_batch(target, ids, s, b, configs(b, base, chains, policy), eos, mismatches, bar, judge)
        ar_tps[b] = got[base.name]
        for m in chains:
            per[m.name].append(by_batch_row(m, b, policy[m.name], got, base.name))
    bar.close()
    out: dict[str, Any] = {"temperature": s.batch_temperature, "batch_sizes": list(s.batch_sizes),
                           "ar_tokens_per_s": {b: stats_of(v) for b, v in ar_tps.items()},
                           "methods": {m.name: method_summary(m, per[m.name], policy[m.name], mismatches[m.name])
                                       for m in chains}}
    return out


Run = tuple[Method, int | None, str]  # (method, K, tag): the baseline's tag is its name, else "fixed" | "dynamic"


def configs(b: int, base: Method, chains: Sequence[Method], policy: Mapping[str, dict]) -> list[Run]:
    """The runs at batch size b: the baseline, every method at its fixed K, and at the policy's K*(b) where that
    differs (K* = 0 is the baseline, K* = K the fixed run: neither is run twice)."""
    out: list[Run] = [(base, None, base.name)]
    for m in chains:
        out.append((m, int(m.num_speculative_tokens), "fixed"))
        star = policy[m.name]["recommended_num_speculative_tokens"][b]
        if star not in (0, m.num_speculative_tokens):
            out.append((m, star, "dynamic"))
    return out


def run_batch(target: FrozenTarget, ids: Sequence[Tensor], s: BenchSettings, b: int, m: Method,
              num_speculative_tokens: int | None, rep: int | None, eos: int | None) -> list[DecodeResult]:
    """One batched run: b rows cycling through the prompts, method m drafting num_speculative_tokens (the baseline:
    plain batched decoding)."""
    device = ids[0].device
    rows = [ids[i % len(ids)][0] for i in range(b)]
    gen = None if s.batch_temperature == 0 else seeded_generator(device, s.seed + 104729 * (rep or 0) + b)
    sampling = Sampling(s.batch_temperature, s.top_p, s.top_k, gen)
    if m.baseline:
        return decode_ar_batch(target, rows, s.max_new_tokens, eos_id=eos, sampling=sampling)
    # one batched proposer for the b rows (a batched drafter drafts them all in one forward per round)
    return speculative_decode_batch(target, m.make_batch(num_speculative_tokens, b), rows, s.max_new_tokens, eos_id=eos,
                                    sampling=sampling)


def tokens_per_s(res: list[DecodeResult]) -> float:
    return sum(len(r.tokens) for r in res) / res[0].total_s  # timings are the batch's, shared by its rows


def draft_per_round(res: list[DecodeResult]) -> float:
    return res[0].draft_s / max(max(r.rounds for r in res), 1)  # shared seconds / the batch's rounds


def measure_batch(target: FrozenTarget, ids: Sequence[Tensor], s: BenchSettings, b: int,
                  runs: list[Run], eos: int | None, mismatches: dict[str, list],
                  bar: Any, judge: Judge | None = None) -> dict:
    """Warm up, then every repetition of every run at batch size b (``runs[0]``: the baseline) → {baseline name:
    [tokens/s per rep], (name, tag): [tokens/s per rep], ("draft", name): [fixed-K draft s per round], ("pool",
    name): Pooled}; T=0 runs that differ from batched AR are appended to ``mismatches``."""
    for m, num_speculative_tokens, _ in runs:
        for _ in range(s.warmup):
            run_batch(target, ids, s, b, m, num_speculative_tokens, None, eos)
    got: dict[Any, Any] = {runs[0][0].name: []}
    for rep in range(s.repetitions):
        ar_res = None
        for m, num_speculative_tokens, tag in runs:
            res = run_batch(target, ids, s, b, m, num_speculative_tokens, rep, eos)
            bar.update()
            if m.baseline:
                ar_res = res
                got[m.name].append(tokens_per_s(res))
                continue
            got.setdefault((m.name, tag), []).append(tokens_per_s(res))
            if tag == "fixed":
                got.setdefault(("draft", m.name), []).append(draft_per_round(res))
                for r in res:
                    got.setdefault(("pool", m.name), Pooled()).add(r, None)
            if s.batch_temperature == 0:
                for row, (a, r) in enumerate(zip(ar_res, res)):
                    if a.tokens != r.tokens:  # judged against the dtype's noise (eval/bench/precision.py)
                        d = (judge.divergence(row % len(ids), a.tokens, r.tokens) if judge is not None
                             else {"first_diff": first_diff(a.tokens, r.tokens)})
                        mismatches[m.name].append({"where": "batch", "batch_size": b,
                                                   "num_speculative_tokens": num_speculative_tokens, "rep": rep,
                                                   "row": row, **d})
    return got


def by_batch_row(m: Method, b: int, pol: dict, got: dict, base: str) -> dict:
    """Method m's results at batch size b: fixed K measured, and the dynamic K* (measured as its own run, as
    the baseline ``base`` when K* = 0 — ``measured_as`` its name, "ar" — or as the fixed run when K* = K)."""
    ar_b = got[base]
    star = pol["recommended_num_speculative_tokens"][b]
    fixed = got[(m.name, "fixed")]
    dyn_src = "run" if star not in (0, m.num_speculative_tokens) else (base if star == 0 else "fixed")
    dyn = {"run": got.get((m.name, "dynamic")), base: ar_b, "fixed": fixed}[dyn_src]
    return {
        "batch_size": b, "num_speculative_tokens": int(m.num_speculative_tokens), "tokens_per_s": stats_of(fixed),
        "speedup": stats_of([f / a for f, a in zip(fixed, ar_b)]), "tau": got[("pool", m.name)].tau,
        "predicted_speedup": pol["predicted_speedup"][b][int(m.num_speculative_tokens)],
        "draft_s_per_round": stats_of(got[("draft", m.name)]),
        "dynamic": {"num_speculative_tokens": star, "predicted_speedup": pol["predicted_speedup"][b][star],
                    "measured_as": dyn_src,
                    "tokens_per_s": stats_of(dyn), "speedup": stats_of([d / a for d, a in zip(dyn, ar_b)])},
    }


def method_summary(m: Method, rows: list[dict], pol: dict, mismatches: list) -> dict:
    """Method m over the batch sizes: crossovers (fixed and dynamic), where the policy turns speculation off."""
    sizes = [r["batch_size"] for r in rows]
    return {
        "num_speculative_tokens": int(m.num_speculative_tokens), "by_batch": rows,
        "crossover_batch_size": crossover_batch_size(sizes, [r["speedup"]["median"] for r in rows]),
        "dynamic_crossover_batch_size": crossover_batch_size(sizes, [r["dynamic"]["speedup"]["median"] for r in rows]),
        "speculation_off_from_batch_size": next((b for b in sizes
                                                 if pol["recommended_num_speculative_tokens"][b] == 0), None),
        "recommended_num_speculative_tokens": {b: pol["recommended_num_speculative_tokens"][b] for b in sizes},
        "lossless": not any(x["where"] == "batch" for x in failures(mismatches)),
    }
