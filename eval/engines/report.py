"""An engine benchmark's results.json rendered as markdown (one run, or every run under a folder)."""

from __future__ import annotations

import json
from pathlib import Path


def write(res: dict, out: Path) -> dict:
    """OUT/results.json and OUT/results.md for one run; returns ``res``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(render(res))
    return res


def render(res: dict) -> str:
    bs = [str(b) for b in res["batch_sizes"]]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [f"# In-engine: {res['engine']} {res['version']} on {res['target']}", "",
             f"{res['n_prompts']} prompts ({res.get('prompts', 'held-out stdlib')}) x {res['max_new_tokens']} new "
             f"tokens, greedy, target {res.get('target_type', 'f32')}, "
             f"{res.get('threads', 1)} thread(s), {res.get('repetitions', 1)} repetition(s) (tok/s: median, "
             "(min-max)). Speedups are over the engine's own AR at the same batch size. "
             "Acceptance: unconditional per-position rates (accepted at depth k / drafts), engine | harness.", "",
             "| method | K | lossless | " + " | ".join(f"tok/s B={b} | x AR B={b}" for b in bs)
             + " | tokens/round engine | tau harness | acceptance by position (engine / harness) |",
             "|---|---|---|" + "---|---|" * len(bs) + "---|---|---|"]
    for name, r in res["methods"].items():
        # K: results written before K was named num_speculative_tokens (bench/engines/) say "k"
        k = r["num_speculative_tokens"] if "num_speculative_tokens" in r else r.get("k")
        if not r["ok"]:
            lines.append(f"| {name} | {k} | refused: {r['error'][:120]} |")
            continue
        tps = " | ".join(f"{f(r['tokens_per_s'].get(b), 1)}{spread(r, b)} | {f(r['speedup_vs_engine_ar'].get(b))}"
                         for b in bs)
        acc = "-"
        if r.get("engine_rates"):
            acc = ", ".join(f"{e:.2f}/{f(h)}" for e, h in zip(r["engine_rates"], r.get("harness_rates")
                                                               or [None] * len(r["engine_rates"])))
        elif r.get("engine_acceptance") is not None:  # llama-server counts drafted and accepted, not by position
            acc = f"{r['engine_acceptance']:.2f} of drafts (server)"
        ties = "".join(f" (near tie at token {t['position']}: top-2 logit gap {f(t['top2_logit_gap'], 4)})"
                       for t in r.get("near_ties", []))
        if r.get("diverging_prompts"):
            ties += f" (differs from the engine's AR on prompts {r['diverging_prompts']})"
        ok = "yes" if r["lossless"] else "NO" + ties
        lines.append(f"| {name} | {k or '-'} | {ok} | {tps} | "
                     f"{f(r.get('engine_tokens_per_round'))} | {f(r.get('harness_tau'))} | {acc} |")
    from eval.engines import breakdown

    return "\n".join(lines + breakdown.render(res)) + "\n"


def spread(row: dict, batch: str) -> str:
    """`` (min-max)`` over a row's repetitions at a batch size, or nothing for one repetition."""
    reps = row.get("tokens_per_s_reps")
    reps = reps.get(batch) if isinstance(reps, dict) else (reps if batch == "1" else None)
    return f" ({min(reps):.1f}-{max(reps):.1f})" if reps and len(reps) > 1 else ""


def combine(root: Path) -> Path:
    """ROOT/results.md: every ROOT/*/results.json (one per engine and target) rendered in one file."""
    parts = [json.loads(f.read_text()) for f in sorted(root.glob("*/results.json"))]
    text = "\n".join(render(r).replace("# In-engine:", "## In-engine:", 1) for r in parts)
    (root / "results.md").write_text("# In-engine tokens/s: AR, n-gram and each drafter, served by the engines\n\n"
                                     + text)
    return root / "results.md"
