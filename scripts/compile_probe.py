"""`python scripts/compile_probe.py --target smollm2 [--threads 1] [--out F.json]`: what a compiled, static-cache
decode step (gpt-fast's approach, issue #46) buys over the harness's eager step on this CPU, before building it.

Times the one-token decoding step on a cache of ``--context`` tokens, steady state (median of ``--steps`` after a
warm-up), these ways:
- ``harness``: the target as the harness loads it (FrozenTarget: packed linears, grouped attention), DynamicCache;
- ``static`` (and ``static_eager``, untraced; ``static_plain``, its linears as F.linear, inductor's GEMM;
  ``static_gemv``, the streamed bf16 GEMV of models/core/gemv.py): the harness's own static-cache step, what
  ``decode_step=compiled`` decodes with (models/core/static_kv.py);
- ``eager_static``: plain transformers over a StaticCache (fixed shapes, no compile), to separate the cache from
  the compiler;
- ``compiled`` (and ``compiled_frozen``: inductor's freezing, which prepacks the weights for oneDNN): that step under
  ``torch.compile(fullgraph=True, dynamic=False)``, the first call's compile seconds reported apart.
The variants are set up (and compiled) first, then timed in ``--rounds`` rounds, each variant in turn decoding
``--steps`` tokens from a fresh prefill (this VM's speed drifts by itself within minutes: interleaving puts a drift on
all variants alike). Every variant's greedy tokens are compared with the first variant's (fp32: identical
expected). Run it alone: the timings are the point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _time_steps(step, first: torch.Tensor, start: int, n: int) -> tuple[list[float], list[int]]:
    """``step(tok [1,1], i) -> logits [1, V]`` for i in start..start+n-1, greedily from ``first``; seconds, tokens."""
    tok, secs, toks = first, [], []
    for i in range(start, start + n):
        t = time.perf_counter()
        logits = step(tok, i)
        nxt = logits.argmax(-1)
        secs.append(time.perf_counter() - t)
        toks.append(int(nxt))
        tok = nxt.view(1, 1)
    return secs, toks


def _harness_variant(v: str, harness, prompt: torch.Tensor, a, out: dict):
    """A variant over the harness's FrozenTarget: (``prefill() -> first token``, ``step``)."""
    from transformers import DynamicCache

    from eval.decode.ladder import new_cache

    harness.use_eager()
    static = None
    if v.startswith("static"):  # what eval's decode_step=compiled runs (models/core/static_kv.py)
        linears = {"static_plain": "plain", "static_gemv": "gemv"}.get(v, "packed")
        static = harness.use_static(a.capacity, None if v == "static_eager" else "inductor", linears)
    box: dict = {}

    def prefill():
        harness.static = static
        box["cache"] = new_cache(harness, 1, a.context + a.steps + 1) if static else DynamicCache()
        return harness(prompt, cache=box["cache"], use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)

    def step(tok, i):
        harness.static = static
        return harness(tok, cache=box["cache"], use_cache=True).logits[:, -1]
    if static is not None:
        first = prefill()
        c = time.perf_counter()
        step(first.view(1, 1), 0)  # trace and compile; the timed decode starts over
        out.setdefault("compile_s", {})[v] = round(time.perf_counter() - c, 1)
    return prefill, step



def _transformers_variant(v: str, path: str, prompt: torch.Tensor, a, out: dict):
    """Plain transformers over a StaticCache, eager or compiled: (``prefill``, ``step``)."""
    from transformers import AutoModelForCausalLM, StaticCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    cache = StaticCache(config=model.config, max_cache_len=a.capacity)

    def fwd(tok, pos):
        return model(tok, past_key_values=cache, cache_position=pos, position_ids=pos[None],
                     use_cache=True, logits_to_keep=1).logits[:, -1]
    if v.startswith("compiled"):
        import torch._inductor.config as ind

        ind.freezing = v == "compiled_frozen"
        fwd = torch.compile(fwd, fullgraph=True, dynamic=False)
    positions = [torch.tensor([a.context + i]) for i in range(a.steps + 1)]

    @torch.no_grad()
    def prefill():
        cache.reset()
        return model(prompt, past_key_values=cache, cache_position=torch.arange(a.context),
                     use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)

    @torch.no_grad()
    def step(tok, i):
        return fwd(tok, positions[i])
    first = prefill()
    c = time.perf_counter()
    step(first.view(1, 1), 0)  # compile (or warm) on the first position; the timed decode starts over
    out.setdefault("compile_s", {})[v] = round(time.perf_counter() - c, 1)
    return prefill, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4, help="each variant decodes --steps tokens once per round, the "
                                                          "variants in turn (a drift of the machine falls on all)")
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="the harness's target dtype (the other variants: float32)")
    ap.add_argument("--variants", nargs="+",
                    default=["harness", "static_eager", "static", "eager_static", "compiled", "compiled_frozen"])
    ap.add_argument("--profile", type=int, default=0, help="then profile N more steps of each variant (top ops)")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from models.core.kernels import cpu_features
    from models.core.packed import fp32_logits
    from models.core.target import FrozenTarget, resolve_name

    g = torch.Generator().manual_seed(0)
    harness = FrozenTarget.from_pretrained(a.target, dtype=a.dtype)
    fp32_logits(harness.model)  # as eval decodes a bf16 target (its fp32_logits default): the head in fp32
    prompt = torch.randint(harness.vocab_size, (1, a.context), generator=g)
    out: dict = {"target": a.target, "threads": a.threads, "context": a.context, "steps": a.steps,
                 "rounds": a.rounds, "dtype": a.dtype, "torch": torch.__version__, "cpu": cpu_features(),
                 "variants": {}}
    variants = {}
    for v in a.variants:
        t0 = time.perf_counter()
        variants[v] = (_harness_variant(v, harness, prompt, a, out) if v == "harness" or v.startswith("static")
                       else _transformers_variant(v, resolve_name(a.target), prompt, a, out))
        out["variants"][v] = {"setup_s": round(time.perf_counter() - t0, 1)}
    secs: dict[str, list[float]] = {v: [] for v in variants}
    toks: dict[str, list[int]] = {}
    for _ in range(a.rounds):
        for v, (prefill, step) in variants.items():
            s, t = _time_steps(step, prefill().view(1, 1), 0, a.steps)
            secs[v] += s[4:]  # each round's first steps warm the caches up
            toks.setdefault(v, t)
    ref = toks[a.variants[0]]
    for v in variants:
        med = statistics.median(secs[v])
        out["variants"][v].update(ms_median=round(1e3 * med, 2), ms_min=round(1e3 * min(secs[v]), 2),
                                  tokens_per_s=round(1 / med, 1), same_tokens_as_first=toks[v] == ref)
        print(v, out["variants"][v], flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for v, (prefill, step) in variants.items():
            first = prefill().view(1, 1)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _time_steps(step, first, 0, a.profile)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
            out["variants"][v]["profile_top"] = table.splitlines()
            print(v, table, sep="\n", flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
