"""llama.cpp's side of ``python -m eval.engines.bench --engine llamacpp``: the target and each drafter as GGUF files,
served by the example tools or llama-server, judged against the harness (an f32 target) or the engine's own AR."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from eval.engines import serving as E
from eval.engines.report import write
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS


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
    return write(res, out)


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
