"""`python scripts/compile_probe.py --target smollm2 [--threads 1] [--out F.json]`: what a compiled, static-cache
decode step (gpt-fast's approach, issue #46) buys over the harness's eager step on this CPU, before building it.

Times the one-token decoding step on a cache of ``--context`` tokens, steady state (median of ``--steps`` after a
warm-up), these ways:
- ``harness``: the target as the harness loads it (FrozenTarget: packed linears, grouped attention), DynamicCache;
- ``static`` (and ``static_eager``, untraced; ``static_frozen``, with inductor's freezing): the harness's own
  static-cache step, what ``decode_step=compiled`` decodes with (models/core/static_kv.py);
- ``eager_static``: plain transformers over a StaticCache (fixed shapes, no compile), to separate the cache from
  the compiler;
- ``compiled`` (and ``compiled_frozen``: inductor's freezing, which prepacks the weights for oneDNN): that step under
  ``torch.compile(fullgraph=True, dynamic=False)``, the first call's compile seconds reported apart.
Every variant's greedy tokens over the timed steps are compared with the harness's (fp32: identical expected).
Run it alone: the timings are the point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _time_steps(step, first: torch.Tensor, n: int) -> tuple[list[float], list[int]]:
    """``step(tok [1,1], pos) -> logits [1, V]`` run ``n`` times greedily from ``first``; per-step seconds, tokens."""
    tok, secs, toks = first, [], []
    for i in range(n):
        t = time.perf_counter()
        logits = step(tok, i)
        nxt = logits.argmax(-1)
        secs.append(time.perf_counter() - t)
        toks.append(int(nxt))
        tok = nxt.view(1, 1)
    return secs, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="the harness's target dtype (the other variants: float32)")
    ap.add_argument("--variants", nargs="+",
                    default=["harness", "static_eager", "static", "eager_static", "compiled", "compiled_frozen"])
    ap.add_argument("--profile", type=int, default=0, help="then profile N more steps of each variant (top ops)")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    from eval.decode.ladder import new_cache
    from models.core.kernels import cpu_features
    from models.core.packed import fp32_logits
    from models.core.target import FrozenTarget, resolve_name

    path = resolve_name(a.target)
    g = torch.Generator().manual_seed(0)
    harness = FrozenTarget.from_pretrained(a.target, dtype=a.dtype)
    fp32_logits(harness.model)  # as eval decodes a bf16 target (its fp32_logits default): the head in fp32
    prompt = torch.randint(harness.vocab_size, (1, a.context), generator=g)
    out: dict = {"target": a.target, "threads": a.threads, "context": a.context, "steps": a.steps,
                 "dtype": a.dtype, "torch": torch.__version__, "cpu": cpu_features(), "variants": {}}
    ref_tokens = None
    for v in a.variants:
        t0 = time.perf_counter()
        if v == "harness" or v.startswith("static"):
            harness.use_eager()
            if v.startswith("static"):  # what eval's decode_step=compiled runs (models/core/static_kv.py)
                harness.use_static(a.capacity, None if v == "static_eager" else "inductor", v == "static_frozen")
            cache = new_cache(harness, 1, a.context + a.steps + 1) if harness.static else DynamicCache()
            first = harness(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
            if harness.static:
                c = time.perf_counter()
                harness(first.view(1, 1), cache=cache, use_cache=True)  # trace and compile, then start over
                out.setdefault("compile_s", {})[v] = round(time.perf_counter() - c, 1)
                cache = new_cache(harness, 1, a.context + a.steps + 1)
                first = harness(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)

            def step(tok, i, cache=cache):
                return harness(tok, cache=cache, use_cache=True).logits[:, -1]
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
            cache = StaticCache(config=model.config, max_cache_len=a.capacity)
            with torch.no_grad():
                first = model(prompt, past_key_values=cache, cache_position=torch.arange(a.context),
                              use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)

            def fwd(tok, pos, model=model, cache=cache):
                return model(tok, past_key_values=cache, cache_position=pos, position_ids=pos[None],
                             use_cache=True, logits_to_keep=1).logits[:, -1]
            if v.startswith("compiled"):
                import torch._inductor.config as ind

                ind.freezing = v == "compiled_frozen"
                torch._dynamo.reset()
                fwd = torch.compile(fwd, fullgraph=True, dynamic=False)
            positions = [torch.tensor([a.context + i]) for i in range(a.steps + 1)]

            def step(tok, i, fwd=fwd, positions=positions):
                with torch.no_grad():
                    return fwd(tok, positions[i])
            c = time.perf_counter()
            step(first.view(1, 1), 0)  # compile (or warm) on the first position; the timed run starts over
            out.setdefault("compile_s", {})[v] = round(time.perf_counter() - c, 1)
            cache.reset()
            with torch.no_grad():
                first = model(prompt, past_key_values=cache, cache_position=torch.arange(a.context),
                              use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
        secs, toks = _time_steps(step, first.view(1, 1), a.steps)
        ref_tokens = toks if ref_tokens is None else ref_tokens
        warm = secs[4:]
        med = statistics.median(warm)
        out["variants"][v] = {"ms_median": round(1e3 * med, 2), "ms_min": round(1e3 * min(warm), 2),
                              "tokens_per_s": round(1 / med, 1), "same_tokens_as_first": toks == ref_tokens,
                              "setup_s": round(time.perf_counter() - t0, 1)}
        print(v, out["variants"][v], flush=True)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _time_steps(step, first.view(1, 1), a.profile)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
            out["variants"][v]["profile_top"] = table.splitlines()
            print(table, flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
