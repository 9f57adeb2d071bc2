"""Where a chain drafter's round goes: greedy speculative decoding of a few prompts under torch's profiler, the
proposer's share split from the target's, and the operators that dominate the draft: to see whether a draft step
costs what its arithmetic does, and if not, which operators take the rest.

    python scripts/profile_draft.py --checkpoint models/smollm2_drafters/eagle3_onpolicy/final --target smollm2 \\
        --dtype auto --prompts mt_bench --n-prompts 4 --threads 1

Prints per drafted token: the draft's milliseconds, the target's one-token step, their ratio c, and the top
operators by self CPU time inside the proposer (record_function scopes ``draft`` and ``verify``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _scoped(fn, record_function):
    def call(*args, **kw):
        with record_function("draft"):
            return fn(*args, **kw)
    return call


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from eval.bench.setup import load_prompts
    from eval.decode.single import decode_ar, speculative_decode
    from eval.engines.serving import chain_proposer
    from models.core.target import FrozenTarget
    from models.registry import load_drafter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--target", default="tiny-code")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the chain")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", help="the drafting precision, for methods that take it (EAGLE-3: bfloat16, int8)")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    target = FrozenTarget.from_pretrained(a.target, dtype=a.dtype)
    drafter, meta = load_drafter(Path(a.checkpoint), target)
    prompts = [torch.tensor([p.ids]) for p in load_prompts(target.tokenizer, a.n_prompts, 640, a.prompts)]
    if a.weights:  # the chain's drafting precision (EAGLE-3's ``weights`` option: float32 | bfloat16 | int8)
        from models import registry

        spec = registry.method(meta["method"]).proposers[0]
        proposer = registry.make_proposer_factory(spec.name, drafter, target, a.checkpoint,
                                                  {"num_speculative_tokens": a.k, "weights": a.weights})[0](None)
    else:
        proposer = chain_proposer(meta["method"], drafter, target, a.checkpoint, a.k)
    for name in ("begin", "propose", "accept"):  # every proposer call (drafting and absorbing the target's states)
        setattr(proposer, name, _scoped(getattr(proposer, name), record_function))
    speculative_decode(target, proposer, prompts[0], 8)  # warm-up
    t0 = time.perf_counter()
    for p in prompts:
        decode_ar(target, p, a.max_new_tokens)
    ar_s = time.perf_counter() - t0
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        drafted = 0
        for p in prompts:
            r = speculative_decode(target, proposer, p, a.max_new_tokens)
            drafted += sum(r.drafted)
    events = prof.key_averages()
    draft_ms = next(e.cpu_time_total for e in events if e.key == "draft") / 1000
    step_ms = 1000 * ar_s / (len(prompts) * a.max_new_tokens)
    print(f"target {a.target} ({target.model.dtype}), {meta['method']} K={a.k} weights {a.weights or 'default'}, "
          f"{len(prompts)} prompts, "
          f"{a.threads} thread(s)")
    print(f"draft: {draft_ms / max(drafted, 1):.2f} ms per drafted token ({drafted} drafted, {draft_ms:.0f} ms); "
          f"AR step {step_ms:.1f} ms (prefill included); c = {draft_ms / max(drafted, 1) / step_ms:.3f}")
    inside = _inside_draft(prof.events())
    total = sum(inside.values())
    print(f"inside the draft scope, by operator (self CPU, ms per drafted token; {total / 1000:.0f} ms in all):")
    for name, us in sorted(inside.items(), key=lambda x: -x[1])[:a.top]:
        print(f"  {name:<52} {us / 1000 / max(drafted, 1):7.3f}  {100 * us / max(total, 1):5.1f} %")
    return 0


def _inside_draft(events) -> dict[str, float]:
    """Self CPU microseconds per operator over the events whose ancestors include a ``draft`` scope (the scope's
    own self time is the proposer's Python between operators)."""
    out: dict[str, float] = {}
    for e in events:
        p, hit = e, False
        while p is not None:
            if p.name == "draft":
                hit = True
                break
            p = p.cpu_parent
        if hit:
            out[e.name] = out.get(e.name, 0.0) + e.self_cpu_time_total
    return out


if __name__ == "__main__":
    sys.exit(main())
