"""The target's decoding steps over a fixed-capacity KV cache, compiled once per query width (gpt-fast's approach).

The harness's eager one-token step spends a third of its time outside the weights: small ops and Python across the
decoder layers, and a cache that changes shape every step. A cache of fixed capacity gives every step of a width the
same shapes, so ``torch.compile(fullgraph=True, dynamic=False)`` traces it once and fuses the small ops between the
linears (scripts/compile_probe.py, SmolLM2 fp32 on an AVX2 EPYC, one thread: 98 ms a token eager, 67 compiled).

- ``StaticDecoding`` (one per target, ``FrozenTarget.static``): the capacity, the compiled step, the widths traced so
  far and their compile seconds, and the hooks that record the hidden states a drafter asks for (hooks registered
  before tracing are traced with the model; registering one per call, as the eager path does, would retrace).
- ``StaticKV``: the cache of one decode, with what the decoding ladder needs of a cache: ``get_seq_length`` as a host
  int (no device read), ``crop``, and ``layers`` whose ``keys``/``values`` are the full-capacity buffers (the ladder's
  tree commit gathers by absolute index). transformers' ``StaticCache`` underneath writes a forward's W entries at its
  running length and masks every column past each query's own index, so entries past the length (rejected drafts,
  padding) are never seen and are overwritten by the next forward.

Widths: a forward of w <= ``WIDTHS[-1]`` query rows is right-padded to the smallest bucket >= w, so a chain of K
drafts traces one width for all its rounds, the budget-cut last ones included. Eval adds each chain's own K + 1 to
the buckets, since padding rows are not free (the verify costs in results.md). The padding rows come after the real
ones (a causal or tree mask: no real row sees them) and the length is set back to start + w after the call. Longer
forwards (prefill, a teacher-forced check) run eagerly into the same cache.

Sliding-window targets (Gemma-2/3, Mistral) keep every entry on every layer here as in the eager engine
(``static_cache``; the window lives in the mask). Batches of several rows keep the eager engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import Cache, StaticLayer

from models.core.hf_compat import cache_kwargs, sliding_window_of
from models.core.packed import prepare_gemv, use_linears

log = logging.getLogger(__name__)

WIDTHS = (1, 8, 16)  # query-width buckets: AR, chains up to K=7, small trees; each traced once, on first use
RECOMPILE_LIMIT = 64
CAPACITY_STEP = 256  # capacities are multiples of this: a longer decode retraces once per step, not per token
# inductor's per-call checks of every kernel's output sizes and alignment: ~580 Python calls a SmolLM2 step, ~1.5 ms
# of ~20 (scripts/compile_probe.py --profile); the custom ops' fake impls are tested against the real ones instead
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
_serials = itertools.count()


def frozen_weight_guards(entries) -> list[bool]:
    """torch.compile's ``guard_filter_fn``: keep every guard except those on the frozen model's modules and
    weights (~6,000 a SmolLM2 step, 2.4 ms of Python before each call). The target never changes under a trace; which
    model a trace belongs to is still guarded, by ``StaticDecoding.serial``."""
    return [not (isinstance(e.value, nn.Parameter)
                 or (e.orig_guard.source is not None and e.orig_guard.source.is_unspecialized_nn_module()))
            for e in entries]


def round_up(n: int, step: int = CAPACITY_STEP) -> int:
    return -(-int(n) // step) * step


def bucket(width: int, widths: Sequence[int] = WIDTHS) -> int | None:
    """The padded width a forward of ``width`` query rows runs at, or None (eager: prefill-sized)."""
    return next((b for b in widths if b >= width), None)


def static_unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot decode over a static cache here, or None."""
    if getattr(model.config, "is_encoder_decoder", False):
        return "it is an encoder-decoder"
    return None


def static_cache(config, capacity: int) -> Cache:
    """transformers' static cache of ``capacity`` entries a layer; a sliding-window target's sliding layers too keep
    every entry (transformers' own sliding static layer is a ring of ``window`` entries, which a rejected draft would
    overwrite for good), and the window lives in the mask, as in the eager engine (eval/decode/window.py): the model
    builds it for chains, ``apply_window`` writes it into a tree's."""
    if sliding_window_of(config) is None:
        return StaticCache(config=config, max_cache_len=capacity)
    n = config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(n)])


class StaticDecoding:
    """The compiled step of one target. ``backend``: torch.compile's (``inductor`` generates fused kernels; ``eager``
    only traces, which checks the step is one graph in seconds) or None (the same cache and padding, not traced).
    ``linears``: which kernel the step's packed linears call: oneDNN's packed GEMM (``packed``), F.linear,
    inductor's own (``plain``), or the streamed bf16 GEMV (``gemv``; models/core/packed.py ``LINEARS``).
    ``hook_module(k)`` → the module whose output is hidden state k."""

    def __init__(self, model: PreTrainedModel, hook_module: Callable[[int], nn.Module], capacity: int = 1024,
                 backend: str | None = "inductor", linears: str = "packed", widths: Sequence[int] = ()):
        why = static_unsupported(model)
        if why is not None:
            raise ValueError(f"decode_step: {type(model).__name__} cannot decode over a static cache: {why}; "
                             "use decode_step=eager")
        self.model, self.hook_module, self.backend, self.linears = model, hook_module, backend, linears
        if linears == "gemv" and not prepare_gemv(model) and not _has_blocked(model):
            raise ValueError("linears=gemv: the target has no bf16 linears the GEMV kernel can run here "
                             "(models/core/gemv.py)")
        self.capacity = round_up(capacity)
        # WIDTHS and the run's chain widths (K + 1 rows): a chain verifies unpadded, its budget-cut rounds pad to it
        self.widths = tuple(sorted({*WIDTHS, *(int(w) for w in widths if 1 <= int(w) <= WIDTHS[-1])}))
        self.captured: dict[int, Tensor] = {}
        self.hooked: set[int] = set()
        self.handles: list = []
        self.compile_s: dict[str, float] = {}  # trace (width, mask or not, hidden ids) → its first call's seconds
        self.cache_kw = next(iter(cache_kwargs(model, None)))
        # every instance traces StaticDecoding.forward, one code object: the serial, read in the trace, is guarded,
        # so one target's traces never run another's weights (the filter drops the guards on the weights themselves)
        self.serial = next(_serials)
        options = {"guard_filter_fn": frozen_weight_guards, **(INDUCTOR_OPTIONS if backend == "inductor" else {})}
        self.step = (self.forward if backend is None
                     else torch.compile(self.forward, backend=backend, fullgraph=True, dynamic=False,
                                        options=options))
        # one trace per (width bucket, mask or not, hidden ids): a benchmark of several methods needs ~10, and past
        # the limit torch would run the step eagerly without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    def new_cache(self, need: int = 0) -> StaticKV:
        """An empty cache for one decode of up to ``need`` tokens (prompt + generated + one round's nodes)."""
        if need > self.capacity:
            log.warning("static KV cache: %d tokens needed, capacity %d: growing to %d (the step is traced again)",
                        need, self.capacity, round_up(need))
            self.capacity = round_up(need)
        return StaticKV(self, static_cache(self.model.config, self.capacity), self.capacity)

    def hook(self, layer_ids: Sequence[int]) -> None:
        """Record hidden states ``layer_ids`` into ``captured`` on every forward (installed once per id)."""
        for k in layer_ids:
            if k in self.hooked:
                continue

            def record(_m, _inp, out, k=k):
                self.captured[k] = out[0] if isinstance(out, tuple) else out
            self.handles.append(self.hook_module(k).register_forward_hook(record))
            self.hooked.add(k)

    def close(self) -> None:
        """Remove the hooks (a target given another static step, or none)."""
        for h in self.handles:
            h.remove()
        self.handles, self.hooked = [], set()

    def forward(self, ids: Tensor, pos: Tensor, mask: Tensor | None, kv: StaticCache, layer_ids: tuple[int, ...],
                logits_to_keep: int = 0) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The traced step (and, called directly, the eager forward of longer widths): logits [1, W, V] (the last
        ``logits_to_keep`` only, when given) and the hidden states ``layer_ids`` [1, W, H] of one forward."""
        if self.serial < 0:  # never: the read is what guards a trace to this instance (``frozen_weight_guards``)
            raise AssertionError("StaticDecoding.serial")
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=logits_to_keep, **{self.cache_kw: kv})
        return out.logits, tuple(self.captured[k] for k in layer_ids)

    def run(self, ids: Tensor, pos: Tensor, mask: Tensor | None, kv: StaticCache,
            layer_ids: tuple[int, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        self.hook(layer_ids)
        self.captured.clear()  # the traced step always starts from an empty record (no guard on its contents)
        trace = f"w{ids.shape[1]}" + ("" if mask is None else "+mask") + "".join(f"/{k}" for k in layer_ids)
        with use_linears(self.linears):  # a guard of the traces: each setting has its own
            if trace in self.compile_s:
                return self.step(ids, pos, mask, kv, layer_ids)
            t = time.perf_counter()  # the first call of a trace: tracing and compiling, timed for the results
            out = self.step(ids, pos, mask, kv, layer_ids)
        self.compile_s[trace] = round(time.perf_counter() - t, 2)
        return out


def _has_blocked(model: nn.Module) -> bool:
    return any(getattr(m, "blocked", None) is not None for m in model.modules())


class StaticKV:
    """One decode's KV cache over ``StaticDecoding``'s capacity (B=1); the ladder's cache interface."""

    def __init__(self, decoding: StaticDecoding, kv: StaticCache, capacity: int):
        self.decoding, self.kv, self.capacity, self.length = decoding, kv, capacity, 0

    @property
    def layers(self) -> list:
        return self.kv.layers

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` entries (negative: drop that many), as ``DynamicCache.crop``."""
        self.set_length(self.length + max_length if max_length < 0 else min(max_length, self.length))

    def set_length(self, n: int) -> None:
        self.length = n
        for layer in self.kv.layers:  # where the next forward writes, and what the causal mask offsets by
            if layer.is_initialized:
                layer.cumulative_length.fill_(n)

    def batch_select_indices(self, indices: Tensor) -> None:
        if indices.numel() != 1 or int(indices[0]) != 0:
            raise ValueError("a static KV cache holds one row; batched decoding uses the eager engine")

    def forward(self, input_ids: Tensor, layer_ids: Sequence[int], attention_mask: Tensor | None,
                position_ids: Tensor | None, logits_to_keep: int = 0) -> tuple[Tensor, dict[int, Tensor]]:
        """One forward of ``input_ids`` [1, w] written at the cache's length: (logits [1, w or logits_to_keep, V],
        {id: [1, w, H]}). ``attention_mask``: None (causal) or the ladder's additive [1, 1, w, length + w] (trees)."""
        b, w = input_ids.shape
        start = self.length
        if b != 1:
            raise ValueError(f"a static KV cache holds one row, got a forward of {b} rows")
        width = bucket(w, self.decoding.widths)
        if start + (width or w) > self.capacity:
            raise ValueError(f"static KV cache full: {start} + {width or w} entries past its capacity "
                             f"{self.capacity}; ask new_cache for the decode's full length")
        device, ids = input_ids.device, tuple(layer_ids)
        if position_ids is None:
            position_ids = torch.arange(start, start + w, device=device)[None]
        if width is None:  # prefill-sized: eager, through the same hooks (one more hook per call would retrace)
            self.decoding.hook(ids)
            logits, states = self.decoding.forward(input_ids, position_ids, self.full_mask(attention_mask, start, w, w),
                                                   self.kv, ids, logits_to_keep)
        else:
            pad = width - w
            padded = F.pad(input_ids, (0, pad))
            pos = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, pad + 1, device=device)], 1)
            logits, states = self.decoding.run(padded, pos, self.full_mask(attention_mask, start, w, width), self.kv,
                                               ids)
            logits = logits[:, w - logits_to_keep : w] if logits_to_keep else logits[:, :w]
            states = tuple(h[:, :w] for h in states)
        self.set_length(start + w)
        return logits, dict(zip(ids, states))

    def full_mask(self, mask: Tensor | dict | None, start: int, w: int, width: int) -> Tensor | dict | None:
        """The ladder's additive mask [1, 1, w, start + w] over the whole capacity and ``width`` rows: columns past
        start + w hidden; a padding row sees the prefix, the root and itself (a finite softmax). A dict (a
        sliding-window target's masks by layer type: eval/decode/window.py) is widened mask by mask. None stays None:
        transformers' causal mask over the static cache is exact for chains."""
        if mask is None:
            return None
        if isinstance(mask, dict):
            return {kind: self.full_mask(m, start, w, width) for kind, m in mask.items()}
        low = torch.finfo(mask.dtype).min
        full = torch.full((1, 1, width, self.capacity), low, dtype=mask.dtype, device=mask.device)
        full[:, :, :w, : start + w] = mask
        if width > w:
            pad = torch.arange(w, width, device=mask.device)
            full[:, :, w:, : start + 1] = 0
            full[0, 0, pad, start + pad] = 0
        return full
