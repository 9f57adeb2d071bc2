"""The batch sweep: ``speculative_decode_batch`` at the fixed K and at the dynamic policy's K*(B) against
``decode_ar_batch`` per batch size, with the crossover batch sizes and the batched lossless check.

Split out of eval/benchmark.py for readability (no behaviour change); eval/benchmark.py re-exports every name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from eval.bench_setup import BenchSettings, Method
from eval.bench_stats import Pooled, first_diff, stats_of
from eval.cost_model import crossover_batch_size
from eval.decode_batch import decode_ar_batch, speculative_decode_batch
from eval.decode_result import DecodeResult
from models.proposal import Sampling
from models.target import FrozenTarget


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def batch_sweep(target: FrozenTarget, chains: Sequence[Method], ids: Sequence[Tensor], s: BenchSettings,
                 policy: Mapping[str, dict], eos: int | None, mismatches: dict[str, list]) -> dict:
    """``speculative_decode_batch`` (fixed K and the policy's K*) vs ``decode_ar_batch`` per batch size.
    Rows cycle through the prompts; every run at T=0 must reproduce batched AR row for row."""
    device = ids[0].device
    temp = s.batch_temperature
    sampling = Sampling(temp, s.top_p, s.top_k)
    reps = range(s.repetitions)
    ar_tps: dict[int, list[float]] = {}
    per: dict[str, list[dict]] = {m.name: [] for m in chains}
    n_runs = sum(1 + sum(1 + (policy[m.name]["k_star"][b] not in (0, m.k)) for m in chains) for b in s.batch_sizes)
    bar = tqdm(total=n_runs * s.repetitions, desc="batch", disable=not s.progress, leave=False)

    def one(b: int, m: Method | None, k: int | None, rep: int | None) -> list[DecodeResult]:
        rows = [ids[i % len(ids)][0] for i in range(b)]
        gen = None if temp == 0 else seeded_generator(device, s.seed + 104729 * (rep or 0) + b)
        samp = replace(sampling, generator=gen)
        if m is None:
            return decode_ar_batch(target, rows, s.max_new_tokens, eos_id=eos, sampling=samp)
        # one batched proposer for the b rows (a batched drafter drafts them all in one forward per round)
        return speculative_decode_batch(target, [m.make(k) for _ in range(b)], rows, s.max_new_tokens, eos_id=eos,
                                        sampling=samp)

    def tps(res: list[DecodeResult]) -> float:
        return sum(len(r.tokens) for r in res) / res[0].total_s  # timings are the batch's, shared by its rows

    def draft_per_round(res: list[DecodeResult]) -> float:
        return res[0].draft_s / max(max(r.rounds for r in res), 1)  # shared seconds / the batch's rounds

    for b in s.batch_sizes:
        configs: list[tuple[Method | None, int | None, str]] = [(None, None, "ar")]
        for m in chains:
            configs.append((m, int(m.k), "fixed"))
            ks = policy[m.name]["k_star"][b]
            if ks not in (0, m.k):
                configs.append((m, ks, "dynamic"))
        for m, k, _ in configs:
            for _ in range(s.warmup):
                one(b, m, k, None)
        measured: dict[tuple[str, str], list[float]] = {}
        drafting: dict[str, list[float]] = {}
        pools: dict[str, Pooled] = {}
        for rep in reps:
            ar_res = None
            for m, k, tag in configs:
                res = one(b, m, k, rep)
                bar.update()
                if m is None:
                    ar_res = res
                    ar_tps.setdefault(b, []).append(tps(res))
                    continue
                measured.setdefault((m.name, tag), []).append(tps(res))
                if tag == "fixed":
                    drafting.setdefault(m.name, []).append(draft_per_round(res))
                    for r in res:
                        pools.setdefault(m.name, Pooled()).add(r, None)
                if temp == 0:
                    for row, (a, r) in enumerate(zip(ar_res, res)):
                        if a.tokens != r.tokens:
                            mismatches[m.name].append({"where": "batch", "batch_size": b, "k": k, "rep": rep,
                                                       "row": row, "first_diff": first_diff(a.tokens, r.tokens)})
        ar_b = ar_tps[b]
        for m in chains:
            pol = policy[m.name]
            ks = pol["k_star"][b]
            fixed = measured[(m.name, "fixed")]
            dyn_src = "run" if ks not in (0, m.k) else ("ar" if ks == 0 else "fixed")
            dyn = {"run": measured.get((m.name, "dynamic")), "ar": ar_b, "fixed": fixed}[dyn_src]
            per[m.name].append({
                "batch_size": b, "k": int(m.k), "tokens_per_s": stats_of(fixed),
                "speedup": stats_of([f / a for f, a in zip(fixed, ar_b)]), "tau": pools[m.name].tau,
                "predicted_speedup": pol["predicted_speedup"][b][int(m.k)],
                "draft_s_per_round": stats_of(drafting[m.name]),
                "dynamic": {"k": ks, "predicted_speedup": pol["predicted_speedup"][b][ks], "measured_as": dyn_src,
                            "tokens_per_s": stats_of(dyn), "speedup": stats_of([d / a for d, a in zip(dyn, ar_b)])},
            })
    bar.close()
    out: dict[str, Any] = {"temperature": temp, "batch_sizes": list(s.batch_sizes),
                           "ar_tokens_per_s": {b: stats_of(v) for b, v in ar_tps.items()}, "methods": {}}
    for m in chains:
        rows = per[m.name]
        sizes = [r["batch_size"] for r in rows]
        out["methods"][m.name] = {
            "k_fixed": int(m.k), "by_batch": rows,
            "crossover_batch_size": crossover_batch_size(sizes, [r["speedup"]["median"] for r in rows]),
            "dynamic_crossover_batch_size": crossover_batch_size(sizes, [r["dynamic"]["speedup"]["median"]
                                                                         for r in rows]),
            "speculation_off_from_batch_size": next((b for b in sizes if policy[m.name]["k_star"][b] == 0), None),
            "recommended_num_speculative_tokens": {b: policy[m.name]["k_star"][b] for b in sizes},
            "lossless": not any(x["where"] == "batch" for x in mismatches[m.name]),
        }
    return out
