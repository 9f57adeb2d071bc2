"""Benchmark accounting: per-round counts pooled over prompts and repetitions, repetition statistics, tokens/s,
the T=0 lossless comparison (divergences judged by eval/bench/precision.py) and the per-(method, temperature)
summaries of the single-sequence runs.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eval.bench.cost_model import interp
from eval.bench.precision import Judge, failures, first_diff
from eval.bench.setup import BenchSettings, Method, Prompt
from eval.decode.result import DecodeResult

log = logging.getLogger("eval")

TAU_WINDOW = 32  # reply tokens per window of ``Pooled.tau_by_window``


# --------------------------------------------------------------------------------------------- aggregation
@dataclass
class Pooled:
    """Accounting pooled over prompts and repetitions for one (method, temperature)."""

    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    v_units: float = 0.0  # Σ over rounds of v(K_r)
    pos_tries: list[int] = field(default_factory=list)
    pos_accepts: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    window_rounds: list[int] = field(default_factory=list)  # [w]: rounds that began in reply tokens [32w, 32w+32)
    window_tokens: list[int] = field(default_factory=list)  # [w]: the tokens those rounds produced

    def add(self, r: DecodeResult, v: Mapping[int, float] | None) -> None:
        self._add_windows(r)
        self.rounds += r.rounds
        self.accepted += sum(r.accepted)
        self.drafted += sum(r.drafted)
        if v is not None:
            self.v_units += sum(interp(v, k) for k in r.drafted)
        for i, (t, a) in enumerate(zip(r.pos_tries, r.pos_accepts)):
            if i >= len(self.pos_tries):
                self.pos_tries.append(0)
                self.pos_accepts.append(0)
            self.pos_tries[i] += t
            self.pos_accepts[i] += a
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        self.prefill_s += r.prefill_s

    def _add_windows(self, r: DecodeResult) -> None:
        """Each round under the reply window its first token falls in (the prefill emits reply token 0; a round
        emits its accepted drafts + 1, never past max_new_tokens)."""
        pos = 1
        for a in r.accepted:
            w = pos // TAU_WINDOW
            while len(self.window_rounds) <= w:
                self.window_rounds.append(0)
                self.window_tokens.append(0)
            self.window_rounds[w] += 1
            self.window_tokens[w] += a + 1
            pos += a + 1

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")

    @property
    def tau_by_window(self) -> list[float]:
        """τ of the rounds that began in each ``TAU_WINDOW``-token window of the replies (is a reply's start
        harder to draft than its middle? a short max_new_tokens measures only the start)."""
        return [n / r if r else float("nan") for n, r in zip(self.window_tokens, self.window_rounds)]

    @property
    def acceptance(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.pos_accepts, self.pos_tries)]


def draft_vocab_coverage(methods: Sequence[Method], ar_tokens: Sequence[Sequence[int]]) -> dict[str, dict]:
    """For each drafter with a reduced draft vocabulary (``draft_ids``: the target id of every draft id), the share
    of AR's T=0 tokens it can draft at all: at T=0 a draft outside it is always rejected, so this bounds the
    acceptance at every depth."""
    toks = [t for row in ar_tokens for t in row]
    out = {}
    for m in methods:
        ids = getattr(m.model, "draft_ids", None)
        if ids is None or not toks:
            continue
        vocab = set(ids.tolist())
        out[m.name] = {"size": len(vocab), "covers_ar_tokens": sum(t in vocab for t in toks) / len(toks)}
    return out


def stats_of(xs: Sequence[float]) -> dict:
    """median / min / max / spread (half the range: with a handful of repetitions a range is the honest spread)."""
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "spread": (max(xs) - min(xs)) / 2,
            "values": xs}


def lossless_single(tokens0: Mapping[str, list], names: Sequence[str], judge: Judge | None = None
                    ) -> dict[str, list[dict]]:
    """Every method's T=0 tokens against AR's, per repetition and prompt (AR also against its own first
    repetition: a nondeterministic target would make every other check moot). Each divergence is judged by
    ``judge`` (its gap against the dtype's noise, eval/bench/precision.py); without one it is a plain failure.
    ``names[0]`` is the baseline (AR), the others' reference."""
    ar = tokens0[names[0]]
    out: dict[str, list[dict]] = {n: [] for n in names}
    for name in names:
        for rep, toks in enumerate(tokens0[name]):
            ref = ar[0] if name == names[0] else ar[rep]
            for i, (a, b) in enumerate(zip(ref, toks)):
                if a != b:
                    d = judge.divergence(i, a, b) if judge is not None else {"first_diff": first_diff(a, b)}
                    out[name].append({"where": "single", "rep": rep, "prompt": i, **d})
    return out


def tps_of(single: dict, key: tuple[str, float], rep: int, idx: Sequence[int] | None = None) -> float:
    n, t = single["ntoks"][key][rep], single["times"][key][rep]
    idx = range(len(n)) if idx is None else idx
    return sum(n[i] for i in idx) / sum(t[i] for i in idx)


def paired_speedup(single: dict, key: tuple[str, float], ark: tuple[str, float], reps: range) -> dict:
    """Stall-resistant speedup: per prompt, the method's and AR's *fastest* repetition (a stall only ever adds
    time), and the median of per-(repetition, prompt) paired ratios. ``noisy`` when the repetitions' spread
    exceeds the effect being measured (|speedup - 1|): the number is then not to be trusted."""
    n_m, t_m = single["ntoks"][key], single["times"][key]
    n_a, t_a = single["ntoks"][ark], single["times"][ark]
    prompts = range(len(t_m[0]))
    best_m = [min(t_m[r][i] for r in reps) for i in prompts]
    best_a = [min(t_a[r][i] for r in reps) for i in prompts]
    min_time = (sum(n_m[0]) / sum(best_m)) / (sum(n_a[0]) / sum(best_a))
    ratios = [(n_m[r][i] / t_m[r][i]) / (n_a[r][i] / t_a[r][i]) for r in reps for i in prompts]
    per_rep = [tps_of(single, key, r) / tps_of(single, ark, r) for r in reps]
    spread = (max(per_rep) - min(per_rep)) / 2
    return {"min_time": min_time, "paired_median": statistics.median(ratios),
            "noisy": len(per_rep) > 1 and key != ark and spread > abs(min_time - 1)}


def _decode_tps(single: dict, key: tuple[str, float], rep: int) -> float:
    """Decode-phase tokens/s: the tokens after the prefill's first one over the time after the prefill."""
    n, t = single["ntoks"][key][rep], single["dtimes"][key][rep]
    return (sum(n) - len(n)) / sum(t)


def cost_model_of(pool: Pooled, costs: dict, temp: float, baseline: bool) -> dict:
    """A method's cost model at ``temp``: K̄ (drafted nodes a round), c (drafting seconds a drafted node, in AR steps;
    c_round = K̄·c, the unit for DFlash), v̄ (mean verify cost a round, in one-token forwards) and the bound."""
    if baseline:
        return dict(k_mean=0.0, c=0.0, c_round=0.0, v=1.0, bound=1.0)
    k_mean = pool.drafted / pool.rounds if pool.rounds else float("nan")
    c = pool.draft_s / costs["t_ar_step_s"][temp] / pool.drafted if pool.drafted else 0.0
    v = pool.v_units / pool.rounds if pool.rounds else float("nan")
    # r = the forward's share of AR's in-situ step; the rest (sampling, cache append, Python) is paid once a round,
    # not v times: a round costs at least K̄·c + r·v̄ + (1 − r) AR steps
    r = min(1.0, costs["t_target_s"] / costs["t_ar_step_s"][temp])
    return dict(k_mean=k_mean, c=c, c_round=k_mean * c, v=v, forward_share=r,
                bound=pool.tau / (k_mean * c + r * v + 1 - r) if pool.rounds else float("nan"))


def summaries(methods: Sequence[Method], prompts: Sequence[Prompt], s: BenchSettings, single: dict, costs: dict,
               mismatches: Mapping[str, list]) -> list[dict]:
    """One entry per (method, temperature): τ, acceptance, timings, speedup, cost model, lossless, categories."""
    reps = range(s.repetitions)
    cats: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        cats.setdefault(p.category, []).append(i)
    hf_pl = (stats_of([tps_of(single, ("hf_prompt_lookup", 0.0), r) for r in reps])
             if ("hf_prompt_lookup", 0.0) in single["times"] else None)
    runs = []
    for temp in s.temperatures:
        for m in methods:  # methods[0]: the baseline, every ratio's denominator
            key, ark = (m.name, temp), (methods[0].name, temp)
            pool = single["pools"][key]
            tok_s = stats_of([tps_of(single, key, r) for r in reps])
            e: dict[str, Any] = {
                "method": m.name, "kind": m.kind, "temperature": temp, "tau": pool.tau,
                "acceptance_by_pos": pool.acceptance, "rounds": pool.rounds,
                "tau_by_window": {"tokens": TAU_WINDOW, "tau": pool.tau_by_window, "rounds": pool.window_rounds},
                "tokens": sum(map(sum, single["ntoks"][key])) // s.repetitions,
                "time_s": stats_of([sum(t) for t in single["times"][key]]), "tokens_per_s": tok_s,
                "speedup": stats_of([tps_of(single, key, r) / tps_of(single, ark, r) for r in reps]),
                "speedup_robust": paired_speedup(single, key, ark, reps),
                # what the cost-model bound describes: rounds only (the prefill is the same forward for everyone)
                "decode_speedup": stats_of([_decode_tps(single, key, r) / _decode_tps(single, ark, r) for r in reps]),
                # seconds per repetition (all prompts); draft = propose + accept, verify = forward + accept + KV
                "draft_s": pool.draft_s / s.repetitions, "verify_s": pool.verify_s / s.repetitions,
                "prefill_s": pool.prefill_s / s.repetitions,
            }
            busy = pool.draft_s + pool.verify_s
            e["draft_frac"] = pool.draft_s / busy if busy else 0.0
            e.update(cost_model_of(pool, costs, temp, m.baseline))
            if e["speedup_robust"]["noisy"]:
                log.warning("%s T=%g: speedup %.2f ± %.2f over repetitions is noisier than the effect; the "
                            "fastest-repetition estimate is %.2f (a loaded machine? raise repetitions)", m.name, temp,
                            e["speedup"]["median"], e["speedup"]["spread"], e["speedup_robust"]["min_time"])
            e["efficiency"] = e["decode_speedup"]["median"] / e["bound"]
            # T=0: AR's tokens and every token certified; T>0: the certificate's χ² test (eval/bench/certificate.py)
            cert = single.get("certificates", {}).get(m.name, {}).get(f"{temp:g}")
            e["certificate"] = cert
            e["lossless"] = (not failures(mismatches[m.name])) if temp == 0 else (cert or {}).get("pass")
            e["vs_hf_prompt_lookup"] = tok_s["median"] / hf_pl["median"] if (temp == 0 and hf_pl) else None
            e["by_category"] = {
                cat: {"n_prompts": len(idx), "tau": single["pools"][(*key, cat)].tau,
                      "acceptance_by_pos": single["pools"][(*key, cat)].acceptance,
                      "tokens_per_s": statistics.median(tps_of(single, key, r, idx) for r in reps),
                      "speedup": statistics.median(tps_of(single, key, r, idx) / tps_of(single, ark, r, idx)
                                                   for r in reps)}
                for cat, idx in cats.items()}
            runs.append(e)
    _vs_best_free(methods, runs)
    return runs


def _vs_best_free(methods: Sequence[Method], runs: list[dict]) -> None:
    """Each entry's tokens/s over the best training-free method's at its temperature (n-gram / prompt lookup at every
    setting benchmarked: the tuned free baseline, not one default): ``vs_best_free`` and ``best_free``."""
    from models import registry

    table = registry.proposers()
    free = {m.name for m in methods if not m.baseline and m.kind in table and table[m.kind][0].source == "none"}
    for temp in {e["temperature"] for e in runs}:
        rows = [e for e in runs if e["temperature"] == temp]
        cands = [e for e in rows if e["method"] in free]
        best = max(cands, key=lambda e: e["tokens_per_s"]["median"], default=None)
        for e in rows:
            e["best_free"] = best and best["method"]
            e["vs_best_free"] = e["tokens_per_s"]["median"] / best["tokens_per_s"]["median"] if best else None
