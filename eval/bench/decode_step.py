"""``decode_step``: which one-row decoding step the benchmark runs, AR and speculative decoding alike.

- ``eager``: the target's own forward over a growing cache (transformers DynamicCache).
- ``compiled``: a fixed-capacity cache and a step compiled once per width (models/core/static_kv.py).
- ``auto``: compiled when this machine runs its one-token step at least ``MARGIN`` faster than eager's, measured in
  ``ROUNDS`` interleaved rounds (a burst of load falls on one round, or on both steps of a round alike), as
  ``target.dtype=auto`` decides its dtype (models/core/kernels.py); eager where the target has no static step
  (an encoder-decoder) or the step does not compile.

Compiled, the target's packed linears (models/core/packed.py) call oneDNN's packed GEMM, F.linear (which inductor
lowers to its own), or, in bf16 on a CPU with AVX-512 BF16, the streamed GEMV of models/core/gemv.py; where more than
one exists the same interleaved rounds race them too, in ``compiled`` mode as in ``auto`` (the packed GEMM beat
inductor's in SmolLM2's bf16 step on a Zen 5, inductor's won its fp32 step on an AVX2 EPYC).

Speedups divide by plain decoding's time, so the baseline is the fastest plain decoding the harness can do here; and
the speculative methods verify and commit through the same step. What was measured and chosen is recorded in the
results (``env.decode_step``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from eval.decode.ladder import new_cache
from eval.decode.result import device_time
from models.core import gemv
from models.core.packed import has_packed, set_default_linears
from models.core.static_kv import StaticDecoding, static_unsupported
from models.core.target import FrozenTarget

MODES = ("auto", "eager", "compiled")
ROUNDS = 5
STEPS = 8  # one-token steps timed per round and step kind (their median)
MARGIN = 0.05  # compiled must beat eager by this much (median round ratio <= 0.95): it costs a compile per width


def choose_decode_step(target: FrozenTarget, mode: str, capacity: int, prefix_len: int = 128,
                       backend: str = "inductor", widths: Sequence[int] = ()) -> dict:
    """Set ``target.static`` by ``mode`` for decodes of up to ``capacity`` tokens; the record of what was chosen.
    ``backend``: torch.compile's; ``widths``: the chains' own widths, traced unpadded (models/core/static_kv.py)."""
    if mode not in MODES:
        raise ValueError(f"decode_step={mode!r} not understood; use one of {list(MODES)}")
    record: dict = {"mode": mode, "chosen": "eager"}
    target.use_eager()
    set_default_linears("packed")  # the eager step as the harness loads it
    target.model.draftsmith_decode_step = record
    why = static_unsupported(target.model)
    if why is not None and mode == "compiled":
        raise ValueError(f"decode_step=compiled: the target cannot decode over a static cache: {why}; "
                         "use decode_step=eager or auto")
    if why is not None:
        record["why"] = why
    if mode == "eager" or why is not None:
        return record
    static = target.use_static(capacity, backend, widths=widths)
    record.update(capacity=static.capacity, widths=list(static.widths))
    # which kernel the compiled step's linears call, where there is a choice: raced, as the step itself is under auto
    steps = {"compiled": static, **{f"compiled_{k}": StaticDecoding(target.model, target._hook_module, capacity,
                                                                    backend, linears=k, widths=widths)
                                    for k in linear_kinds(target.model) if k != "packed"}}
    try:
        record.update(race(target, steps, mode == "auto", prefix_len))
    except Exception as e:  # noqa: BLE001 (any model torch.compile cannot trace: auto keeps the eager step)
        if mode == "compiled":
            raise
        record.update(chosen="eager", why=f"the step did not compile: {type(e).__name__}: "
                                          f"{(str(e).strip().splitlines() or [''])[0][:200]}")
    static = steps["compiled" if record.get("linears", "packed") == "packed" else f"compiled_{record['linears']}"]
    for other in steps.values():
        if other is not static:
            other.close()
    target.static = static
    if record["chosen"] == "eager":
        target.use_eager()
    # a drafter's few-row linears follow the target's kernel (the GEMV where it won: models/core/packed.py)
    set_default_linears("gemv" if record["chosen"] == "compiled" and record.get("linears") == "gemv" else "packed")
    record["compile_s"] = static.compile_s  # the same dict: traces compiled later (the warm-up's) join it
    return record


def linear_kinds(model: torch.nn.Module) -> list[str]:
    """The kernels a compiled step's linears can call here (models/core/packed.py ``KINDS``): oneDNN's packed GEMM
    and inductor's where the target has packed linears, and the GEMV where they are bf16 and the kernel runs here."""
    if not has_packed(model):
        return ["packed"]
    bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
    return ["packed", "plain"] + (["gemv"] if bf16 and gemv.unavailable() is None else [])


def chain_widths(methods: Sequence) -> list[int]:
    """The query widths the methods' chains verify at: K + 1 rows, and a prompt lookup's tokens + 1 in front of a
    model (eval.bench.setup.Method's ``num_speculative_tokens`` and ``options``)."""
    out = set()
    for m in methods:
        if m.num_speculative_tokens:
            out.add(int(m.num_speculative_tokens) + 1)
        if (m.options or {}).get("lookup") and (m.options or {}).get("lookup_tokens"):
            out.add(int(m.options["lookup_tokens"]) + 1)
    return sorted(out)


@torch.no_grad()
def race(target: FrozenTarget, steps_by_kind: dict, with_eager: bool = True, prefix_len: int = 128,
         rounds: int = ROUNDS, steps: int = STEPS) -> dict:
    """The one-token step's median ms of each kind (eager: ``target.static`` None; the others: a StaticDecoding,
    None = not raced) in interleaved rounds (the first round, which compiles, untimed); what the rule picks: the
    faster compiled kind, then compiled over eager where it wins by MARGIN. Nothing to race: compiled."""
    kinds = {k: v for k, v in steps_by_kind.items() if v is not None}
    if with_eager:
        kinds = {"eager": None, **kinds}
    if len(kinds) == 1:
        return {"chosen": "compiled"}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(target.vocab_size, (1, prefix_len), generator=g).to(target.model.device)
    ms: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds + 1):
        for kind, static in kinds.items():
            target.static = static
            secs = one_token_steps(target, prompt, steps)
            if r:
                ms[kind].append(1e3 * statistics.median(secs))
    target.static = None
    compiled = [k for k in kinds if k != "eager"]
    best = min(compiled, key=lambda k: statistics.median(ms[k]))
    out = {"chosen": "compiled", **{f"{k}_ms": round(statistics.median(v), 2) for k, v in ms.items()},
           "rounds": rounds, "steps": steps, "prefix_len": prefix_len}
    if len(compiled) > 1:
        out["linears"] = best.removeprefix("compiled_") if best != "compiled" else "packed"
    if with_eager:
        out["ratio"] = round(statistics.median(c / e for c, e in zip(ms[best], ms["eager"])), 3)
        out["chosen"] = "compiled" if out["ratio"] <= 1 - MARGIN else "eager"
    return out


def one_token_steps(target: FrozenTarget, prompt: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each of ``steps`` greedy one-token forwards after ``prompt``, on a fresh cache of the current kind."""
    cache = new_cache(target, 1, prompt.shape[1] + steps)
    tok = target(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    secs = []
    for _ in range(steps):
        t = device_time(prompt.device)
        tok = target(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        secs.append(device_time(prompt.device) - t)
    return secs
