"""Results JSON (eval/bench/benchmark.py) → a markdown report, PNG plots and a console summary.

    python -m eval.bench.report bench/results/results.json [--out DIR]    # re-render an existing results file

Files written: ``results.md``; ``tau_speedup.png`` (τ and speedup per method and temperature, speedup with its
min–max over repetitions and the cost-model bound), ``acceptance.png`` (acceptance rate by draft position) and,
when the batch sweep ran, ``batch_speedup.png`` (speedup vs batch size, fixed K and the dynamic policy).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eval.bench import training

__all__ = ["normalize", "markdown", "console_summary", "plot", "write_report", "PLOTS"]

PLOTS = ("tau_speedup.png", "acceptance.png", "batch_speedup.png", "learning_curve.png")


def normalize(results: Mapping[str, Any]) -> dict:
    """The JSON view of a results dict (string keys, NaN → None), so in-memory and on-disk results render alike."""
    from eval.bench.benchmark import jsonable

    return json.loads(json.dumps(jsonable(results)))


def _f(x: Any, nd: int = 2, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    return f"{x:.{nd}f}{suffix}"


def _temp(t: float) -> str:
    return f"{t:g}"


def is_baseline(entry: Mapping[str, Any]) -> bool:
    """A results row of the baseline (AR: no drafts, nothing to report per draft position or round); its ``kind``
    is the registry's baseline proposer's name, in old result files too."""
    from models import registry

    return entry.get("kind") == registry.baseline().name


def markdown(results: Mapping[str, Any]) -> str:
    """The report: headline table (method, T, τ, speedup ± spread, tokens/s, efficiency vs bound, lossless), then
    acceptance by position, HF peers, batch sweep and recommendation, categories, cost model — a function per
    section below, in this order."""
    r = normalize(results)
    lines = _header_md(r)
    lines += _divergences_md(r)
    lines += _results_md(r)
    lines += _acceptance_md(r)
    lines += _peers_md(r)
    lines += _batch_md(r)
    lines += _categories_md(r)
    lines += _cost_md(r)
    lines += training.markdown(r.get("training") or {})
    if r.get("skipped"):
        lines += ["", "## Skipped", ""] + [f"- {n}: {why}" for n, why in r["skipped"].items()]
    return "\n".join(lines) + "\n"


def _header_md(r: dict) -> list[str]:
    """Title, what was measured on what, and the lossless verdict."""
    s, tgt, env = r["settings"], r["target"], r["env"]
    lines = ["# Speculative decoding benchmark", ""]
    q = r.get("quiet") or {}
    if q.get("contended"):  # eval/bench/quiet.py: a run that shared the CPU is not a result to quote
        lines += ["**Contended run: its timings are not results to quote.** " + "; ".join(q["reasons"]) + ".", ""]
    pr = r["prompts"]
    lines.append(f"Target `{tgt.get('name_or_path')}` ({tgt.get('params', 0) / 1e6:.2f} M params, {tgt.get('dtype')}), "
                 f"{pr['n']} prompts from {pr['source']} (mean {pr['tokens']['mean']:.0f} tokens), "
                 f"{s['max_new_tokens']} new tokens, {s['repetitions']} repetitions after {s['warmup']} "
                 f"warmup, torch {env['torch']} on {env['device']} with {env['threads']} threads, {r['created_utc']}.")
    if tgt.get("gguf"):  # models/core/gguf.py: say what the lossless claim is against
        g = tgt["gguf"]
        lines += ["", f"The target *is* `{g['file']}` dequantized to {g['dequantized_to']} (sha256 "
                      f"`{g['sha256'][:16]}…`): losslessness is against that model, not the checkpoint the GGUF was "
                      "quantized from."]
    lines += _bandwidth_md(r) + _decode_step_md(r) + _dtype_probe_md(r)
    lines.append("")
    bad = [n for n, m in r["methods"].items() if not m["lossless"]]
    tolerated = sum(m.get("n_tolerated", 0) for m in r["methods"].values())
    lines.append("**Lossless: every method reproduced AR's tokens at T=0.**" if not bad and not tolerated else
                 f"**Lossless within {r['precision']['dtype']} noise: every method reproduced AR's tokens at T=0 "
                 f"except {tolerated} divergence(s) at near-ties the measured noise explains (listed below).**"
                 if not bad else
                 f"**LOSSLESS CHECK FAILED for {', '.join(bad)}** (tokens differ from AR at T=0; see results.json "
                 "`methods.*.mismatches`).")
    return lines


def _bandwidth_md(r: dict) -> list[str]:
    """AR's tokens/s against the memory-bandwidth ceiling of plain decoding on this machine (models/core/kernels.py
    ``bandwidth_bound``): how much faster any AR could be here, so the baseline every speedup divides by is judged."""
    bw = r["env"].get("bandwidth")
    ar = [e for e in r["runs"] if is_baseline(e) and e["temperature"] == 0]
    if not bw or not ar:
        return []
    tps, bound = ar[0]["tokens_per_s"]["median"], bw["ar_tokens_per_s_bound"]
    return ["", f"Plain decoding (AR, T=0) ran at {tps:.1f} tokens/s end to end. Reading the target's "
                f"{bw['weight_MB']:.0f} MB of weights once per token at the measured {bw['read_GB_per_s']:.1f} GB/s "
                f"({bw['threads']} threads) allows {bound:.0f} tokens/s: AR ran at {100 * tps / bound:.0f} % of "
                "that bandwidth bound."]


# the kernels a compiled step's linears raced (eval/bench/decode_step.py): what results.md calls them, their key
LINEAR_KINDS = (("packed oneDNN GEMM", "compiled_ms"), ("inductor's", "compiled_plain_ms"),
                ("streamed bf16 GEMV", "compiled_gemv_ms"))


def _decode_step_md(r: dict) -> list[str]:
    """Which step AR and every method decoded with (eval/bench/decode_step.py), and what decided it."""
    d = r["env"].get("decode_step")
    if not d:
        return []
    line = f"Decoding step: **{d['chosen']}**"
    if d.get("mode"):
        line += f" (`decode_step={d['mode']}`"
        linears = d.get("linears", "packed")
        compiled = d.get("compiled_ms") if linears == "packed" else d.get(f"compiled_{linears}_ms")
        if "eager_ms" in d:
            line += (f"; one-token step {compiled:.1f} ms compiled vs {d['eager_ms']:.1f} ms eager, median of "
                     f"{d['rounds']} interleaved rounds")
        if "linears" in d:
            raced = [(name, d.get(key)) for name, key in LINEAR_KINDS if d.get(key) is not None]
            line += f"; its linears {linears} (" + ", ".join(f"{name} {ms:.1f} ms" for name, ms in raced) + ")"
        line += f"; {d['why']}" if d.get("why") else ""
        line += ")"
    if d.get("compile_s"):
        line += ". Compile seconds per trace: " + ", ".join(f"{k} {v:.0f}" for k, v in d["compile_s"].items())
    return ["", line + "."]


def _dtype_probe_md(r: dict) -> list[str]:
    """target.dtype=auto: the target's one-row forward at widths 1..K+1 in each dtype on this machine (t(w)/t(1),
    t(1) in ms) and the dtype it chose: the fastest one-token step, plain decoding's."""
    p = r["env"].get("dtype_probe")
    if not p:
        return []
    widths = sorted({int(w) for d in p["dtypes"].values() for w in d["t_over_t1"]})
    lines = ["", f"`target.dtype=auto` chose **{p['chosen']}** (CPU flags {', '.join(p['machine']['flags'])}; "
                 f"{p['threads']} thread(s), {p['prefix_len']}-token cache): t(w)/t(1) for a w-token forward,", "",
             "| dtype | t(1) ms | " + " | ".join(f"w={w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for name, d in p["dtypes"].items():
        lines.append(f"| {name} | {1000 * d['t_s']['1']:.1f} | "
                     + " | ".join(f"{d['t_over_t1'].get(str(w), float('nan')):.2f}" for w in widths) + " |")
    return lines


def _results_md(r: dict) -> list[str]:
    """The headline table: one row per (method, temperature)."""
    lines = ["", "## Results", "",
             "Speedup: end-to-end tokens/s (prefill included) over AR's in the same repetition, median ± half the "
             "min–max range; best-of: per prompt the fastest repetition of each (stalls only add time), "
             "NOISY when the spread exceeds the effect. Bound: τ / (K̄·c + v̄) from the measured cost model; "
             "efficiency = decode-phase speedup (prefill excluded, like the bound) / bound.", "",
             "÷ best free: over the fastest training-free row (n-gram at every setting run) at that T.", "",
             "| method | T | τ | speedup | tokens/s | bound | efficiency | draft share | ÷ HF lookup | ÷ best free "
             "| lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in r["runs"]:
        sp = e["speedup"]
        lines.append(f"| {e['method']} | {_temp(e['temperature'])} | {_f(e['tau'])} | {_f(sp['median'])} ± "
                     f"{_f(sp['spread'])}{_robust(e)} | {_f(e['tokens_per_s']['median'], 1)} | {_f(e['bound'])} | "
                     f"{_f(e['efficiency'])} | {_f(100 * e['draft_frac'], 0, '%')} | {_f(e['vs_hf_prompt_lookup'])} | "
                     f"{_f(e.get('vs_best_free'))} | {'–' if e['lossless'] is None else _f(e['lossless'])} |")
    return lines


def _acceptance_md(r: dict) -> list[str]:
    """Acceptance by draft position, per drafting method and temperature (the baseline drafts nothing)."""
    depth = max((len(e["acceptance_by_pos"]) for e in r["runs"]), default=0)
    if not depth:
        return []
    lines = ["", "## Acceptance rate by draft position", "",
             "P(draft at depth k accepted | the round reached depth k).", "",
             "| method | T | " + " | ".join(f"k={k + 1}" for k in range(depth)) + " |",
             "|---|---|" + "---|" * depth]
    for e in r["runs"]:
        if is_baseline(e):
            continue
        acc = e["acceptance_by_pos"] + [None] * (depth - len(e["acceptance_by_pos"]))
        lines.append(f"| {e['method']} | {_temp(e['temperature'])} | " + " | ".join(_f(a) for a in acc) + " |")
    for name, v in (r.get("draft_vocab") or {}).items():
        lines += ["", f"{name}'s draft vocabulary ({v['size']} ids) holds {_f(100 * v['covers_ar_tokens'], 1)} % of "
                  "AR's T=0 tokens: at T=0 no depth accepts the drafter's own drafts more often than that."]
    return lines + _window_md(r)


def _window_md(r: dict) -> list[str]:
    """τ by reply window (rounds by the reply token they began at), when the replies span more than one."""
    runs = [e for e in r["runs"] if not is_baseline(e) and "tau_by_window" in e]
    n = max((len(e["tau_by_window"]["tau"]) for e in runs), default=0)
    if n < 2:
        return []
    size = runs[0]["tau_by_window"]["tokens"]
    lines = ["", "## τ by reply window", "",
             f"τ of the rounds that began in each {size}-token window of the replies (the start of a reply against "
             "its later parts).", "",
             "| method | T | " + " | ".join(f"{w * size}-{(w + 1) * size - 1}" for w in range(n)) + " |",
             "|---|---|" + "---|" * n]
    for e in runs:
        taus = e["tau_by_window"]["tau"] + [None] * (n - len(e["tau_by_window"]["tau"]))
        lines.append(f"| {e['method']} | {_temp(e['temperature'])} | " + " | ".join(_f(x) for x in taus) + " |")
    return lines


def _peers_md(r: dict) -> list[str]:
    if not r.get("peers"):
        return []
    lines = ["", "## HF transformers peers (T=0, same target and prompts)", "",
             "| peer | settings | tokens/s | speedup vs our AR | tokens == our AR |", "|---|---|---|---|---|"]
    for name, p in r["peers"].items():
        st = ", ".join(f"{k}={v}" for k, v in p["settings"].items()) or "–"
        lines.append(f"| {name} | {st} | {_f(p['tokens_per_s']['median'], 1)} | "
                     f"{_f(p['speedup_vs_ar']['median'])} ± {_f(p['speedup_vs_ar']['spread'])} | "
                     f"{_f(p['matches_ar'])} |")
    return lines


def _categories_md(r: dict) -> list[str]:
    cats = r["prompts"]["categories"]
    if len(cats) <= 1:
        return []
    lines = ["", "## Per category", "", "| method | T | " + " | ".join(f"{c} τ / speedup" for c in cats) + " |",
             "|---|---|" + "---|" * len(cats)]
    for e in r["runs"]:
        cells = [f"{_f(e['by_category'][c]['tau'])} / {_f(e['by_category'][c]['speedup'])}" for c in cats]
        lines.append(f"| {e['method']} | {_temp(e['temperature'])} | " + " | ".join(cells) + " |")
    return lines


def _cost_md(r: dict) -> list[str]:
    """t1, AR's in-situ step, v(K), and per drafting method c, K̄, v̄ at T=0."""
    cm = r["cost_model"]
    lines = ["", "## Cost model", "",
             f"t1 (one-token target forward at a {cm['prefix_len']}-token cache, microbenchmark) = "
             f"{1e3 * cm['t_target_s']:.3f} ms; AR's in-situ step (forward + sampling) = "
             + ", ".join(f"{1e3 * v:.3f} ms at T={k}" for k, v in cm["t_ar_step_s"].items())
             + ". v(K) = (K+1)-token verify forward / t1:", "",
             "| K | " + " | ".join(cm["verify"]) + " |", "|---|" + "---|" * len(cm["verify"]),
             "| v(K) | " + " | ".join(_f(v) for v in cm["verify"].values()) + " |", "",
             "Per method (T=0): c = draft seconds per drafted node / AR step, K̄ = mean drafted nodes per round, "
             "v̄ = mean v(K) over rounds.", "", "| method | c | K̄ | v̄ |", "|---|---|---|---|"]
    for e in r["runs"]:
        if not is_baseline(e) and e["temperature"] == 0:
            lines.append(f"| {e['method']} | {_f(e['c'], 3)} | {_f(e['k_mean'])} | {_f(e['v'])} |")
    return lines


def _divergences_md(r: dict) -> list[str]:
    """The precision line and every T=0 divergence from AR, tolerated or not, with its gap (eval/bench/precision.py)."""
    p = r.get("precision")
    if not p:
        return []
    rule = ("exact: any divergence fails" if p["exact"] else
            f"a divergence fails when the target's gap exceeds {_f(p['slack'], 0)} × noise = {p['threshold']:.3g}")
    lines = ["", f"T=0 check in {p['dtype']}: measured noise (max |verify-width − one-token logits| over "
                 f"{p['noise_positions']} positions, widths up to {p['noise_width']}) = {p['noise']:.3g}; {rule}."]
    rows = [(n, d) for n, m in r["methods"].items() for d in m.get("divergences", [])]
    if rows:
        lines += ["", "## T=0 divergences from AR", "",
                  "gap = max logit − the lower of the two tokens' logits (recomputed on AR's prefix; top-1 − top-2 "
                  "when they are the top two).", "",
                  "| method | where | rep | prompt/row | position | AR token | token | gap | top-1 − top-2 | "
                  "threshold | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, d in rows:
            where = d["where"] + (f" B={d['batch_size']} K={_num_spec(d)}" if d["where"] == "batch" else "")
            verdict = "tolerated (near-tie)" if d.get("tolerated") else "**FAIL**"
            lines.append(f"| {n} | {where} | {d['rep']} | {d.get('prompt', d.get('row'))} | {d['first_diff']} | "
                         f"{d.get('ar_token')} | {d.get('token')} | {_g(d.get('gap'))} | {_g(d.get('top2_gap'))} | "
                         f"{_g(d.get('threshold'))} | {verdict} |")
    return lines


def _num_spec(d: dict, old: str = "k") -> Any:
    """K where results.json records it: ``num_speculative_tokens``; a results file written before K had that name
    (bench/ keeps such records) says ``old`` (``k``; a batch-sweep method's ``k_fixed``)."""
    return d["num_speculative_tokens"] if "num_speculative_tokens" in d else d.get(old)


def _g(x: Any) -> str:
    return "–" if x is None else f"{x:.3g}"


def _batch_md(r: dict) -> list[str]:
    lines: list[str] = []
    b = r.get("batch")
    if b:
        sizes = b["batch_sizes"]
        lines += ["", f"## Batch sweep (T={_temp(b['temperature'])}, chain methods)", "",
                  "Speedup of `speculative_decode_batch` over `decode_ar_batch` per batch size: fixed K, then the "
                  "dynamic policy (K* from measured acceptance and cost model; K*=0 = speculation off).", "",
                  "| method | K | " + " | ".join(f"B={x}" for x in sizes) + " | crossover |",
                  "|---|---|" + "---|" * len(sizes) + "---|",
                  "| AR tokens/s | – | " + " | ".join(_f(b["ar_tokens_per_s"][str(x)]["median"], 1) for x in sizes)
                  + " | – |"]
        for name, m in b["methods"].items():
            rows = {row["batch_size"]: row for row in m["by_batch"]}
            fixed = [f"{_f(rows[x]['speedup']['median'])} ± {_f(rows[x]['speedup']['spread'])}" for x in sizes]
            dyn = [f"{_f(rows[x]['dynamic']['speedup']['median'])} (K*={_num_spec(rows[x]['dynamic'])})"
                   for x in sizes]
            cross = m["crossover_batch_size"]
            lines.append(f"| {name} fixed | {_num_spec(m, 'k_fixed')} | " + " | ".join(fixed)
                         + f" | {'none' if cross is None else f'B={cross}'} |")
            dcross = m["dynamic_crossover_batch_size"]
            lines.append(f"| {name} dynamic | K* | " + " | ".join(dyn)
                         + f" | {'none' if dcross is None else f'B={dcross}'} |")
    if "recommended_num_speculative_tokens" in r:
        by_b = ", ".join(f"B={k}: {v}" for k, v in r["recommended_num_speculative_tokens_by_batch"].items())
        lines += ["", "## Recommendation", "",
                  f"`recommended_num_speculative_tokens` = **{r['recommended_num_speculative_tokens']}** "
                  f"(for {r['recommended_for']}, batch 1; read by `python -m train.export --results`). "
                  f"Per batch size ({r['recommended_for']}): {by_b}."]
        if not r["speculation_pays_at_batch_1"]:
            lines.append("")
            lines.append("Note: the cost model predicts no speedup at batch 1 for this method (K*=0: serve without "
                         f"speculation); the best K >= 1 would be {r.get('best_positive_num_speculative_tokens')}.")
    return lines


def _robust(e: dict) -> str:
    """The fastest-repetition speedup, flagged when the repetitions' spread exceeds the effect (a stall)."""
    rb = e.get("speedup_robust")
    if not rb or is_baseline(e):
        return ""
    return f" (best-of {_f(rb['min_time'])}{', NOISY' if rb['noisy'] else ''})"


def console_summary(results: Mapping[str, Any]) -> str:
    """A few lines for the terminal: T=0 speedups, losslessness, recommendation, crossovers."""
    r = normalize(results)
    q = r.get("quiet") or {}
    out = ["CONTENDED RUN (not a result to quote): " + "; ".join(q["reasons"])] if q.get("contended") else []
    for e in r["runs"]:
        if is_baseline(e):
            continue
        loss = "" if e["lossless"] is None else ("  lossless" if e["lossless"] else "  NOT LOSSLESS")
        out.append(f"{e['method']:>12} T={_temp(e['temperature']):<4} tau={_f(e['tau'])}  speedup="
                   f"{_f(e['speedup']['median'])}±{_f(e['speedup']['spread'])}{_robust(e)}  "
                   f"eff={_f(e['efficiency'])}{loss}")
    for name, p in (r.get("peers") or {}).items():
        out.append(f"{name:>16}  speedup vs our AR={_f(p['speedup_vs_ar']['median'])}  same tokens: "
                   f"{_f(p['matches_ar'])}")
    for name, m in ((r.get("batch") or {}).get("methods") or {}).items():
        cross = m["crossover_batch_size"]
        out.append(f"{name:>12} batch crossover: {'none' if cross is None else f'B={cross}'}  K* by batch: "
                   + ", ".join(f"{k}:{v}" for k, v in m["recommended_num_speculative_tokens"].items()))
    if "recommended_num_speculative_tokens" in r:
        k0 = r["recommended_num_speculative_tokens"] == 0
        out.append(f"recommended_num_speculative_tokens={r['recommended_num_speculative_tokens']} "
                   f"({r['recommended_for']}, batch 1)"
                   + (": speculation does not pay here (the cost model predicts plain decoding is faster at batch 1;"
                      f" the best K >= 1 would be {r.get('best_positive_num_speculative_tokens')})" if k0 else ""))
    tolerated = sum(m.get("n_tolerated", 0) for m in r["methods"].values())
    if tolerated:
        out.append(f"{tolerated} T=0 divergence(s) at near-ties within {r['precision']['dtype']} noise tolerated "
                   "(listed in results.md)")
    out.append("lossless: all methods" if r["lossless"] else
               "LOSSLESS CHECK FAILED: " + ", ".join(n for n, m in r["methods"].items() if not m["lossless"]))
    return "\n".join(out)


def plot(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """The PNGs (matplotlib, Agg backend: no display needed). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = normalize(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = {(e["method"], e["temperature"]): e for e in r["runs"]}
    written = [_plot_tau_speedup(r, runs, out / "tau_speedup.png", plt),
               _plot_acceptance(r, runs, out / "acceptance.png", plt)]
    b = r.get("batch")
    if b and b.get("methods"):
        written.append(_plot_batch(b, out / "batch_speedup.png", plt))
    curve = training.plot(r.get("training") or {}, out / "learning_curve.png", plt)
    return written + ([curve] if curve else [])


def _plot_tau_speedup(r: dict, runs: dict, path: Path, plt) -> Path:
    """τ and speedup per method and temperature (bars), speedup with its min–max and the cost-model bound."""
    temps = r["settings"]["temperatures"]
    names = list(r["methods"])
    width = 0.8 / max(len(temps), 1)
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(names) + 3), 7.5))
    for j, t in enumerate(temps):
        xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(names))]
        es = [runs[(n, t)] for n in names]
        axes[0].bar(xs, [e["tau"] or 0 for e in es], width, label=f"T={_temp(t)}")
        med = [e["speedup"]["median"] for e in es]
        err = [[m - e["speedup"]["min"] for m, e in zip(med, es)], [e["speedup"]["max"] - m for m, e in zip(med, es)]]
        axes[1].bar(xs, med, width, yerr=err, capsize=3, label=f"T={_temp(t)}")
        axes[1].scatter(xs, [e["bound"] if e["bound"] is not None else float("nan") for e in es], marker="D", s=22,
                        color="crimson", zorder=3, label="cost-model bound" if j == 0 else None)
    axes[0].set_title("τ (tokens per target forward)")
    axes[1].set_title("speedup over AR (min–max over repetitions)")
    axes[1].axhline(1.0, color="gray", lw=0.8, ls="--")
    for ax in axes:
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path, plt)


def _plot_acceptance(r: dict, runs: dict, path: Path, plt) -> Path:
    """Acceptance rate by draft position, a line per (method, temperature)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-."]
    for j, t in enumerate(r["settings"]["temperatures"]):
        for i, n in enumerate(r["methods"]):
            acc = runs[(n, t)]["acceptance_by_pos"]
            if acc:
                ax.plot(range(1, len(acc) + 1), [a if a is not None else float("nan") for a in acc],
                        styles[j % len(styles)], marker="o", color=f"C{i}", label=f"{n} T={_temp(t)}")
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft position")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, path, plt)


def _plot_batch(b: dict, path: Path, plt) -> Path:
    """The batch sweep: speedup vs batch size per chain method, fixed K (with its spread) and the dynamic K*."""
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for i, (name, m) in enumerate(b["methods"].items()):
        rows = m["by_batch"]
        xs = [row["batch_size"] for row in rows]
        med = [row["speedup"]["median"] for row in rows]
        err = [[md - row["speedup"]["min"] for md, row in zip(med, rows)],
               [row["speedup"]["max"] - md for md, row in zip(med, rows)]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, color=f"C{i}",
                    label=f"{name} K={_num_spec(m, 'k_fixed')}")
        ax.plot(xs, [row["dynamic"]["speedup"]["median"] for row in rows], "--", marker="x", color=f"C{i}",
                label=f"{name} dynamic K*")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(b["batch_sizes"], [str(x) for x in b["batch_sizes"]])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over batched AR")
    ax.set_title(f"speedup vs batch size (T={_temp(b['temperature'])})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.md + the PNGs into ``out_dir``; returns {file name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "results.md"
    md.write_text(markdown(results))
    return {p.name: p for p in [md, *plot(results, out)]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.bench.report", description=__doc__.splitlines()[0])
    p.add_argument("results", help="results.json written by `python -m eval`")
    p.add_argument("--out", help="output directory (default: next to the results file)")
    a = p.parse_args(argv)
    res = json.loads(Path(a.results).read_text())
    files = write_report(res, a.out or Path(a.results).parent)
    print(console_summary(res))
    print("wrote " + ", ".join(str(f) for f in files.values()))


if __name__ == "__main__":
    main()
