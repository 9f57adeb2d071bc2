"""``decode_step``: which one-row decoding step the benchmark runs, AR and speculative decoding alike.

- ``eager``: the target's own forward over a growing cache (transformers DynamicCache).
- ``compiled``: a fixed-capacity cache and a step compiled once per width (models/core/static_kv.py).
- ``auto``: compiled when this machine runs its one-token step at least ``MARGIN`` faster than eager's, measured in
  ``ROUNDS`` interleaved rounds (a burst of load falls on one round, or on both steps of a round alike), as
  ``target.dtype=auto`` decides its dtype (models/core/kernels.py); eager where the target has no static step
  (sliding-window layers).

Speedups divide by plain decoding's time, so the baseline is the fastest plain decoding the harness can do here; and
the speculative methods verify and commit through the same step. What was measured and chosen is recorded in the
results (``env.decode_step``).
"""

from __future__ import annotations

import statistics

import torch

from eval.decode.ladder import new_cache
from eval.decode.result import device_time
from models.core.static_kv import static_unsupported
from models.core.target import FrozenTarget

MODES = ("auto", "eager", "compiled")
ROUNDS = 5
STEPS = 8  # one-token steps timed per round and step kind (their median)
MARGIN = 0.05  # compiled must beat eager by this much (median round ratio <= 0.95): it costs a compile per width


def choose_decode_step(target: FrozenTarget, mode: str, capacity: int, prefix_len: int = 128,
                       backend: str = "inductor") -> dict:
    """Set ``target.static`` by ``mode`` for decodes of up to ``capacity`` tokens; the record of what was chosen.
    ``backend``: torch.compile's (models/core/static_kv.py)."""
    if mode not in MODES:
        raise ValueError(f"decode_step={mode!r} not understood; use one of {list(MODES)}")
    record: dict = {"mode": mode, "chosen": "eager"}
    target.use_eager()
    target.model.draftsmith_decode_step = record
    why = static_unsupported(target.model)
    if why is not None and mode == "compiled":
        raise ValueError(f"decode_step=compiled: the target cannot decode over a static cache: {why}; "
                         "use decode_step=eager or auto")
    if why is not None:
        record["why"] = why
    if mode == "eager" or why is not None:
        return record
    static = target.use_static(capacity, backend)
    record["capacity"] = static.capacity
    if mode == "auto":
        try:
            record.update(race(target, prefix_len))
        except Exception as e:  # noqa: BLE001 (any model torch.compile cannot trace: auto keeps the eager step)
            record.update(chosen="eager", why=f"the step did not compile: {type(e).__name__}: "
                                              f"{(str(e).strip().splitlines() or [''])[0][:200]}")
        if record["chosen"] == "eager":
            target.use_eager()
    else:
        record["chosen"] = "compiled"
    record["compile_s"] = static.compile_s  # the same dict: traces compiled later (the warm-up's) join it
    return record


@torch.no_grad()
def race(target: FrozenTarget, prefix_len: int = 128, rounds: int = ROUNDS, steps: int = STEPS) -> dict:
    """The one-token step's median ms, eager and compiled, in interleaved rounds (the first round, which compiles,
    untimed); which one the rule picks."""
    static = target.static
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(target.vocab_size, (1, prefix_len), generator=g).to(target.model.device)
    ms: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(rounds + 1):
        for kind in ms:
            target.static = static if kind == "compiled" else None
            secs = one_token_steps(target, prompt, steps)
            if r:
                ms[kind].append(1e3 * statistics.median(secs))
    target.static = static
    ratio = statistics.median(c / e for c, e in zip(ms["compiled"], ms["eager"]))
    return {"chosen": "compiled" if ratio <= 1 - MARGIN else "eager", "ratio": round(ratio, 3),
            "eager_ms": round(statistics.median(ms["eager"]), 2),
            "compiled_ms": round(statistics.median(ms["compiled"]), 2), "rounds": rounds, "steps": steps,
            "prefix_len": prefix_len}


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
