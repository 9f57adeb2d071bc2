"""The evaluation harness: acceptance, speedup, cost-model bound, HF peers, batch crossover, one process.

Every method runs in ONE process on the SAME prompts with the same thread count, interleaved prompt by prompt
(rep r runs AR then every method on prompt 1, then on prompt 2, ..., then the HF peers) so that a machine whose
speed drifts slows all of them alike;
speedups are paired ratios (method tokens/s ÷ AR tokens/s of the same repetition), reported as median and
spread over repetitions.

Measured per (method, temperature):

* τ = mean tokens per verification forward, bonus included (pooled over every round of every prompt and
  repetition); acceptance rate by draft position; draft vs verify seconds; tokens/s; speedup over AR.
* lossless: at T = 0 every method's tokens must equal AR's for every prompt and repetition (and, in the batch
  sweep, every row must equal batched AR's row). Any mismatch marks the method ``lossless: false``; the CLI
  exits non-zero. In fp16/bf16 a mismatch at a near-tie the dtype's measured noise explains is tolerated but
  still reported with its gap (eval/bench/precision.py).
* cost model: c = draft seconds per drafted node / the target's cost per call (AR's in-situ seconds per decode
  step); v(K) = (K+1)-token forward / 1-token forward, microbenchmarked on a cache of the mid-generation
  length; bound = τ / (K̄·c + r·v̄ + 1 − r) with K̄ the mean drafted nodes per round (tree size for trees), v̄ the
  mean of v(K_r) over rounds and r = t1 / AR's in-situ step (the loop's per-step overhead is paid once a round,
  not v times); efficiency = measured decode-phase speedup (prefill excluded, like the bound) /
  bound: what overheads — acceptance, KV compaction, Python — leave of the bound.

HF peers (T = 0): ``generate(prompt_lookup_num_tokens=K)`` and, when a draft model is given,
``generate(assistant_model=...)``, plus plain HF greedy ``generate`` — tokens/s, speedup vs our AR, whether
their tokens equal our AR's, and each of our methods' tokens/s relative to HF prompt lookup.

Batch sweep (chain methods; ``speculative_decode_batch`` vs ``decode_ar_batch``): tokens/s and speedup per
batch size, the crossover batch size (the first with speedup < 1, else null), and a dynamic speculation
policy: K*(B) = argmax_K E[tokens | K] · w_B(0) / (d_B(K) + w_B(K)), with E from the measured per-position
acceptance, w_B(K) the measured cost of a B-row, (K+1)-token verify forward and d_B(K) the measured cost of one
batched drafting round for all B rows (``measure_draft_costs`` through the method's batched proposer, scaled to
the in-situ K·c at B=1; not the B·K·c of B proposers drafting one after another) (K* = 0: speculation off),
measured against the fixed K; each batch row records the drafting seconds per round it actually spent.
``recommended_num_speculative_tokens`` (batch 1) is what train/export.py ``--results`` reads.

Results schema (``run_benchmark``'s dict; ``write_json`` turns int keys into strings and NaN into null):

    schema_version 1, created_utc, env {python, torch, transformers, threads, interop_threads, cpu_count,
        machine, processor, device, dtype[, gpu]}, target {identity()..., dtype, params},
    settings {BenchSettings fields}, prompts {source, n, categories {cat: n}, tokens {mean, min, max}, labels},
    cost_model {prefix_len, reps, t_target_s, t_ar_step_s {T: s}, verify {K: v(K)}, batch {B: {K: w_B(K)}},
        draft_s_per_round {chain method: {B: {K: s}}}},
    precision {dtype, exact, noise, threshold, slack, noise_positions, noise_width} (eval/bench/precision.py),
    methods {name: {kind, num_speculative_tokens, chain, checkpoint, options, lossless, mismatches [..20],
        n_mismatches, n_tolerated, divergences [{where, rep, prompt|row.., first_diff, ar_token, token, gap, top2_gap,
        noise, threshold, tolerated}]}},
        lossless = single-sequence AND batch-sweep T=0 runs reproduced AR (AR: reproduced itself) — exactly in
        fp32; in fp16/bf16 up to divergences at near-ties within the measured noise (tolerated, still listed),
    skipped {name: reason},
    runs [{method, kind, temperature, tau, acceptance_by_pos [k], rounds, tokens (per repetition),
        time_s, tokens_per_s, speedup, decode_speedup: {median, min, max, spread, values}, draft_s, verify_s, prefill_s
        (per repetition), draft_frac, k_mean, c, v, bound, efficiency, lossless (T=0 single runs; null at T>0),
        vs_hf_prompt_lookup (T=0), by_category {cat: {n_prompts, tau, acceptance_by_pos, tokens_per_s, speedup}}}],
    peers {hf_greedy | hf_prompt_lookup | hf_assisted: {temperature 0, settings, tokens_per_s, speedup_vs_ar,
        matches_ar}},
    policy {chain method: {acceptance_by_pos, c, num_speculative_tokens (the fixed K, the largest tried),
        draft_per_round {B: {K: d_B(K)}}, recommended_num_speculative_tokens {B: K*}, predicted_speedup {B: {K: s}},
        best_positive_num_speculative_tokens (best K >= 1 at batch 1)}},
    batch null | {temperature, batch_sizes, ar_tokens_per_s {B: stats}, methods {name: {num_speculative_tokens,
        by_batch [{batch_size, num_speculative_tokens, tokens_per_s, speedup, tau, predicted_speedup,
        draft_s_per_round (stats over repetitions of the fixed-K runs' drafting seconds per batch round), dynamic
        {num_speculative_tokens (K*), predicted_speedup, measured_as run|fixed|ar, tokens_per_s, speedup}}],
        crossover_batch_size, dynamic_crossover_batch_size,
        speculation_off_from_batch_size, recommended_num_speculative_tokens {B: K*}, lossless}}},
    recommended_for, recommended_num_speculative_tokens (K* at batch 1, 0 = AR is faster; for the exporter),
    best_positive_num_speculative_tokens (best K >= 1 at batch 1),
    recommended_num_speculative_tokens_by_batch {B: K*, 0 = off}, speculation_pays_at_batch_1,
    lossless (all methods).

Layout: eval/bench/setup.py (method kinds, prompts, methods, settings), eval/bench/cost_model.py (forward-cost
microbenchmark, policy formulas), eval/bench/stats.py (pooled accounting, per-run summaries), eval/bench/peers.py
(HF peers), eval/bench/batch_sweep.py (batch sweep). This module runs them (``run_benchmark``) and writes the
JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from eval.bench.batch_sweep import batch_sweep, seeded_generator
from eval.bench.certificate import certify_runs
from eval.bench.cost_model import (
    choose_k,
    draft_round_costs,
    interp,
    measure_costs,
    measure_draft_costs,
)
from eval.bench.peers import hf_generate, peer_runs, peer_summaries
from eval.bench.precision import SLACK, Judge, failures
from eval.bench.quiet import CpuWatch, verdict
from eval.bench.setup import (
    BenchSettings,
    Method,
    Prompt,
)
from eval.bench.stats import Pooled, draft_vocab_coverage, lossless_single, summaries, tps_of
from eval.bench.training import collect as collect_training
from eval.decode.result import DecodeResult
from eval.decode.single import decode_ar, speculative_decode
from models.core.lookup import lookup_width
from models.core.proposal import Sampling
from models.core.target import FrozenTarget


# --------------------------------------------------------------------------------------------- the run
def _decode_one(target: FrozenTarget, m: Method, proposer: Any, ids: Tensor, s: BenchSettings, temperature: float,
                gen: torch.Generator | None, eos: int | None) -> DecodeResult:
    sampling = Sampling(temperature, s.top_p, s.top_k, gen)
    if m.baseline:  # plain decoding, not a speculative loop with empty drafts: no engine overhead in the baseline
        return decode_ar(target, ids, s.max_new_tokens, eos_id=eos, sampling=sampling)
    fn = m.decode or speculative_decode
    return fn(target, proposer, ids, s.max_new_tokens, eos_id=eos, sampling=sampling)


def _decode_timed(target: FrozenTarget, m: Method, proposer: Any, ids: Tensor, s: BenchSettings, temperature: float,
                  seed: int | None, eos: int | None) -> DecodeResult:
    """``_decode_one`` for the timings: a decode during which the compiled step traced a width the warm-up did not
    reach (models/core/static_kv.py; ~30 s for SmolLM2) is run again, seeded alike, and the second one counts."""
    def traces() -> int:
        return len(target.static.compile_s) if target.static is not None else 0

    def once() -> DecodeResult:
        gen = None if seed is None else seeded_generator(ids.device, seed)
        return _decode_one(target, m, proposer, ids, s, temperature, gen, eos)
    before = traces()
    r = once()
    return once() if traces() != before else r


def _env(threads: int, device: torch.device, target: FrozenTarget) -> dict:
    import transformers

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "threads": threads, "interop_threads": torch.get_num_interop_threads(), "cpu_count": os.cpu_count(),
           "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
           "device": str(device), "dtype": str(target.model.dtype).replace("torch.", "")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:  # the SIMD flags decide which dtype is fast here (models/core/kernels.py)
        from models.core.kernels import bandwidth_bound, cpu_features

        env["cpu"] = cpu_features()
        linears = (getattr(target.model, "draftsmith_decode_step", None) or {}).get("linears")
        env["bandwidth"] = bandwidth_bound(target.model, linears=linears if target.static is not None else None)
    probe = getattr(target.model, "draftsmith_kernels", None)
    if probe is not None:  # target.dtype=auto: what was measured, and what it chose
        env["dtype_probe"] = probe
    env["decode_step"] = getattr(target.model, "draftsmith_decode_step", None) or {  # eval/bench/decode_step.py
        "mode": None, "chosen": "eager" if target.static is None else "compiled"}
    return env


@torch.no_grad()
def run_benchmark(
    target: FrozenTarget,
    methods: Sequence[Method],
    prompts: Sequence[Prompt],
    settings: BenchSettings | None = None,
    skipped: Mapping[str, str] | None = None,
    prompt_source: str | None = None,
) -> dict:
    """Measure every method on every prompt and return the results dict (schema in the module docstring; NaN
    where nothing was measured, which ``write_json`` writes as null)."""
    s = settings or BenchSettings()
    if not prompts:
        raise ValueError("no prompts")
    if not methods or not methods[0].baseline or any(m.baseline for m in methods[1:]):
        raise ValueError("methods must start with the one baseline, AR (build_methods puts it first)")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    from transformers.utils import logging as hf_logging

    before, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    if s.threads:
        torch.set_num_threads(s.threads)  # pinned: every measurement below runs with the same thread count
    # HF generate warns about assistant / generation-config details on every call; the peers' settings are
    # recorded in the results instead
    hf_logging.set_verbosity_error()
    try:
        return _run(target, methods, prompts, s, skipped, prompt_source)
    finally:  # a library call should not leave the process re-pinned or silenced
        torch.set_num_threads(before)
        hf_logging.set_verbosity(verbosity)


def dynamic_policy(target: FrozenTarget, chains: Sequence[Method], ids: Sequence[Tensor], s: BenchSettings,
                   single: dict, costs: dict) -> dict:
    """Per chain method: acceptance and c from the batch temperature's B=1 runs, the drafting cost per round
    d_B(K) measured for every batch size (``measure_draft_costs``, recorded in ``costs["draft_s_per_round"]``),
    and K*(B) = the argmax of the predicted speedup."""
    policy = {}
    sizes = sorted(costs["batch"])
    costs["draft_s_per_round"] = {}
    for m in chains:
        pool = single["pools"][(m.name, s.batch_temperature)]
        c = pool.draft_s / costs["t_ar_step_s"][s.batch_temperature] / pool.drafted if pool.drafted else 0.0
        acc = pool.acceptance
        n = int(m.num_speculative_tokens)
        seconds = measure_draft_costs(target, m.make_batch, ids, sizes, range(1, n + 1), s.cost_reps)
        costs["draft_s_per_round"][m.name] = seconds
        draft = draft_round_costs(c, n, seconds)
        by_b = {b: choose_k(acc, c, costs["batch"][b], b, n, draft=draft[b]) for b in sizes}
        policy[m.name] = {"acceptance_by_pos": acc, "c": c, "num_speculative_tokens": n, "draft_per_round": draft,
                          "recommended_num_speculative_tokens": {b: k for b, (k, _) in by_b.items()},
                          "predicted_speedup": {b: pred for b, (_, pred) in by_b.items()},
                          "best_positive_num_speculative_tokens": choose_k(acc, c, costs["batch"][1], 1, n, k_min=1,
                                                                           draft=draft[1])[0]}
    return policy


def _run(target: FrozenTarget, methods: Sequence[Method], prompts: Sequence[Prompt], s: BenchSettings,
         skipped: Mapping[str, str] | None, prompt_source: str | None) -> dict:
    """The run's stages: cost tables → single-sequence runs (+ lossless check, summaries) → dynamic policy and
    batch sweep → the results dict and its K recommendation."""
    watch = CpuWatch()  # other processes' CPU use over the whole run (eval/bench/quiet.py)
    device = target.model.device
    eos = target.model.config.eos_token_id if s.stop_at_eos else None
    eos = eos[0] if isinstance(eos, list) else eos
    ids = [torch.tensor([p.ids], dtype=torch.long, device=device) for p in prompts]
    base = methods[0]  # the baseline (run_benchmark checked): its rows are every ratio's denominator
    costs, judge = _cost_tables(target, methods, ids, prompts, s)

    single = _single_runs(target, methods, ids, prompts, s, costs["verify"], eos)
    # the target's real cost per call: AR's in-situ seconds per decode step (forward + sampling), per temperature;
    # c is measured in these units, v(K) and w_B(K) as forward-time ratios from the microbenchmark
    ar_pools = {t: single["pools"][(base.name, t)] for t in s.temperatures}
    costs["t_ar_step_s"] = {t: pool.verify_s / max(pool.rounds, 1) for t, pool in ar_pools.items()}
    mismatches = lossless_single(single["tokens0"], [m.name for m in methods], judge)
    single["certificates"] = _certify(target, methods, ids, s, single, judge, mismatches)
    runs = summaries(methods, prompts, s, single, costs, mismatches)

    # the batch sweep and the policy take the chains; variants are batch-1 rows only (the switch's effect)
    swept = [m for m in methods if m.chain and m.variant_of is None]
    policy = dynamic_policy(target, swept, ids, s, single, costs)
    batch = (batch_sweep(target, base, swept, ids, s, policy, eos, mismatches, judge)
             if s.batch_sizes and swept else None)
    results = _results(target, methods, prompts, s, prompt_source, costs, judge, mismatches, single)
    results.update(skipped=dict(skipped or {}), runs=runs, peers=peer_summaries(single, s), policy=policy,
                   batch=batch)
    # what each drafter cost to train and its learning curve (eval/bench/training.py, from its run directory)
    # (a variant with a drafter of its own under its name; one sharing its method's is reported once, there)
    results["training"] = collect_training((m.variant_of and m.name or m.kind, m.checkpoint)
                                           for m in methods if not m.baseline)
    results.update(recommendation(swept, policy))
    results["lossless"] = all(v["lossless"] for v in results["methods"].values())
    results["quiet"] = _quiet(target, s, watch, single, costs, runs)
    return results


log = logging.getLogger(__name__)


def _quiet(target: FrozenTarget, s: BenchSettings, watch: CpuWatch, single: dict, costs: dict, runs: list[dict]
           ) -> dict:
    """Whether nothing else shared the machine (eval/bench/quiet.py): t1 probed again, AR's rate per repetition,
    every method's efficiency at each temperature."""
    t1_end = measure_costs(target, costs["probe_prefix_len"], [1], [1], 0, s.cost_reps, s.seed)["t_target_s"]
    base = single["baseline"]
    ar = {t: [tps_of(single, (base, t), r) for r in range(s.repetitions)] for t in s.temperatures}
    eff = {f"{e['method']} T={e['temperature']:g}": e["efficiency"] for e in runs if e["method"] != base}
    q = verdict(watch.stop(), ar, (costs["t_target_s"], t1_end), eff)
    if q["contended"]:
        log.warning("contended run (not a result to quote): %s", "; ".join(q["reasons"]))
    return q


def _cost_tables(target: FrozenTarget, methods: Sequence[Method], ids: Sequence[Tensor], prompts: Sequence[Prompt],
                 s: BenchSettings) -> tuple[dict, Judge]:
    """t1, v(K) up to the largest tree and w_B(K) up to the largest chain; the dtype's noise judge; then the trees
    the cost model sizes (e.g. Medusa num_nodes: auto), before any decoding."""
    drafting = [m for m in methods if not m.baseline]
    chains = [m for m in drafting if m.chain]
    # a lookup round (models/core/lookup.py) verifies its own chain, whatever the method's K or tree
    longest = max([int(m.num_speculative_tokens) for m in chains] + [lookup_width(m.options) for m in drafting]
                  or [0])
    trees = [m.nodes for m in drafting if not m.chain]
    widths = [*range(1, longest + 2), *(n + 1 for n in trees),
              *(w for w in (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if w <= max(trees or [0]))]
    prefix_len = round(statistics.mean(len(p.ids) for p in prompts)) + s.max_new_tokens // 2  # mid-generation
    costs = measure_costs(target, prefix_len, widths, sorted({1, *s.batch_sizes}), longest, s.cost_reps, s.seed)
    costs["probe_prefix_len"] = prefix_len  # t1 is probed again after decoding (eval/bench/quiet.py)
    # the dtype's numeric noise between a verification-width forward and AR's one-token step: the T=0 check is
    # exact in fp32, in fp16/bf16 a divergence fails only where the target's own gap exceeds it
    # (eval/bench/precision.py)
    judge = Judge.measure(target, ids, widths)
    for m in drafting:
        m.size_tree(target, lambda n: interp(costs["verify"], n), costs["t_target_s"])
    return costs, judge


def _certify(target: FrozenTarget, methods: Sequence[Method], ids: Sequence[Tensor], s: BenchSettings, single: dict,
             judge: Judge, mismatches: dict[str, list]) -> dict[str, dict]:
    """Every emitted token of every method's single-sequence runs checked on its own prefix (eval/bench/certificate.py);
    a T=0 token outside the noise bound joins the method's mismatches (not lossless)."""
    measured = {w: n for w, n in judge.per_width.items() if w > 1}
    width = min(measured, key=lambda w: (measured[w], -w)) if measured else 2  # the least noise, then the widest
    cert_noise = judge.noise_at([width])
    thresholds = {m.name: None if judge.exact else SLACK * (judge.noise_at(_widths(m)) + cert_noise)
                  for m in methods}
    certs = certify_runs(target, ids, {k: v for k, v in single["tokens"].items() if k[0] in thresholds},
                         thresholds, width, s.top_p, s.top_k, s.seed)
    for name, by_t in certs.items():  # in the divergence table's columns: the target's greedy token as "ar_token"
        mismatches[name] += [{"where": "certificate", "rep": f["rep"], "prompt": f["prompt"], "first_diff": f["pos"],
                              "ar_token": f["greedy"], "token": f["token"], "gap": f["gap"], "top2_gap": None,
                              "noise": None, "threshold": thresholds[name], "tolerated": False}
                             for f in by_t["0"]["failures"]]
    return certs


def _widths(m: Method) -> list[int]:
    """The forward widths a method's rounds verify at (AR: 1), for the noise bound of its certificate."""
    if m.baseline:
        return [1]
    ws = [int(m.num_speculative_tokens) + 1] if m.chain and m.num_speculative_tokens else []
    if not m.chain and getattr(m, "nodes", None):
        ws.append(int(m.nodes) + 1)
    if lookup_width(m.options):
        ws.append(lookup_width(m.options) + 1)
    return ws or [0]  # unknown: the largest noise measured


def _results(target: FrozenTarget, methods: Sequence[Method], prompts: Sequence[Prompt], s: BenchSettings,
             prompt_source: str | None, costs: dict, judge: Judge, mismatches: Mapping[str, list], single: dict
             ) -> dict[str, Any]:
    """The results' header: environment, target, settings, prompts, cost model, precision, per-method entries."""
    device = target.model.device
    return {
        "schema_version": 1,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "env": _env(torch.get_num_threads(), device, target),
        "target": {**target.identity(), "dtype": str(target.model.dtype).replace("torch.", ""),
                   "params": sum(p.numel() for p in target.model.parameters())},
        "settings": {k: v for k, v in asdict(s).items() if k != "progress"},
        "prompts": {"source": prompt_source or "heldout", "n": len(prompts),
                    "categories": {c: sum(p.category == c for p in prompts) for c in dict.fromkeys(p.category
                                                                                           for p in prompts)},
                    "tokens": {"mean": statistics.mean(len(p.ids) for p in prompts),
                               "min": min(len(p.ids) for p in prompts), "max": max(len(p.ids) for p in prompts)},
                    "labels": [p.label for p in prompts]},
        "cost_model": costs,
        "precision": judge.summary(),
        "methods": {m.name: _lossless_entry(m, mismatches[m.name]) for m in methods},
        "draft_vocab": draft_vocab_coverage(methods, single["tokens0"][methods[0].name][0]),
        # AR's T=0 tokens (every prompt, first repetition): equal digests = token-identical output across runs
        "ar_tokens_sha256": hashlib.sha256(json.dumps(single["tokens0"][methods[0].name][0]).encode()).hexdigest(),
    }


def recommendation(swept: Sequence[Method], policy: Mapping[str, dict]) -> dict[str, Any]:
    """The top-level K the exporter reads: batch-1 K* of the swept chain whose proposer ranks first
    (``ProposerSpec.recommend_rank``); {} when none of them is ranked."""
    ranked = [m for m in swept if m.proposer_spec() is not None and m.proposer_spec().recommend_rank is not None]
    if not ranked:
        return {}
    pick = min(ranked, key=lambda m: m.proposer_spec().recommend_rank)  # min keeps the first of equal ranks
    pol = policy[pick.name]
    # K* at batch 1; 0 where the cost model says speculation is slower than AR (the exporter then refuses
    # --results rather than ship a slowdown); the best K >= 1 is kept alongside for whoever wants it anyway
    star = pol["recommended_num_speculative_tokens"]
    return {"recommended_for": pick.name, "recommended_num_speculative_tokens": int(star[1]),
            "best_positive_num_speculative_tokens": int(pol["best_positive_num_speculative_tokens"]),
            "recommended_num_speculative_tokens_by_batch": dict(star),
            "speculation_pays_at_batch_1": star[1] > 0}


def _lossless_entry(m: Method, divergences: list[dict]) -> dict:
    """mismatches: the failing divergences (first 20); divergences: every one, tolerated or not, with its gap."""
    bad = failures(divergences)
    return {"kind": m.kind, "num_speculative_tokens": m.num_speculative_tokens, "chain": m.chain,
            "checkpoint": m.checkpoint, "options": m.options, "variant_of": m.variant_of,
            "lossless": not bad, "mismatches": bad[:20], "n_mismatches": len(bad),
            "n_tolerated": len(divergences) - len(bad), "divergences": divergences}


def _single_runs(target: FrozenTarget, methods: Sequence[Method], ids: Sequence[Tensor], prompts: Sequence[Prompt],
                 s: BenchSettings, v_table: Mapping[int, float], eos: int | None) -> dict:
    """Every method on every prompt, the methods in turn on each prompt (then the HF peers at T=0, prompt after
    prompt), every repetition."""
    device = ids[0].device
    peers = peer_runs(methods) if s.peers else []
    proposers = {m.name: (m.make(None) if m.make else None) for m in methods}
    pools: dict[tuple, Pooled] = {}  # (name, T) and (name, T, category)
    times: dict[tuple[str, float], list[list[float]]] = {}  # [rep][prompt] seconds
    dtimes: dict[tuple[str, float], list[list[float]]] = {}  # the same without prefill (decode phase)
    ntoks: dict[tuple[str, float], list[list[int]]] = {}
    tokens0: dict[str, list[list[list[int]]]] = {}  # T=0 tokens [rep][prompt]
    tokens: dict[tuple[str, float], list[list[list[int]]]] = {}  # every temperature's, [rep][prompt]
    units = sum(len(methods) + (len(peers) if t == 0 else 0) for t in s.temperatures) * s.repetitions * len(ids)
    bar = tqdm(total=units, desc="decode", disable=not s.progress, leave=False)
    for temp in s.temperatures:
        for m in methods:  # warmup: first-call allocations and lazy init stay out of the timings
            for _ in range(s.warmup):
                _decode_one(target, m, proposers[m.name], ids[0], s, temp, seeded_generator(device, s.seed), eos)
        if temp == 0:
            for _, extra in peers:
                for _ in range(s.warmup):
                    hf_generate(target, ids[0], s, eos, extra)
        for rep in range(s.repetitions):
            # prompt by prompt, every method in turn: a stretch where the machine runs slower (seen on a VM with
            # nothing else running) then falls on all methods alike instead of on one method's block of prompts
            got = {m.name: ([], [], [], []) for m in methods}  # seconds, decode seconds, tokens, token ids
            for i, x in enumerate(ids):
                for m in methods:
                    # same seed for every method at a given (rep, prompt); T=0 needs none
                    seed = None if temp == 0 else s.seed + 7919 * rep + i
                    r = _decode_timed(target, m, proposers[m.name], x, s, temp, seed, eos)
                    v = None if m.baseline else v_table
                    pools.setdefault((m.name, temp), Pooled()).add(r, v)
                    pools.setdefault((m.name, temp, prompts[i].category), Pooled()).add(r, v)
                    for col, val in zip(got[m.name], (r.total_s, r.total_s - r.prefill_s, len(r.tokens),
                                                       list(r.tokens))):
                        col.append(val)
                    bar.update()
            for m in methods:
                for store, col in zip((times, dtimes, ntoks, tokens), got[m.name]):
                    store.setdefault((m.name, temp), []).append(col)
                if temp == 0:
                    tokens0.setdefault(m.name, []).append(got[m.name][3])
            if temp == 0:
                for name, extra in peers:
                    t_rep, n_rep, tok_rep = [], [], []
                    for x in ids:
                        toks, dt = hf_generate(target, x, s, eos, extra)
                        t_rep.append(dt)
                        n_rep.append(len(toks))
                        tok_rep.append(toks)
                        bar.update()
                    times.setdefault((name, 0.0), []).append(t_rep)
                    ntoks.setdefault((name, 0.0), []).append(n_rep)
                    tokens0.setdefault(name, []).append(tok_rep)
    bar.close()
    return {"pools": pools, "times": times, "dtimes": dtimes, "ntoks": ntoks, "tokens0": tokens0, "tokens": tokens,
            "peers": peers, "baseline": methods[0].name}


def all_lossless(results: Mapping[str, Any]) -> bool:
    """True when every method kept AR's tokens at T=0 (the CLI's exit status)."""
    return all(m.get("lossless", False) is True for m in results.get("methods", {}).values())


def jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(results: Mapping[str, Any], path: str | Path) -> Path:
    """Strict JSON (NaN/inf → null, int keys → strings), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(results), indent=1, allow_nan=False))
    tmp.replace(path)
    return path
