"""The frozen target's linear layers with oneDNN's pre-packed weights (CPU inference).

``F.linear`` on a CPU re-lays out its weight for the GEMM kernel on every call; at decoding's few rows that
costs more than the arithmetic. oneDNN can lay the weight out once (``mkldnn._reorder_linear_weight``) and run
``mkldnn._linear_pointwise`` on it (the same sums, another order: equal to rounding). SmolLM2's shapes, one
thread, Zen 5 with two regeneration processes beside it (``python -m eval.bench.probe --target smollm2 --threads 1
--gemm`` times both on any machine), ms:

| weight | dtype | rows | F.linear | packed |
|---|---|---|---|---|
| MLP 1536×576 | bf16 | 1 / 4 | 0.085 / 0.206 | 0.045-0.066 / 0.056-0.064 |
| lm_head 49152×576 | bf16 | 1 / 4 | 10.8 / 11.4 | 2.4-5.3 / 3.6-4.0 |
| lm_head 49152×576 | fp32 | 1 / 4 | 14.9 / 24.6 | 9.2-10.1 / 6.8-7.6 |

The packed op has no autograd: a call that needs gradients, a weight on another device, or a CPU without oneDNN
takes ``F.linear``. The parameters stay what they were (same names, same tensors: tied embeddings and readers of
``.weight`` see no difference); the packed copy follows them (re-packed when the weight changes) and is never saved
or deep-copied.

Under ``torch.compile`` (models/core/static_kv.py) the packed copy cannot enter the graph: oneDNN's packed tensor is
opaque (no storage), which inductor's lowering refuses, and inductor's own freezing left SmolLM2's bf16 linears
unpacked (``aten::mm``, 42 ms of a 52 ms step against 32 ms packed: scripts/compile_probe.py --profile). So a
compiled step calls ``draftsmith::packed_linear`` on the plain weight, an op inductor keeps as one extern call, and
its kernel looks the packed copy up by the weight (registered by the ``PackedLinear`` that owns it).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from models.core import gemv

BATCH_HINT = 8  # the row count oneDNN lays the weight out for: decoding's rows (best of 1 / 8 / 64 measured)
# which kernel a compiled step's linears call: "packed" (the packed op), "plain" (F.linear, which inductor lowers to
# its own GEMM) or "gemv" (draftsmith::bf16_linear, models/core/gemv.py: bf16 calls of few rows, eager ones too).
# Read while tracing, so each value is a guard of the traces made under it; StaticDecoding sets it around every call
# of its step (eval/bench/decode_step.py races them where they exist: on an AVX2 EPYC in fp32 "plain" was faster)
LINEARS = "packed"
KINDS = ("packed", "plain", "gemv")
# the weight's storage address → its PackedLinear: what the compiled op's kernel reads (weak: a dropped model's
# linears leave it)
_BY_WEIGHT: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the packed copy of ``weight`` its ``PackedLinear`` holds (F.linear when none
    does: a weight the compiled graph received in another tensor). The kernel of ``draftsmith::packed_linear``."""
    owner = _BY_WEIGHT.get(weight.data_ptr())
    w = None if owner is None else owner.weight
    if w is None or w.data_ptr() != weight.data_ptr() or w.dtype != weight.dtype or w.shape != weight.shape:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, owner._packed_weight(), bias, "none", [], "")


# A plain library op, not torch.library.custom_op: the latter's Python wrappers cost several times a small linear's
# GEMM per call (timed once on a Zen 5, one thread), over 211 linears a step
_LIB = torch.library.Library("draftsmith", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", packed_linear, "CPU")


@torch.library.register_fake("draftsmith::packed_linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed: tuple[tuple, torch.Tensor] | None = None
        self.blocked: torch.Tensor | None = None  # the weight laid out for "gemv" (``prepare_gemv``)
        self._blocked_key: tuple | None = None
        self.group: LinearGroup | None = None  # its siblings reading the same input, as one GEMV call
        self.group_index = 0
        _BY_WEIGHT[self.weight.data_ptr()] = self

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), BATCH_HINT))
            _BY_WEIGHT[w.data_ptr()] = self  # a weight moved or cast since (module.to): found at its new address
        return self._packed[1]

    def _blocked_weight(self) -> torch.Tensor | None:
        """The weight laid out for the GEMV, made on first use and again when the weight changes (None where the
        kernel cannot run). A compiled step reads ``blocked`` as ``prepare_gemv`` left it: the target is frozen."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._blocked_key != key and gemv.unavailable() is None:
            self.blocked, self._blocked_key, self.group = gemv.block(w), key, None  # the group's copy is stale
        return self.blocked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (w.device.type != "cpu" or x.dtype != w.dtype or not packs(w.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, self.bias)
        b = None if self.bias is None else self.bias.detach()
        compiling = torch.compiler.is_compiling()
        if LINEARS == "gemv":
            few = gemv.fits(x, w)
            blocked = self.blocked if compiling else self._blocked_weight()  # eager: laid out anew if changed
            # the group: the GEMV at few rows; eager, a prefill's rows too (one oneDNN GEMM over the siblings)
            if self.group is not None and (few or not compiling):
                return self.group(x, self.group_index)
            if few and blocked is not None:
                return torch.ops.draftsmith.bf16_linear(x, blocked, b, self.out_features, False)
        if torch.compiler.is_compiling():  # the opaque packed tensor stays out of the graph (module docstring)
            return (torch.ops.draftsmith.packed_linear(x, w, b) if LINEARS != "plain"
                    else F.linear(x, w, self.bias))
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), b, "none", [], "")

    def __getstate__(self):  # deepcopy / pickling: the packed copy is rebuilt on first use
        state = self.__dict__.copy()
        state["_packed"] = state["blocked"] = state["_blocked_key"] = state["group"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        _BY_WEIGHT[self.weight.data_ptr()] = self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _mkldnn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


MKLDNN_BF16 = _mkldnn_bf16()  # a fact of the machine, read once: a compiled step can test it without a torch call


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs this dtype's packed linear on this CPU: fp32 always, bf16 where oneDNN says it has a bf16
    path (an AVX2-only CPU has none, and the op would fail there)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and MKLDNN_BF16)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"linears={kind!r} not understood; use one of {list(KINDS)}")


@contextlib.contextmanager
def use_linears(kind: str):
    """``LINEARS`` set to ``kind`` for the traces and calls within (then as it was)."""
    global LINEARS
    _check_kind(kind)
    before, LINEARS = LINEARS, kind
    try:
        yield
    finally:
        LINEARS = before


def prepare_gemv(model: nn.Module) -> int:
    """Lay out every bf16 packed linear's weight (and an fp32 head's bf16 weight) for ``linears="gemv"``; how many
    (0 where the kernel cannot run here: models/core/gemv.py says why)."""
    if gemv.unavailable() is not None:
        return 0
    laid: list[nn.Module] = []
    for m in model.modules():
        w = m.weight if isinstance(m, (PackedLinear, Fp32Head)) else None
        if w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu" or m.blocked is not None:
            continue
        if isinstance(m, PackedLinear):
            m._blocked_weight()
        else:  # an fp32 head shares the layout of the bf16 head it wraps (one copy of the largest weight)
            m.blocked = m.head._blocked_weight() if isinstance(m.head, PackedLinear) else gemv.block(w)
        laid.append(m)
    groups = _group_siblings(model, laid)
    # one buffer on huge pages, in the modules' order (a decoder's: the order a step reads them); a group's members
    # as its one concatenation, shared copies once
    roots = {}
    for m in laid:
        t = m.group.blocked if isinstance(m, PackedLinear) and m.group is not None else m.blocked
        roots.setdefault(t.data_ptr(), t)
    moved = dict(zip(roots, gemv.pooled(list(roots.values()))))
    for g in groups:
        g.set_blocked(moved[g.blocked.data_ptr()])
    for m in model.modules():  # the others, and those sharing a copy (an fp32 head's bf16 head)
        if (isinstance(m, (PackedLinear, Fp32Head)) and m.blocked is not None and m.blocked.data_ptr() in moved
                and getattr(m, "group", None) is None):
            m.blocked = moved[m.blocked.data_ptr()]
    return len(laid)


# children of one module that read the same input (a decoder's attention and MLP, by transformers' names)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _group_siblings(model: nn.Module, laid: list[nn.Module]) -> list[LinearGroup]:
    """Join each set of ``SIBLINGS`` among the laid-out linears into a ``LinearGroup``."""
    ready = {id(m) for m in laid}
    groups = []
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if (all(isinstance(m, PackedLinear) and id(m) in ready and m.group is None for m in members)
                    and len({m.in_features for m in members}) == 1):
                groups.append(LinearGroup(members))
    return groups


class LinearGroup:
    """Sibling linears that read the same input (q/k/v, gate/up) as one GEMV call: a third of a decoder layer's calls,
    and longer streams per call. Each member's laid-out weight is a whole number of 16-row blocks, so their
    concatenation is laid out too, and each member's ``blocked`` becomes a view of it. The first member called with an
    input computes every member's output and keeps it; a member called with that same tensor (``is``) takes its
    slice, with any other input (or a second time) computes anew. The record is dropped once each member took its
    slice, so a compiled step starts and ends with it empty (nothing for Dynamo to guard but None). The input must not
    change in place between its members' calls (a decoder's normed hidden state is a fresh tensor)."""

    def __init__(self, members: list[PackedLinear]):
        self.sizes = [m.out_features for m in members]
        rows = [16 * m.blocked.shape[0] for m in members]
        self.starts = [sum(rows[:i]) for i in range(len(rows))]
        self.n = sum(rows)
        self.members = list(members)  # in order (a reference cycle with them, collected with the model)
        # a prefill's rows: one oneDNN GEMM over the weights end to end (unpadded), packed on first use (no plain
        # copy kept: ``weight`` is the first member's, for the kernel checks)
        self.weight = members[0].weight
        self.dense_starts = [sum(self.sizes[:i]) for i in range(len(members))]
        self.dense_bias = (None if all(m.bias is None for m in members) else torch.cat(
            [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in members]))
        self.packed: torch.Tensor | None = None
        self.bias = None
        if any(m.bias is not None for m in members):  # fp32, zero on each member's padding rows
            self.bias = torch.zeros(self.n)
            for m, start in zip(members, self.starts):
                if m.bias is not None:
                    self.bias[start:start + m.out_features] = m.bias.detach().float()
        for i, m in enumerate(members):
            m.group, m.group_index = self, i
        self.set_blocked(torch.cat([m.blocked for m in members]))
        self.x: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.taken, self.all = 0, (1 << len(members)) - 1  # which members took their slice of ``out`` (bits)

    def set_blocked(self, blocked: torch.Tensor) -> None:
        self.blocked = blocked
        for m in self.members:
            b0 = self.starts[m.group_index] // 16
            m.blocked = blocked[b0:b0 + m.blocked.shape[0]]

    def __call__(self, x: torch.Tensor, i: int) -> torch.Tensor:
        few = gemv.fits(x, self.weight)
        if self.x is not x or self.taken >> i & 1:  # another input, or a member's second call: a new round
            self.x, self.taken = x, 0
            if few:
                self.out = torch.ops.draftsmith.bf16_linear(x, self.blocked, self.bias, self.n, False)
            else:
                if self.packed is None:
                    whole = torch.cat([m.weight.detach() for m in self.members])
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(whole, BATCH_HINT)
                self.out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.dense_bias, "none", [], "")
        start = self.starts[i] if few else self.dense_starts[i]
        out = self.out[..., start:start + self.sizes[i]]
        self.taken |= 1 << i
        if self.taken == self.all:
            self.x = self.out = None
            self.taken = 0
        return out


def set_default_linears(kind: str) -> None:
    """``LINEARS`` outside any ``use_linears`` block: what eager calls of few rows take (a drafter's, in a run
    whose compiled step raced and chose its kernel: eval/bench/decode_step.py)."""
    global LINEARS
    _check_kind(kind)
    LINEARS = kind


def has_packed(model: nn.Module) -> bool:
    """Whether ``model`` has packed linears whose dtype oneDNN packs here (a compiled step could call either GEMM)."""
    return any(isinstance(m, PackedLinear) and packs(m.weight.dtype) for m in model.modules())


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_linears(model: nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` (a frozen target on the CPU) → ``PackedLinear``, in place; how many."""
    if not available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


class Fp32Head(nn.Module):
    """A bf16/fp16 target's output projection computed and returned in fp32: the same weight values (upcast once,
    exactly), the last hidden state upcast per call, fp32 accumulation and fp32 logits. In bf16 the logits themselves
    are rounded to 8 bits of mantissa (0.125 apart at |z| ≈ 20), so greedy argmax ties on rounding; in fp32 it does
    not. ``.weight`` stays the original parameter: readers of it (drafters sharing the target's head) see no
    difference."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        w = head.weight.detach()
        bias = getattr(head, "bias", None)
        fp32 = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=torch.float32)
        fp32.weight = nn.Parameter(w.float(), requires_grad=False)
        if bias is not None:
            fp32.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
        self.proj = PackedLinear(fp32) if available() else fp32
        # the bf16 weight laid out for "gemv": fp32 logits from half the bytes, the same products (models/core/gemv.py)
        self.blocked: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def weights_read(self, linears: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head copy a step reads, the one it does not): the fp32 copy, or the bf16 weight under the GEMV
        (models/core/kernels.py ``weight_bytes``)."""
        fp32, bf16 = self.proj.weight, self.head.weight
        return (bf16, fp32) if linears == "gemv" and self.blocked is not None else (fp32, bf16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if LINEARS == "gemv" and self.blocked is not None and gemv.fits(x, self.head.weight):
            bias = getattr(self.proj, "bias", None)
            return torch.ops.draftsmith.bf16_linear(x, self.blocked, bias, self.proj.out_features, True)
        return self.proj(x.float())


def fp32_logits(model: nn.Module) -> bool:
    """``model``'s output projection → ``Fp32Head`` when the model computes in bf16/fp16 (in place; an fp32 model is
    left as it is). Eval only: training and regeneration keep the model's own head, so their caches stay valid."""
    head = model.get_output_embeddings()
    if head is None or isinstance(head, Fp32Head) or head.weight.dtype in (torch.float32, torch.float64):
        return False
    model.set_output_embeddings(Fp32Head(head))
    return True
