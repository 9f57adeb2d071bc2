"""Kernels by measurement: which dtype this machine runs the target fastest in, measured, not assumed.

Whether bf16 beats fp32 on a CPU depends on the instructions it has, and torch picks its GEMM kernels from them:
- with AVX-512 BF16 (Zen 4/5 with AVX-512 enabled, Sapphire Rapids and later, AMX), oneDNN's bf16 GEMM is flat in
  the few rows of decoding and half the bytes of fp32, so bf16 wins (SmolLM2's 576x49152 lm_head at 1/2/4/6 rows:
  fp32 7.4/15.6/13.0/15.1 ms, bf16 3.9/4.6/3.9/4.1 ms on such a Zen 5);
- with AVX2 only (a VM that hides AVX-512, as some of these machines do), bf16 has no native dot product and runs
  2-7x *slower* than fp32 (the same lm_head at 1/4/16 rows: fp32 12/28/42 ms, bf16 7.5/26/107 ms).

So ``target.dtype=auto`` is decided by a rule, which one timing cannot flip: a single race between the dtypes on a
shared machine chose bf16 on one run and fp32 on the next. bf16 is chosen only when both hold:
1. the CPU has a native bf16 dot product (``native_bf16``: ``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo, and
   torch's oneDNN runs bf16 on it); without one, fp32, whatever any timing says;
2. a confirming measurement agrees: the one-token step (plain decoding, the baseline every speedup divides by) of
   each dtype timed in ``ROUNDS`` interleaved rounds, and bf16's median round ratio to fp32 at most ``1 - MARGIN``
   (``confirm_bf16``): a burst of load falls on one round, or on both dtypes of a round alike, not on one dtype's
   whole measurement. Where bf16 is native it is 2-4x faster at one row, far beyond the margin. bf16's step is
   timed on its fastest linears here: the streamed GEMV where it runs (models/core/gemv.py), which a compiled step
   races and usually takes; on oneDNN's kernel alone the two dtypes came within the margin in a slow stretch of
   this VM (63.5 vs 63.4 ms, 2026-12-07; a held-out run stopped there, not kept), and auto took fp32 from under a
   2x faster bf16 step.
``probe`` also times a one-row forward at widths 1..K+1 on a KV cache in each candidate dtype (t(w)/t(1), for the
report). The probe and its rule are recorded on the model (``draftsmith_kernels``) and in benchmark results.
Losslessness is then checked against the target in the dtype chosen (eval/bench/precision.py: noise-aware below fp32).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from models.core.cpu import cpu_features
from models.core.hf_compat import cache_kwargs

CANDIDATES = ("float32", "bfloat16")
_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROUNDS = 5  # interleaved rounds of the confirming measurement
MARGIN = 0.10  # bf16's one-token step must be at least this much faster than fp32's (median round ratio <= 0.9)


@torch.no_grad()
def time_forward(model: PreTrainedModel, widths: Sequence[int], prefix_len: int = 128, reps: int = 3,
                 seed: int = 0) -> dict[int, float]:
    """Seconds of one row's forward of w tokens on a KV cache of ``prefix_len`` entries, for each w (the fastest of
    ``reps`` after one untimed: on a shared machine noise only ever adds time)."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    vocab, device = model.config.vocab_size, model.device
    cache = DynamicCache()
    model(torch.randint(vocab, (1, prefix_len), generator=g).to(device), use_cache=True, logits_to_keep=1,
          **cache_kwargs(model, cache))
    out = {}
    for w in sorted(set(widths)):
        x = torch.randint(vocab, (1, w), generator=g).to(device)
        best = float("inf")
        for r in range(reps + 1):
            t = time.perf_counter()
            model(x, use_cache=True, **cache_kwargs(model, cache))
            dt = time.perf_counter() - t
            cache.crop(-w)
            if r:
                best = min(best, dt)
        out[w] = best
    return out


def probe(model: PreTrainedModel, widths: Sequence[int] = (1, 2, 3, 4, 5, 6), prefix_len: int = 128,
          reps: int = 3, dtypes: Sequence[str] = CANDIDATES, rounds: int = ROUNDS) -> dict:
    """t(w) per candidate dtype (a cast copy of ``model`` for each dtype it is not in), t(w)/t(1), and the dtype
    ``target.dtype=auto`` takes by the module's rule: bf16 only on a CPU with native bf16 whose interleaved
    confirming rounds (``confirm_bf16``) beat fp32 by ``MARGIN``; otherwise fp32. ``rule`` says which held."""
    copies = {name: model if model.dtype == _DTYPE[name] else cast_copy(model, _DTYPE[name]) for name in dtypes}
    per: dict[str, dict] = {}
    for name, m in copies.items():
        times = time_forward(m, widths, prefix_len, reps)
        per[name] = {"t_s": {w: round(t, 6) for w, t in times.items()},
                     "t_over_t1": {w: round(t / times[min(times)], 3) for w, t in times.items()}}
    native = native_bf16()
    confirm = None
    if native and {"float32", "bfloat16"} <= set(copies):
        confirm = confirm_bf16(copies["float32"], copies["bfloat16"], prefix_len, rounds, reps)
    del copies
    chosen, rule = choose_dtype(native, confirm)
    return {"machine": cpu_features(), "prefix_len": prefix_len, "reps": reps, "threads": torch.get_num_threads(),
            "dtypes": per, "native_bf16": native, "confirm": confirm, "chosen": chosen, "rule": rule}


def confirm_bf16(fp32: PreTrainedModel, bf16: PreTrainedModel, prefix_len: int = 128, rounds: int = ROUNDS,
                 reps: int = 3) -> dict:
    """The one-token step of each dtype timed in ``rounds`` interleaved rounds (fp32 first in even rounds, bf16 in
    odd ones), each the fastest of ``reps``; per round bf16's time over fp32's, and the median of those ratios."""
    from models.core import gemv
    from models.core.packed import use_linears

    # bf16 on its fastest linears here: the GEMV where it runs (models/core/gemv.py), as a compiled step would
    bf16_linears = "gemv" if gemv.unavailable() is None else "packed"
    t: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    models = {"float32": fp32, "bfloat16": bf16}
    for r in range(rounds):
        for name in (("float32", "bfloat16") if r % 2 == 0 else ("bfloat16", "float32")):
            with use_linears(bf16_linears if name == "bfloat16" else "packed"):
                t[name].append(time_forward(models[name], (1,), prefix_len, reps, seed=r)[1])
    ratios = [b / f for b, f in zip(t["bfloat16"], t["float32"])]
    return {"rounds": rounds, "margin": MARGIN, "t1_s": {n: [round(x, 6) for x in v] for n, v in t.items()},
            "bf16_over_fp32": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3),
            "bf16_linears": bf16_linears}


def choose_dtype(native: bool, confirm: dict | None) -> tuple[str, str]:
    """The module's rule: (dtype, why), from the CPU's native bf16 and ``confirm_bf16``'s rounds."""
    if not native:
        return "float32", "fp32: the CPU has no native bf16 dot product (avx512_bf16 / amx_bf16)"
    if confirm is None:
        return "float32", "fp32: bf16 was not measured"
    ratio, n = confirm["median_ratio"], confirm["rounds"]
    if ratio <= 1 - MARGIN:
        return "bfloat16", f"bf16: native, and its one-token step took {ratio:.2f}x fp32's (median of {n} rounds)"
    return "float32", (f"fp32: bf16 is native, but its one-token step took {ratio:.2f}x fp32's (median of {n} "
                       f"rounds), not the {1 - MARGIN:.2f}x or less that would confirm it")


def read_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes per second this process reads from memory on torch's current threads: the fastest of ``reps`` sums
    over a float32 buffer far larger than the caches, the one streaming pass over the weights that plain decoding
    makes per token."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()  # untimed: page faults
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best


def weight_bytes(model: PreTrainedModel, linears: str | None = None) -> int:
    """Bytes of weights one decoding step reads: every parameter once (a tied embedding and lm_head are one
    matrix), less an untied input embedding, of which a step reads one row. An fp32 head (models/core/packed.py
    ``Fp32Head``) holds two copies of the head and a step reads one: the fp32 copy, or the bf16 weight where the
    step's ``linears`` are the GEMV's, which computes fp32 logits from it."""
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if hasattr(head, "weights_read"):  # an fp32 head: models/core/packed.py Fp32Head
        read, unread = head.weights_read(linears)
        params.pop(unread.data_ptr(), None)
        params[read.data_ptr()] = read.numel() * read.element_size()
        if emb is not None and emb.weight.data_ptr() not in (read.data_ptr(), unread.data_ptr()):
            params.pop(emb.weight.data_ptr(), None)
        return sum(params.values())
    if emb is not None and (head is None or emb.weight.data_ptr() != head.weight.data_ptr()):
        params.pop(emb.weight.data_ptr(), None)
    return sum(params.values())


def bandwidth_bound(model: PreTrainedModel, reps: int = 5, linears: str | None = None) -> dict:
    """The memory-bandwidth ceiling of plain decoding here: measured read bandwidth / the weight bytes a step
    reads (KV-cache reads and compute left out, so no AR run can beat it; ``linears``: the step's kernel)."""
    bw, n = read_bandwidth(reps=reps), weight_bytes(model, linears)
    return {"read_GB_per_s": round(bw / 1e9, 2), "weight_MB": round(n / 1e6, 1),
            "ar_tokens_per_s_bound": round(bw / n, 1), "threads": torch.get_num_threads()}


def native_bf16() -> bool:
    """Whether the CPU has a bf16 dot product (AVX-512 BF16 or AMX in /proc/cpuinfo's flags) that torch's oneDNN
    runs bf16 on (``torch.ops.mkldnn._is_mkldnn_bf16_supported``), so that bf16 GEMMs beat fp32 ones."""
    if not {"avx512_bf16", "amx_bf16"} & set(cpu_features()["flags"]):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: the flags alone
        return True


def cast_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of ``model`` in ``dtype`` (the original keeps its weights: a bf16 round trip would round them)."""
    import copy

    return copy.deepcopy(model).to(dtype)


def resolve_auto_dtype(model: PreTrainedModel) -> PreTrainedModel:
    """``target.dtype=auto``: ``model`` (loaded in fp32) in the dtype the module's rule chooses (bf16 only with a
    native bf16 dot product confirmed faster than fp32 by ``MARGIN`` over ``ROUNDS`` interleaved rounds, else
    fp32), the probe on it."""
    result = probe(model)
    chosen = result["chosen"]
    if model.dtype != _DTYPE[chosen]:
        model = model.to(_DTYPE[chosen])
    model.draftsmith_kernels = result
    t1 = {n: f"{d['t_s'][1] * 1e3:.1f} ms" for n, d in result["dtypes"].items()}
    print(f"target.dtype=auto: {result['rule']} (one-token step {t1}; CPU flags {result['machine']['flags']})",
          flush=True)
    return model

