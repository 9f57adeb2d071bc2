"""models/core/gemv.py: the streamed bf16 GEMV (``draftsmith::bf16_linear``) and the linears that call it.

The kernel runs only on a CPU with AVX-512 BF16 (it is built there on first use); its tests say so and skip
elsewhere. What must hold everywhere (the race leaves it out, a step asking for it fails clearly) is tested on
every machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.core import gemv
from models.core import packed as packed_mod
from models.core.packed import Fp32Head, PackedLinear, pack_linears, prepare_gemv, use_linears
from tests.conftest import make_tiny_llama

WHY = gemv.unavailable()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"the GEMV kernel cannot run here: {WHY}")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """An fp64 GEMM over the same bf16 values: what the kernel's fp32 sums approximate."""
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 2), (15, 7), (16, 64), (17, 33), (128, 40), (200, 576), (300, 41)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
def test_the_kernel_is_an_fp32_gemm_over_the_same_bf16_values(n, k, m):
    """Every edge: rows not a multiple of 16, odd columns, x tiles of 8 and their tails, with and without a bias;
    the fp32 output within fp32 summation error of the exact product, the bf16 output that rounded."""
    g = torch.Generator().manual_seed(n * 100 + k * 10 + m)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    for bias in (None, b):
        ref = _reference(x, w, bias)
        got = torch.ops.draftsmith.bf16_linear(x, gemv.block(w), bias, n, True)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), ref, atol=1e-5 * (1 + ref.abs().max().item()), rtol=1e-5)
        half = torch.ops.draftsmith.bf16_linear(x, gemv.block(w), bias, n, False)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), got, atol=1e-6, rtol=2 ** -8)  # one bf16 rounding of the sums


@needs_kernel
def test_the_kernel_keeps_leading_dims_and_refuses_a_weight_it_was_not_given():
    w, x = torch.randn(40, 24).bfloat16(), torch.randn(1, 3, 24).bfloat16()
    got = torch.ops.draftsmith.bf16_linear(x, gemv.block(w), None, 40, False)
    assert got.shape == (1, 3, 40)
    wide = torch.randn(1, 3, 48).bfloat16()
    wide[..., :24] = x
    strided = torch.ops.draftsmith.bf16_linear(wide[..., :24], gemv.block(w), None, 40, False)  # not contiguous
    one = torch.ops.draftsmith.bf16_linear(x[0, 1], gemv.block(w), None, 40, False)  # a bare vector
    assert torch.equal(strided, got) and one.shape == (40,) and torch.equal(one, got[0, 1])
    with pytest.raises(RuntimeError, match="blocked"):
        torch.ops.draftsmith.bf16_linear(x, w, None, 40, False)  # not laid out by gemv.block
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.draftsmith.bf16_linear(torch.randn(1, 20).bfloat16(), gemv.block(w), None, 40, False)


@needs_kernel
def test_packed_linears_and_the_fp32_head_call_it_for_few_rows_only():
    """Under ``use_linears("gemv")`` a prepared bf16 linear calls the kernel for up to MAX_ROWS rows and oneDNN past
    them; the fp32 head computes fp32 logits from the bf16 weight (the fp32 copy's products, other sums)."""
    lin = PackedLinear(nn.Linear(64, 48).bfloat16().requires_grad_(False))
    head = Fp32Head(nn.Linear(64, 300, bias=False).bfloat16().requires_grad_(False))
    model = nn.Sequential(lin, nn.Linear(48, 64).bfloat16(), head)
    assert prepare_gemv(model) == 2 and prepare_gemv(model) == 0  # the plain nn.Linear is not a packed one
    few, many = torch.randn(1, 5, 64).bfloat16(), torch.randn(1, gemv.MAX_ROWS + 1, 64).bfloat16()
    with torch.no_grad():
        onednn, onednn_many = lin(few), lin(many)
        with use_linears("gemv"):
            assert torch.equal(lin(few), torch.ops.draftsmith.bf16_linear(few, lin.blocked, lin.bias, 48, False))
            assert torch.equal(lin(many), onednn_many)  # a prefill's rows: oneDNN's kernel
            logits = head(few)
        torch.testing.assert_close(lin(few), onednn)  # the default kernel again outside the block
        lin.weight.mul_(2)  # a changed weight: laid out again before the next GEMV call
        with use_linears("gemv"):
            torch.testing.assert_close(lin(few).float(), 2 * onednn.float() - lin.bias.float(), atol=6e-2, rtol=2e-2)
        lin.weight.div_(2)
        torch.testing.assert_close(lin(few).float(), F.linear(few, lin.weight, lin.bias).float(), atol=3e-2,
                                   rtol=1e-2)
        fp32 = head(few)
    assert logits.dtype == fp32.dtype == torch.float32
    torch.testing.assert_close(logits, fp32, atol=1e-5, rtol=1e-5)
    tied = Fp32Head(PackedLinear(nn.Linear(64, 300, bias=False).bfloat16().requires_grad_(False)))
    assert prepare_gemv(tied) == 1 and tied.blocked is tied.head.blocked  # one laid-out copy of the head


@needs_kernel
def test_a_compiled_step_on_the_gemv_keeps_the_op_and_decodes_ar_tokens():
    """The compiled static step with ``linears="gemv"``: its graph holds the op (inductor keeps it as one extern
    call), and greedy decoding of a bf16 target with an fp32 head emits the eager step's tokens."""
    from eval.bench.decode_step import choose_decode_step
    from eval.decode.single import decode_ar
    from models.core.packed import fp32_logits
    from models.core.target import FrozenTarget

    model = make_tiny_llama(64, layers=2, hidden=32, seed=3).bfloat16()
    pack_linears(model)
    fp32_logits(model)
    t = FrozenTarget(model)
    prompt = torch.tensor([[3, 9, 4, 17]])
    ref = decode_ar(t, prompt, 12).tokens
    seen = []

    def record(gm, _inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    torch._dynamo.reset()
    t.use_static(200, record, linears="gemv")
    assert decode_ar(t, prompt, 12).tokens == ref
    calls = seen.count(torch.ops.draftsmith.bf16_linear)  # q/k/v, o, gate/up, down a layer and the head, a trace
    assert calls and calls % (2 * 4 + 1) == 0 and F.linear not in seen
    traces = len(seen)
    assert decode_ar(t, prompt, 12).tokens == ref and len(seen) == traces  # the groups' record adds no retrace
    t.use_eager()
    try:
        rec = choose_decode_step(t, "compiled", 200, prefix_len=16, backend="eager")
        assert rec["compiled_gemv_ms"] > 0 and t.static.linears == rec["linears"]
        assert packed_mod.LINEARS == ("gemv" if rec["linears"] == "gemv" else "packed")  # eager calls follow it
        assert decode_ar(t, prompt, 12).tokens == ref
    finally:
        packed_mod.set_default_linears("packed")
        t.use_eager()


def test_where_the_kernel_cannot_run_the_race_leaves_it_out_and_a_step_asking_for_it_fails(monkeypatch):
    from eval.bench.decode_step import linear_kinds
    from models.core.static_kv import StaticDecoding

    monkeypatch.setattr(gemv, "unavailable", lambda: "the CPU has no avx512_bf16")
    model = make_tiny_llama(64, layers=2, hidden=32, seed=3).bfloat16()
    if not pack_linears(model) or not packed_mod.packs(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linears on this CPU")
    assert linear_kinds(model) == ["packed", "plain"]
    with pytest.raises(ValueError, match="linears=gemv"):
        StaticDecoding(model, lambda k: model.model.layers[k], 200, None, linears="gemv")
    with pytest.raises(ValueError, match="linears='fast'"):
        with use_linears("fast"):
            pass


def test_weight_bytes_count_the_head_copy_a_step_reads():
    """An fp32 head holds the fp32 copy and the bf16 weight: eager steps read the first, the GEMV the second."""
    from models.core.kernels import weight_bytes
    from models.core.packed import fp32_logits

    model = make_tiny_llama(64, layers=2, hidden=32, seed=3).bfloat16()
    body = weight_bytes(model)  # untied: the bf16 head counted, the input embedding (one row read) not
    head = model.lm_head.weight
    fp32_logits(model)
    assert weight_bytes(model) == body + head.numel() * 2  # its fp32 copy instead of the bf16 one
    model.lm_head.blocked = gemv.block(head)  # what prepare_gemv sets where the kernel runs
    assert weight_bytes(model, "gemv") == body and weight_bytes(model) == body + head.numel() * 2


def test_pooled_copies_share_one_buffer_in_order_and_aligned():
    """``pooled``: the same values, in the given order, end to end in one storage, each on a cache line and the
    buffer's huge-page part 2 MiB-aligned (what madvise can back); mixed sizes and dtypes."""
    ts = [torch.randn(3, 5).bfloat16(), torch.randn(1000, 600).bfloat16(), torch.randn(7), torch.randn(2, 2, 16, 2)]
    out = gemv.pooled(ts)
    assert all(torch.equal(a, b) and a.shape == b.shape and a.dtype == b.dtype for a, b in zip(ts, out))
    storage = {o.untyped_storage().data_ptr() for o in out}
    assert len(storage) == 1
    ptrs = [o.data_ptr() for o in out]
    assert ptrs == sorted(ptrs) and all(p % 64 == 0 for p in ptrs) and ptrs[0] % gemv.HUGE_PAGE == 0
    assert ptrs[1] - ptrs[0] == 64  # 30 bytes padded to a cache line, no more
    out[1].zero_()
    assert not torch.equal(out[1], ts[1]) and torch.equal(out[2], ts[2])  # copies, not views of the inputs


@needs_kernel
def test_prepare_gemv_lays_every_weight_in_one_buffer_and_keeps_the_outputs():
    """A prepared model's laid-out weights (a tied fp32 head's included, once) sit in one pooled buffer, in module
    order, and the GEMV gives the same outputs as from separately laid-out weights."""
    model = make_tiny_llama(64, layers=2, hidden=32, seed=3).bfloat16()
    pack_linears(model)
    lins = [m for m in model.modules() if isinstance(m, PackedLinear)]
    xs = [torch.randn(1, 3, m.in_features).bfloat16() for m in lins]

    def outputs(weights):
        return [torch.ops.draftsmith.bf16_linear(x, w, None, m.out_features, False)
                for x, w, m in zip(xs, weights, lins)]
    with torch.no_grad():
        alone = outputs([gemv.block(m.weight) for m in lins])
        assert prepare_gemv(model) == len(lins)
        again = outputs([m.blocked for m in lins])
    assert all(torch.equal(a, b) for a, b in zip(alone, again))
    assert len({m.blocked.untyped_storage().data_ptr() for m in lins}) == 1
    ptrs = [m.blocked.data_ptr() for m in lins]
    assert ptrs == sorted(ptrs)


@needs_kernel
def test_sibling_linears_run_as_one_call_and_match_their_own():
    """q/k/v and gate/up (sizes off the 16-row blocks, biases on some) as one ``LinearGroup`` call: each member's
    output equals its own GEMV; a member given another input computes anew; the record is empty after a round."""
    from models.core.packed import LinearGroup

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(64, 40), nn.Linear(64, 24, bias=False)
            self.v_proj = nn.Linear(64, 24)

    attn = Attn().bfloat16().requires_grad_(False)
    pack_linears(attn)
    assert prepare_gemv(attn) == 3
    group = attn.q_proj.group
    assert isinstance(group, LinearGroup) and attn.k_proj.group is attn.v_proj.group is group
    x, other = torch.randn(1, 2, 64).bfloat16(), torch.randn(1, 2, 64).bfloat16()
    own = {n: torch.ops.draftsmith.bf16_linear(x, gemv.block(m.weight), m.bias, m.out_features, False)
           for n, m in attn.named_children()}
    with torch.no_grad(), use_linears("gemv"):
        [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        assert group.x is None and group.out is None  # a whole round leaves no record
        q = attn.q_proj(x)
        assert group.x is x
        k_other = attn.k_proj(other)  # another input: its own output, and a new record for it
        assert group.x is other
        outs = {"q_proj": q, "k_proj": attn.k_proj(x), "v_proj": attn.v_proj(x)}
    for n, out in outs.items():
        assert torch.equal(out, own[n]), n
    torch.testing.assert_close(k_other, F.linear(other, attn.k_proj.weight), atol=3e-2, rtol=1e-2)
    assert all(m.blocked.untyped_storage().data_ptr() == group.blocked.untyped_storage().data_ptr()
               for m in attn.children())  # the members' laid-out weights are views of the group's
    rows = torch.randn(1, gemv.MAX_ROWS + 3, 64).bfloat16()  # a prefill's rows: one oneDNN GEMM for the group
    with torch.no_grad(), use_linears("gemv"):
        grouped = [attn.q_proj(rows), attn.k_proj(rows), attn.v_proj(rows)]
        alone = [torch.ops.mkldnn._linear_pointwise(rows, m._packed_weight(), None if m.bias is None else m.bias,
                                                    "none", [], "") for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    for a, b in zip(grouped, alone):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    assert group.x is None
    with torch.no_grad(), use_linears("gemv"):
        attn.k_proj.weight.mul_(2)  # a changed member leaves the group (its part of the group's copy is stale)
        q2, k2 = attn.q_proj(x), attn.k_proj(x)
    assert attn.k_proj.group is None and attn.q_proj.group is group
    assert torch.equal(q2, own["q_proj"])
    torch.testing.assert_close(k2.float(), 2 * own["k_proj"].float(), atol=3e-2, rtol=1e-2)
