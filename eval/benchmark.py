"""The evaluation harness: acceptance, speedup, cost-model bound, HF peers, batch crossover, one process.

Every method runs in ONE process on the SAME prompts with the same thread count, interleaved per repetition
(rep r runs AR, then every method, then the HF peers) so slow drift of a shared machine hits all of them alike;
speedups are paired ratios (method tokens/s ÷ AR tokens/s of the same repetition), reported as median and
spread over repetitions.

Measured per (method, temperature):

* τ = mean tokens per verification forward, bonus included (pooled over every round of every prompt and
  repetition); acceptance rate by draft position; draft vs verify seconds; tokens/s; speedup over AR.
* lossless: at T = 0 every method's tokens must equal AR's for every prompt and repetition (and, in the batch
  sweep, every row must equal batched AR's row). Any mismatch marks the method ``lossless: false``; the CLI
  exits non-zero.
* cost model: c = draft seconds per drafted node / the target's cost per call (AR's in-situ seconds per decode
  step); v(K) = (K+1)-token forward / 1-token forward, microbenchmarked on a cache of the mid-generation
  length; bound = τ / (K̄·c + v̄) with K̄ the mean drafted nodes per round (tree size for trees) and v̄ the
  mean of v(K_r) over rounds; efficiency = measured decode-phase speedup (prefill excluded, like the bound) /
  bound: what overheads — acceptance, KV compaction, Python — leave of the bound.

HF peers (T = 0): ``generate(prompt_lookup_num_tokens=K)`` and, when a draft model is given,
``generate(assistant_model=...)``, plus plain HF greedy ``generate`` — tokens/s, speedup vs our AR, whether
their tokens equal our AR's, and each of our methods' tokens/s relative to HF prompt lookup.

Batch sweep (chain methods; ``speculative_decode_batch`` vs ``decode_ar_batch``): tokens/s and speedup per
batch size, the crossover batch size (the first with speedup < 1, else null), and a dynamic speculation
policy: K*(B) = argmax_K E[tokens | K] · w_B(0) / (B·K·c + w_B(K)), with E from the measured per-position
acceptance and w_B(K) the measured cost of a B-row, (K+1)-token verify forward (K* = 0: speculation off),
measured against the fixed K. ``recommended_num_speculative_tokens`` (batch 1) is what train/export.py
``--results`` reads.

Results schema (``run_benchmark``'s dict; ``write_json`` turns int keys into strings and NaN into null):

    schema_version 1, created_utc, env {python, torch, transformers, threads, interop_threads, cpu_count,
        machine, processor, device, dtype[, gpu]}, target {identity()..., dtype, params},
    settings {BenchSettings fields}, prompts {source, n, categories {cat: n}, tokens {mean, min, max}, labels},
    cost_model {prefix_len, reps, t_target_s, t_ar_step_s {T: s}, verify {K: v(K)}, batch {B: {K: w_B(K)}}},
    methods {name: {kind, k, chain, checkpoint, options, lossless, mismatches [..20], n_mismatches}},
        lossless = single-sequence AND batch-sweep T=0 runs reproduced AR (AR: reproduced itself),
    skipped {name: reason},
    runs [{method, kind, temperature, tau, acceptance_by_pos [k], rounds, tokens (per repetition),
        time_s, tokens_per_s, speedup, decode_speedup: {median, min, max, spread, values}, draft_s, verify_s, prefill_s
        (per repetition), draft_frac, k_mean, c, v, bound, efficiency, lossless (T=0 single runs; null at T>0),
        vs_hf_prompt_lookup (T=0), by_category {cat: {n_prompts, tau, acceptance_by_pos, tokens_per_s, speedup}}}],
    peers {hf_greedy | hf_prompt_lookup | hf_assisted: {temperature 0, settings, tokens_per_s, speedup_vs_ar,
        matches_ar}},
    policy {chain method: {acceptance_by_pos, c, k_max, k_star {B: K*}, predicted_speedup {B: {K: s}},
        k_star_positive_b1}},
    batch null | {temperature, batch_sizes, ar_tokens_per_s {B: stats}, methods {name: {k_fixed,
        by_batch [{batch_size, k, tokens_per_s, speedup, tau, predicted_speedup, dynamic {k, predicted_speedup,
        measured_as run|fixed|ar, tokens_per_s, speedup}}], crossover_batch_size, dynamic_crossover_batch_size,
        speculation_off_from_batch_size, recommended_num_speculative_tokens {B: K*}, lossless}}},
    recommended_for, recommended_num_speculative_tokens (best K >= 1 at batch 1, for the exporter),
    recommended_num_speculative_tokens_by_batch {B: K*, 0 = off}, speculation_pays_at_batch_1,
    lossless (all methods).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from eval import verify
from eval.decode import (
    DecodeResult,
    _batch_mask,
    decode_ar,
    decode_ar_batch,
    new_cache,
    speculative_decode,
    speculative_decode_batch,
)
from models.target import FrozenTarget

log = logging.getLogger(__name__)

__all__ = [
    "KINDS",
    "CHAIN_KINDS",
    "DEFAULT_OPTIONS",
    "Prompt",
    "Method",
    "BenchSettings",
    "load_prompts",
    "build_methods",
    "measure_costs",
    "expected_tokens",
    "predicted_speedup",
    "choose_k",
    "crossover_batch_size",
    "run_benchmark",
    "all_lossless",
    "write_json",
]

KINDS = ("ar", "ngram", "draft_model", "eagle3", "eagle3_tree", "medusa", "mtp")
CHAIN_KINDS = ("ngram", "draft_model", "eagle3", "mtp")  # what speculative_decode_batch can verify
CHECKPOINT_KINDS = {"eagle3": "eagle3", "eagle3_tree": "eagle3", "medusa": "medusa", "mtp": "mtp"}
# Which method's batch-1 K* becomes the top-level recommendation (the exporter reads one number).
RECOMMEND_ORDER = ("eagle3", "mtp", "draft_model", "ngram")
# Per-kind proposer settings. Trees are sized for CPU (verify cost grows with nodes there); the EAGLE-2 paper's
# GPU setting is depth 6, top_k 10, total_tokens 60 and Medusa's default tree has 63 nodes.
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "ngram": {"k": 5, "max_ngram": 3, "min_ngram": 1},
    "draft_model": {"k": 4},
    "eagle3": {"k": 5},
    "eagle3_tree": {"depth": 5, "top_k": 4, "total_tokens": 24},
    "medusa": {"top_k": 4, "num_nodes": 24, "choices": None},
    "mtp": {"k": None},  # None = the drafter's number of modules
}


# --------------------------------------------------------------------------------------------- inputs
@dataclass
class Prompt:
    """One evaluation prompt: token ids, the category it is reported under, and where it came from."""

    ids: list[int]
    category: str = "code"
    label: str = ""


@dataclass
class Method:
    """A method under test.

    ``make(k)`` returns a fresh proposer (``k`` overrides the chain length; None = the method's own) — the
    batch engine needs one per row, and the dynamic policy other K. ``decode`` replaces
    ``speculative_decode`` for one sequence (another engine measured by the same harness; the tests use it to
    break a method on purpose). ``model`` is the module the proposer wraps (the HF draft model is also the
    assisted-generation peer's assistant).
    """

    name: str
    kind: str
    make: Callable[[int | None], Any] | None = None
    k: int | None = None  # chain length; None for AR and trees
    checkpoint: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    decode: Callable[..., DecodeResult] | None = None
    model: Any = None

    @property
    def chain(self) -> bool:
        return self.kind in CHAIN_KINDS


@dataclass
class BenchSettings:
    """What to measure; validated on construction so bad settings fail before any model is loaded."""

    max_new_tokens: int = 64
    temperatures: Sequence[float] = (0.0, 1.0)
    top_p: float = 1.0
    top_k: int = 0
    repetitions: int = 3
    warmup: int = 1
    threads: int = 0  # 0 = keep torch's current setting (recorded either way)
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)
    batch_temperature: float = 0.0
    peers: bool = True
    cost_reps: int = 5
    seed: int = 0
    stop_at_eos: bool = False  # off: every method generates exactly max_new_tokens, so tokens/s compare directly
    progress: bool = True

    def __post_init__(self) -> None:
        temps = [float(t) for t in self.temperatures]
        if not temps:
            raise ValueError("temperatures is empty; give at least one (0 = greedy)")
        for t in temps:  # eval/verify.py's own checks: the same one-line errors the engine would give
            verify.sampling_probs(torch.zeros(2), t, self.top_p, self.top_k)
        if 0.0 not in temps:
            # T = 0 is the lossless check; it always runs
            log.warning("temperatures %s has no 0: adding T=0, it is the lossless check", temps)
            temps.insert(0, 0.0)
        self.temperatures = sorted(set(temps), key=temps.index)
        self.batch_temperature = float(self.batch_temperature)
        if self.batch_temperature not in self.temperatures:
            raise ValueError(f"batch_temperature={self.batch_temperature} must be one of temperatures "
                             f"{self.temperatures} (its acceptance rates drive the dynamic policy)")
        for name in ("max_new_tokens", "repetitions", "cost_reps"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v}")
        for name in ("warmup", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v}")
        bs = [int(b) for b in self.batch_sizes]
        if any(b < 1 for b in bs) or any(b != x for b, x in zip(bs, self.batch_sizes)):
            raise ValueError(f"batch_sizes must be positive integers, got {list(self.batch_sizes)}")
        self.batch_sizes = sorted(set(bs))


def load_prompts(tokenizer, n: int, prompt_tokens: int, source: str | Path | None = None) -> list[Prompt]:
    """Evaluation prompts.

    ``source`` None: held-out stdlib prefixes of ``prompt_tokens`` tokens (``data.corpus.heldout_prompts``,
    category "code"). Otherwise a conversation ``.jsonl`` (MT-bench / Spec-Bench style): each row has an
    optional ``category`` and either ``turns`` (list of user strings; the first turn is used) or
    ``messages`` (OpenAI style; everything before the first assistant message is used). Rows are rendered
    with the tokenizer's chat template plus the generation prompt; prompts longer than ``prompt_tokens``
    are skipped (with a warning); ``n`` prompts are taken round-robin over categories, in file order.
    """
    if n < 1 or prompt_tokens < 1:
        raise ValueError(f"n_prompts and prompt_tokens must be >= 1, got {n} and {prompt_tokens}")
    if source is None:
        from data.corpus import heldout_prompts

        rows = heldout_prompts(tokenizer, n, prompt_tokens)
        if not rows:
            raise ValueError(f"no held-out prompt has {prompt_tokens} tokens; lower prompt_tokens")
        return [Prompt(list(r["input_ids"]), "code", f"{r['path']}:{r['line']}") for r in rows]
    from data.chat import render_chat

    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(source)!r} does not exist")
    by_cat: dict[str, list[Prompt]] = {}
    too_long = 0
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i + 1}: not valid JSON ({e.msg})") from None
            messages = _prompt_messages(row, f"{path} line {i + 1}")
            ids = tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
            if len(ids) > prompt_tokens:
                too_long += 1
                continue
            cat = str(row.get("category") or "default")
            label = str(row.get("question_id", row.get("id", i)))
            by_cat.setdefault(cat, []).append(Prompt(list(ids), cat, label))
    if too_long:
        log.warning("%s: skipped %d prompts longer than prompt_tokens=%d", path, too_long, prompt_tokens)
    out: list[Prompt] = []
    queues = [list(v) for v in by_cat.values()]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    if not out:
        raise ValueError(f"{path}: no usable prompts (of <= prompt_tokens={prompt_tokens} tokens)")
    return out


def _prompt_messages(row: Any, where: str) -> list[dict]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object")
    turns = row.get("turns")
    if turns is not None:
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        # only the first turn: later turns would need the model's own answer to turn 1 in the context
        return [{"role": "user", "content": turns[0]}]
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: needs 'turns' (list of strings) or 'messages' (list of role/content)")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{j}] needs string 'role' and 'content'")
        if m["role"] == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise ValueError(f"{where}: no user message before the first assistant message")
    return out


def build_methods(
    target: FrozenTarget,
    names: Sequence[str],
    checkpoints: Mapping[str, str | None] | None = None,
    draft_model: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[Method], dict[str, str]]:
    """The methods named in ``names`` (``KINDS``), AR first. A method whose checkpoint (or draft model) is not
    given or not on disk is skipped; returns (methods, {skipped name: reason}). A checkpoint trained for
    another target, or of another method, raises a one-line ValueError (train/build.py ``load_drafter``)."""
    from eval import proposers as P
    from train.build import load_drafter

    checkpoints = dict(checkpoints or {})
    unknown = [n for n in names if n not in KINDS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; use any of {list(KINDS)}")
    opts = {k: {**v, **dict((options or {}).get(k) or {})} for k, v in DEFAULT_OPTIONS.items()}
    bad = [k for k in (options or {}) if k not in DEFAULT_OPTIONS]
    if bad:
        raise ValueError(f"options for unknown method(s) {bad}; known: {sorted(DEFAULT_OPTIONS)}")
    methods = [Method("ar", "ar")]
    skipped: dict[str, str] = {}
    drafters: dict[str, tuple[Any, dict]] = {}
    for name in dict.fromkeys(names):  # ordered, no duplicates
        if name == "ar":
            continue
        o = opts[name]
        if name == "ngram":
            def make(k, o=o):
                return P.NGramProposer(k=k or o["k"], max_ngram=o["max_ngram"], min_ngram=o["min_ngram"])

            methods.append(Method(name, name, make, k=int(o["k"]), options=o))
            continue
        if name == "draft_model":
            if not draft_model:
                skipped[name] = "no draft_model given (a small causal LM sharing the target's tokenizer)"
                continue
            from models.target import load_causal_lm

            model, tok = load_causal_lm(draft_model, dtype=target.model.dtype, device=str(target.model.device))
            P.DraftModelProposer(model, k=o["k"], target=target, tokenizer=tok)  # refuses another tokenizer now

            def make(k, o=o, model=model):
                return P.DraftModelProposer(model, k=k or o["k"], target=target)

            methods.append(Method(name, name, make, k=int(o["k"]), checkpoint=str(draft_model), options=o,
                                  model=model))
            continue
        path = checkpoints.get(CHECKPOINT_KINDS[name])
        if not path or not (Path(path) / "model.safetensors").exists():
            skipped[name] = f"no checkpoint at {path!r} (train it: python -m train +recipe={CHECKPOINT_KINDS[name]})"
            continue
        if path not in drafters:
            drafters[path] = load_drafter(path, target)  # raises for a drafter trained on another target
        drafter, meta = drafters[path]
        if meta["method"] != CHECKPOINT_KINDS[name]:
            raise ValueError(f"{path} is a {meta['method']} checkpoint, not {CHECKPOINT_KINDS[name]}; "
                             f"fix checkpoints.{CHECKPOINT_KINDS[name]}")
        if name == "eagle3":
            def make(k, o=o, d=drafter):
                return P.Eagle3ChainProposer(d, k=k or o["k"])

            methods.append(Method(name, name, make, k=int(o["k"]), checkpoint=str(path), options=o, model=drafter))
        elif name == "eagle3_tree":
            def make(k, o=o, d=drafter):
                return P.Eagle3TreeProposer(d, depth=o["depth"], top_k=o["top_k"], total_tokens=o["total_tokens"])

            make(None)  # one-line errors for bad tree settings now, not mid-run
            methods.append(Method(name, name, make, checkpoint=str(path), options=o, model=drafter))
        elif name == "medusa":
            choices = o.get("choices")
            if choices is None:  # the tree saved with the checkpoint (held-out rank accuracies), resized
                from models.medusa import load_static_tree, tree_capacity

                choices = load_static_tree(path, o.get("num_nodes"))
            if choices is None:
                heads = drafter.cfg.num_heads
                n_nodes = min(int(o["num_nodes"]), tree_capacity(heads, int(o["top_k"])))
                log.warning("%s has no medusa_choices.json: using a made-up-accuracy tree of %d nodes", path, n_nodes)
                choices = P.default_medusa_choices(heads, top_k=int(o["top_k"]), num_nodes=n_nodes)

            def make(k, d=drafter, choices=choices):
                return P.MedusaProposer(d, choices=choices)

            make(None)
            methods.append(Method(name, name, make, checkpoint=str(path), options={**o, "num_nodes": len(choices)},
                                  model=drafter))
        elif name == "mtp":
            k0 = int(o["k"] or drafter.cfg.num_modules)

            def make(k, d=drafter, k0=k0):
                return P.MTPProposer(d, k=k or k0)

            methods.append(Method(name, name, make, k=k0, checkpoint=str(path), options={**o, "k": k0},
                                  model=drafter))
    for name, why in skipped.items():
        log.warning("skipping %s: %s", name, why)
    return methods, skipped


# --------------------------------------------------------------------------------------------- timing
def _now(device: torch.device) -> float:
    if device.type == "cuda":  # time device work, not kernel launches
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
        cache = new_cache(target)
        target(torch.randint(vocab, (b, prefix_len), generator=g).to(device), cache=cache, use_cache=True,
               logits_to_keep=1)
        out = {}
        for w in sorted(set(ws)):
            x = torch.randint(vocab, (b, w), generator=g).to(device)
            pos = torch.arange(prefix_len, prefix_len + w, device=device)[None].expand(b, -1)
            # the batched engine always passes its 4D mask (eval/decode.py); B=1 chains use plain causal attention
            mask = None if b == 1 else _batch_mask(torch.full((b,), prefix_len, device=device), prefix_len, w,
                                                   target.model.dtype)
            samples = []
            for r in range(reps + 1):
                t = _now(device)
                target(x, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
                dt = _now(device) - t
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


def _interp(table: Mapping[int, float], x: float) -> float:
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


# --------------------------------------------------------------------------------------------- policy
def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E[tokens per round] of a K-token chain: 1 + Σ_{j≤K} Π_{i≤j} α_i (α_i = P(accept depth i | reached it);
    positions never measured — NaN or beyond the list — count as 0)."""
    total, run = 1.0, 1.0
    for j in range(k):
        a = acceptance[j] if j < len(acceptance) else 0.0
        a = 0.0 if a is None or math.isnan(a) else min(max(float(a), 0.0), 1.0)
        run *= a
        total += run
    return total


def predicted_speedup(acceptance: Sequence[float], c: float, w: Mapping[int, float], batch_size: int, k: int) -> float:
    """Throughput of K-token chains over batched AR at batch B (cost model; c per drafted token, w in units of
    one single-token forward):
    E(K) · w_B(0) / (B·K·c + w_B(K)); the B proposers draft one after another, hence B·K·c. K = 0 → 1."""
    if k == 0:
        return 1.0
    return expected_tokens(acceptance, k) * _interp(w, 0) / (batch_size * k * c + _interp(w, k))


def choose_k(
    acceptance: Sequence[float], c: float, w: Mapping[int, float], batch_size: int, k_max: int, k_min: int = 0
) -> tuple[int, dict[int, float]]:
    """K* = argmax over K in k_min..k_max of ``predicted_speedup`` (K = 0: speculation off; ties → smaller K).
    Returns (K*, {K: predicted speedup})."""
    pred = {k: predicted_speedup(acceptance, c, w, batch_size, k) for k in range(k_min, k_max + 1)}
    best = max(pred, key=lambda k: (pred[k], -k))
    return best, pred


def crossover_batch_size(batch_sizes: Sequence[int], speedups: Sequence[float]) -> int | None:
    """The first batch size (ascending) whose speedup is below 1 — where speculation stops paying — or None."""
    for b, s in sorted(zip(batch_sizes, speedups)):
        if s < 1.0:
            return int(b)
    return None


# --------------------------------------------------------------------------------------------- aggregation
@dataclass
class _Pool:
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

    def add(self, r: DecodeResult, v: Mapping[int, float] | None) -> None:
        self.rounds += r.rounds
        self.accepted += sum(r.accepted)
        self.drafted += sum(r.drafted)
        if v is not None:
            self.v_units += sum(_interp(v, k) for k in r.drafted)
        for i, (t, a) in enumerate(zip(r.pos_tries, r.pos_accepts)):
            if i >= len(self.pos_tries):
                self.pos_tries.append(0)
                self.pos_accepts.append(0)
            self.pos_tries[i] += t
            self.pos_accepts[i] += a
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        self.prefill_s += r.prefill_s

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")

    @property
    def acceptance(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.pos_accepts, self.pos_tries)]


def _stats(xs: Sequence[float]) -> dict:
    """median / min / max / spread (half the range: with a handful of repetitions a range is the honest spread)."""
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "spread": (max(xs) - min(xs)) / 2,
            "values": xs}


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# --------------------------------------------------------------------------------------------- the run
def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _decode_one(target: FrozenTarget, m: Method, proposer: Any, ids: Tensor, s: BenchSettings, temperature: float,
                gen: torch.Generator | None, eos: int | None) -> DecodeResult:
    if m.kind == "ar":
        return decode_ar(target, ids, s.max_new_tokens, temperature, s.top_p, s.top_k, gen, eos)
    fn = m.decode or speculative_decode
    return fn(target, proposer, ids, s.max_new_tokens, temperature, s.top_p, s.top_k, gen, eos)


def _hf_generate(target: FrozenTarget, ids: Tensor, s: BenchSettings, eos: int | None,
                 extra: Mapping[str, Any]) -> tuple[list[int], float]:
    """One greedy HF ``generate`` on the raw target (``extra``: prompt lookup / assistant settings)."""
    from transformers import GenerationConfig

    cfg = target.model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos if eos is not None else 0)
    gc = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                          **{k: v for k, v in extra.items() if k != "assistant_model"})
    device = ids.device
    t = _now(device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                assistant_model=extra.get("assistant_model"))
    dt = _now(device) - t
    return out[0, ids.shape[1]:].tolist(), dt


def _env(threads: int, device: torch.device, target: FrozenTarget) -> dict:
    import transformers

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "threads": threads, "interop_threads": torch.get_num_interop_threads(), "cpu_count": os.cpu_count(),
           "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
           "device": str(device), "dtype": str(target.model.dtype).replace("torch.", "")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
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
    if not methods or methods[0].kind != "ar":
        raise ValueError("methods must start with the AR baseline (build_methods puts it first)")
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


def _run(target: FrozenTarget, methods: Sequence[Method], prompts: Sequence[Prompt], s: BenchSettings,
         skipped: Mapping[str, str] | None, prompt_source: str | None) -> dict:
    device = target.model.device
    eos = target.model.config.eos_token_id if s.stop_at_eos else None
    eos = eos[0] if isinstance(eos, list) else eos
    ids = [torch.tensor([p.ids], dtype=torch.long, device=device) for p in prompts]
    spec = [m for m in methods if m.kind != "ar"]
    chains = [m for m in spec if m.chain]

    # ---- cost tables: t1, v(K) up to the largest tree, w_B(K) up to the largest chain
    k_chain = max([int(m.k) for m in chains] or [0])
    trees = [_tree_size(m) for m in spec if not m.chain]
    widths = [*range(1, k_chain + 2), *(n + 1 for n in trees),
              *(w for w in (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if w <= max(trees or [0]))]
    prefix_len = round(statistics.mean(len(p.ids) for p in prompts)) + s.max_new_tokens // 2  # mid-generation
    costs = measure_costs(target, prefix_len, widths, sorted({1, *s.batch_sizes}), k_chain, s.cost_reps, s.seed)

    single = _single_runs(target, methods, ids, prompts, s, costs["verify"], eos)
    # the target's real cost per call: AR's in-situ seconds per decode step (forward + sampling), per temperature;
    # c is measured in these units, v(K) and w_B(K) as forward-time ratios from the microbenchmark
    costs["t_ar_step_s"] = {t: single["pools"][("ar", t)].verify_s / max(single["pools"][("ar", t)].rounds, 1)
                            for t in s.temperatures}
    mismatches = _lossless_single(single["tokens0"], [m.name for m in methods])
    runs = _summaries(methods, prompts, s, single, costs, mismatches)

    # ---- dynamic policy (per chain method: acceptance and c from the batch temperature's B=1 runs)
    policy = {}
    for m in chains:
        pool = single["pools"][(m.name, s.batch_temperature)]
        c = pool.draft_s / costs["t_ar_step_s"][s.batch_temperature] / pool.drafted if pool.drafted else 0.0
        acc = pool.acceptance
        by_b = {b: choose_k(acc, c, costs["batch"][b], b, int(m.k)) for b in sorted(costs["batch"])}
        policy[m.name] = {"acceptance_by_pos": acc, "c": c, "k_max": int(m.k),
                          "k_star": {b: k for b, (k, _) in by_b.items()},
                          "predicted_speedup": {b: pred for b, (_, pred) in by_b.items()},
                          "k_star_positive_b1": choose_k(acc, c, costs["batch"][1], 1, int(m.k), k_min=1)[0]}
    batch = _batch_sweep(target, chains, ids, s, policy, eos, mismatches) if s.batch_sizes and chains else None

    results: dict[str, Any] = {
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
        "methods": {m.name: {"kind": m.kind, "k": m.k, "chain": m.chain, "checkpoint": m.checkpoint,
                             "options": m.options, "lossless": not mismatches[m.name],
                             "mismatches": mismatches[m.name][:20], "n_mismatches": len(mismatches[m.name])}
                    for m in methods},
        "skipped": dict(skipped or {}),
        "runs": runs,
        "peers": _peer_summaries(single, s),
        "policy": policy,
        "batch": batch,
    }
    pick = next((m.name for kind in RECOMMEND_ORDER for m in chains if m.kind == kind), None)
    if pick is not None:
        pol = policy[pick]
        results["recommended_for"] = pick
        # the exporter needs a positive K: the best K >= 1 at batch 1, even where K* = 0 (flagged below)
        results["recommended_num_speculative_tokens"] = int(pol["k_star_positive_b1"])
        results["recommended_num_speculative_tokens_by_batch"] = dict(pol["k_star"])
        results["speculation_pays_at_batch_1"] = pol["k_star"][1] > 0
    results["lossless"] = all(v["lossless"] for v in results["methods"].values())
    return results


def _single_runs(target: FrozenTarget, methods: Sequence[Method], ids: Sequence[Tensor], prompts: Sequence[Prompt],
                 s: BenchSettings, v_table: Mapping[int, float], eos: int | None) -> dict:
    """Every method (then the HF peers at T=0) on every prompt, interleaved per repetition."""
    device = ids[0].device
    peers = _peers(methods) if s.peers else []
    proposers = {m.name: (m.make(None) if m.make else None) for m in methods}
    pools: dict[tuple, _Pool] = {}  # (name, T) and (name, T, category)
    times: dict[tuple[str, float], list[list[float]]] = {}  # [rep][prompt] seconds
    dtimes: dict[tuple[str, float], list[list[float]]] = {}  # the same without prefill (decode phase)
    ntoks: dict[tuple[str, float], list[list[int]]] = {}
    tokens0: dict[str, list[list[list[int]]]] = {}  # T=0 tokens [rep][prompt]
    units = sum(len(methods) + (len(peers) if t == 0 else 0) for t in s.temperatures) * s.repetitions * len(ids)
    bar = tqdm(total=units, desc="decode", disable=not s.progress, leave=False)
    for temp in s.temperatures:
        for m in methods:  # warmup: first-call allocations and lazy init stay out of the timings
            for _ in range(s.warmup):
                _decode_one(target, m, proposers[m.name], ids[0], s, temp, _generator(device, s.seed), eos)
        if temp == 0:
            for _, extra in peers:
                for _ in range(s.warmup):
                    _hf_generate(target, ids[0], s, eos, extra)
        for rep in range(s.repetitions):
            for m in methods:
                key = (m.name, temp)
                t_rep, d_rep, n_rep, tok_rep = [], [], [], []
                for i, x in enumerate(ids):
                    # same seed for every method at a given (rep, prompt); T=0 needs none
                    gen = None if temp == 0 else _generator(device, s.seed + 7919 * rep + i)
                    r = _decode_one(target, m, proposers[m.name], x, s, temp, gen, eos)
                    v = v_table if m.kind != "ar" else None
                    pools.setdefault(key, _Pool()).add(r, v)
                    pools.setdefault((*key, prompts[i].category), _Pool()).add(r, v)
                    t_rep.append(r.total_s)
                    d_rep.append(r.total_s - r.prefill_s)
                    n_rep.append(len(r.tokens))
                    tok_rep.append(list(r.tokens))
                    bar.update()
                times.setdefault(key, []).append(t_rep)
                dtimes.setdefault(key, []).append(d_rep)
                ntoks.setdefault(key, []).append(n_rep)
                if temp == 0:
                    tokens0.setdefault(m.name, []).append(tok_rep)
            if temp == 0:
                for name, extra in peers:
                    t_rep, n_rep, tok_rep = [], [], []
                    for x in ids:
                        toks, dt = _hf_generate(target, x, s, eos, extra)
                        t_rep.append(dt)
                        n_rep.append(len(toks))
                        tok_rep.append(toks)
                        bar.update()
                    times.setdefault((name, 0.0), []).append(t_rep)
                    ntoks.setdefault((name, 0.0), []).append(n_rep)
                    tokens0.setdefault(name, []).append(tok_rep)
    bar.close()
    return {"pools": pools, "times": times, "dtimes": dtimes, "ntoks": ntoks, "tokens0": tokens0, "peers": peers}


def _lossless_single(tokens0: Mapping[str, list], names: Sequence[str]) -> dict[str, list[dict]]:
    """Every method's T=0 tokens against AR's, per repetition and prompt (AR also against its own first
    repetition: a nondeterministic target would make every other check moot)."""
    ar = tokens0["ar"]
    out: dict[str, list[dict]] = {n: [] for n in names}
    for name in names:
        for rep, toks in enumerate(tokens0[name]):
            ref = ar[0] if name == "ar" else ar[rep]
            for i, (a, b) in enumerate(zip(ref, toks)):
                if a != b:
                    out[name].append({"where": "single", "rep": rep, "prompt": i, "first_diff": _first_diff(a, b)})
    return out


def _tps(single: dict, key: tuple[str, float], rep: int, idx: Sequence[int] | None = None) -> float:
    n, t = single["ntoks"][key][rep], single["times"][key][rep]
    idx = range(len(n)) if idx is None else idx
    return sum(n[i] for i in idx) / sum(t[i] for i in idx)


def _decode_tps(single: dict, key: tuple[str, float], rep: int) -> float:
    """Decode-phase tokens/s: the tokens after the prefill's first one over the time after the prefill."""
    n, t = single["ntoks"][key][rep], single["dtimes"][key][rep]
    return (sum(n) - len(n)) / sum(t)


def _summaries(methods: Sequence[Method], prompts: Sequence[Prompt], s: BenchSettings, single: dict, costs: dict,
               mismatches: Mapping[str, list]) -> list[dict]:
    """One entry per (method, temperature): τ, acceptance, timings, speedup, cost model, lossless, categories."""
    reps = range(s.repetitions)
    cats: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        cats.setdefault(p.category, []).append(i)
    hf_pl = (_stats([_tps(single, ("hf_prompt_lookup", 0.0), r) for r in reps])
             if ("hf_prompt_lookup", 0.0) in single["times"] else None)
    runs = []
    for temp in s.temperatures:
        for m in methods:
            key, ark = (m.name, temp), ("ar", temp)
            pool = single["pools"][key]
            tok_s = _stats([_tps(single, key, r) for r in reps])
            e: dict[str, Any] = {
                "method": m.name, "kind": m.kind, "temperature": temp, "tau": pool.tau,
                "acceptance_by_pos": pool.acceptance, "rounds": pool.rounds,
                "tokens": sum(map(sum, single["ntoks"][key])) // s.repetitions,
                "time_s": _stats([sum(t) for t in single["times"][key]]), "tokens_per_s": tok_s,
                "speedup": _stats([_tps(single, key, r) / _tps(single, ark, r) for r in reps]),
                # what the cost-model bound describes: rounds only (the prefill is the same forward for everyone)
                "decode_speedup": _stats([_decode_tps(single, key, r) / _decode_tps(single, ark, r) for r in reps]),
                # seconds per repetition (all prompts); draft = propose + accept, verify = forward + accept + KV
                "draft_s": pool.draft_s / s.repetitions, "verify_s": pool.verify_s / s.repetitions,
                "prefill_s": pool.prefill_s / s.repetitions,
            }
            busy = pool.draft_s + pool.verify_s
            e["draft_frac"] = pool.draft_s / busy if busy else 0.0
            if m.kind == "ar":
                e.update(k_mean=0.0, c=0.0, v=1.0, bound=1.0)
            else:
                k_mean = pool.drafted / pool.rounds if pool.rounds else float("nan")
                c = pool.draft_s / costs["t_ar_step_s"][temp] / pool.drafted if pool.drafted else 0.0
                v = pool.v_units / pool.rounds if pool.rounds else float("nan")
                e.update(k_mean=k_mean, c=c, v=v, bound=pool.tau / (k_mean * c + v) if pool.rounds else float("nan"))
            e["efficiency"] = e["decode_speedup"]["median"] / e["bound"]
            e["lossless"] = (not mismatches[m.name]) if temp == 0 else None
            e["vs_hf_prompt_lookup"] = tok_s["median"] / hf_pl["median"] if (temp == 0 and hf_pl) else None
            e["by_category"] = {
                cat: {"n_prompts": len(idx), "tau": single["pools"][(*key, cat)].tau,
                      "acceptance_by_pos": single["pools"][(*key, cat)].acceptance,
                      "tokens_per_s": statistics.median(_tps(single, key, r, idx) for r in reps),
                      "speedup": statistics.median(_tps(single, key, r, idx) / _tps(single, ark, r, idx) for r in reps)}
                for cat, idx in cats.items()}
            runs.append(e)
    return runs


def _peers(methods: Sequence[Method]) -> list[tuple[str, dict]]:
    """HF peers: plain greedy generate, prompt lookup with our n-gram settings, assisted generation with our
    draft model (HF's own num_assistant_tokens schedule: what a user of generate() gets)."""
    ng = next((m for m in methods if m.kind == "ngram"), None)
    o = ng.options if ng else DEFAULT_OPTIONS["ngram"]
    lookup = {"prompt_lookup_num_tokens": int(o["k"]), "max_matching_ngram_size": int(o["max_ngram"])}
    peers = [("hf_greedy", {}), ("hf_prompt_lookup", lookup)]
    dm = next((m for m in methods if m.kind == "draft_model"), None)
    if dm is not None:
        peers.append(("hf_assisted", {"assistant_model": dm.model}))
    return peers


def _peer_summaries(single: dict, s: BenchSettings) -> dict:
    reps = range(s.repetitions)
    out = {}
    ar0 = single["tokens0"]["ar"]
    for name, extra in single["peers"]:
        key = (name, 0.0)
        out[name] = {
            "temperature": 0.0,
            "settings": {k: (v if k != "assistant_model" else getattr(v.config, "_name_or_path", "") or "draft_model")
                         for k, v in extra.items()},
            "tokens_per_s": _stats([_tps(single, key, r) for r in reps]),
            "speedup_vs_ar": _stats([_tps(single, key, r) / _tps(single, ("ar", 0.0), r) for r in reps]),
            "matches_ar": all(a == b for rep, toks in enumerate(single["tokens0"][name])
                              for a, b in zip(ar0[rep], toks)),
        }
    return out


def _batch_sweep(target: FrozenTarget, chains: Sequence[Method], ids: Sequence[Tensor], s: BenchSettings,
                 policy: Mapping[str, dict], eos: int | None, mismatches: dict[str, list]) -> dict:
    """``speculative_decode_batch`` (fixed K and the policy's K*) vs ``decode_ar_batch`` per batch size.
    Rows cycle through the prompts; every run at T=0 must reproduce batched AR row for row."""
    device = ids[0].device
    temp = s.batch_temperature
    reps = range(s.repetitions)
    ar_tps: dict[int, list[float]] = {}
    per: dict[str, list[dict]] = {m.name: [] for m in chains}
    n_runs = sum(1 + sum(1 + (policy[m.name]["k_star"][b] not in (0, m.k)) for m in chains) for b in s.batch_sizes)
    bar = tqdm(total=n_runs * s.repetitions, desc="batch", disable=not s.progress, leave=False)

    def one(b: int, m: Method | None, k: int | None, rep: int | None) -> list[DecodeResult]:
        rows = [ids[i % len(ids)][0] for i in range(b)]
        gen = None if temp == 0 else _generator(device, s.seed + 104729 * (rep or 0) + b)
        if m is None:
            return decode_ar_batch(target, rows, s.max_new_tokens, temp, s.top_p, s.top_k, gen, eos)
        return speculative_decode_batch(target, [m.make(k) for _ in range(b)], rows, s.max_new_tokens, temp,
                                        s.top_p, s.top_k, gen, eos)

    def tps(res: list[DecodeResult]) -> float:
        return sum(len(r.tokens) for r in res) / res[0].total_s  # timings are the batch's, shared by its rows

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
        pools: dict[str, _Pool] = {}
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
                    for r in res:
                        pools.setdefault(m.name, _Pool()).add(r, None)
                if temp == 0:
                    for row, (a, r) in enumerate(zip(ar_res, res)):
                        if a.tokens != r.tokens:
                            mismatches[m.name].append({"where": "batch", "batch_size": b, "k": k, "rep": rep,
                                                       "row": row, "first_diff": _first_diff(a.tokens, r.tokens)})
        ar_b = ar_tps[b]
        for m in chains:
            pol = policy[m.name]
            ks = pol["k_star"][b]
            fixed = measured[(m.name, "fixed")]
            dyn_src = "run" if ks not in (0, m.k) else ("ar" if ks == 0 else "fixed")
            dyn = {"run": measured.get((m.name, "dynamic")), "ar": ar_b, "fixed": fixed}[dyn_src]
            per[m.name].append({
                "batch_size": b, "k": int(m.k), "tokens_per_s": _stats(fixed),
                "speedup": _stats([f / a for f, a in zip(fixed, ar_b)]), "tau": pools[m.name].tau,
                "predicted_speedup": pol["predicted_speedup"][b][int(m.k)],
                "dynamic": {"k": ks, "predicted_speedup": pol["predicted_speedup"][b][ks], "measured_as": dyn_src,
                            "tokens_per_s": _stats(dyn), "speedup": _stats([d / a for d, a in zip(dyn, ar_b)])},
            })
    bar.close()
    out: dict[str, Any] = {"temperature": temp, "batch_sizes": list(s.batch_sizes),
                           "ar_tokens_per_s": {b: _stats(v) for b, v in ar_tps.items()}, "methods": {}}
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


def _tree_size(m: Method) -> int:
    if m.kind == "eagle3_tree":
        return int(m.options["total_tokens"])
    if m.kind == "medusa":
        return int(m.options["num_nodes"])
    return int(m.k or 1)


def all_lossless(results: Mapping[str, Any]) -> bool:
    """True when every method kept AR's tokens at T=0 (the CLI's exit status)."""
    return all(m.get("lossless", False) is True for m in results.get("methods", {}).values())


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(results: Mapping[str, Any], path: str | Path) -> Path:
    """Strict JSON (NaN/inf → null, int keys → strings), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(results), indent=1, allow_nan=False))
    tmp.replace(path)
    return path

