"""models/core/attention.py: the bf16 decoding attention against transformers' SDPA, and the model switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.core import attention, gemv
from models.core.attention import NAME, cpu_gqa_attention, use_cpu_gqa


def _reference(q, k, v, allowed):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                          v.float().repeat_interleave(g, 1), attn_mask=allowed).transpose(1, 2)


@pytest.mark.parametrize("b,c,q", [(1, 40, 1), (3, 33, 5), (2, 17, 16)])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_bf16_decoding_attention_matches_sdpa(b, c, q, mask):
    """Q ≤ 16 rows in bf16: the grouped matmuls agree with fp32 SDPA to bf16 precision, with transformers' three
    mask forms (None = causal, boolean, additive), padding columns included."""
    g = torch.Generator().manual_seed(b * 100 + c + q)
    qh = torch.randn(b, 6, q, 8, generator=g).bfloat16()
    k, v = (torch.randn(b, 2, c, 8, generator=g).bfloat16() for _ in range(2))
    allowed = torch.ones(q, c, dtype=torch.bool).tril(c - q)[None, None].repeat(b, 1, 1, 1)
    if mask != "none":
        allowed[0, :, :, : min(3, c - q)] = False  # left padding of row 0 (each query keeps a column)
    arg = {"none": None, "bool": allowed,
           "float": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).bfloat16()}[mask]
    out, weights = cpu_gqa_attention(None, qh, k, v, arg, scaling=8**-0.5)
    assert weights is None and out.shape == (b, q, 6, 8) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(qh, k, v, allowed), atol=2e-2, rtol=2e-2)


def test_fp32_and_long_queries_go_to_sdpa_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class M(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    g = torch.Generator().manual_seed(0)
    for dtype, q in ((torch.float32, 1), (torch.bfloat16, 17)):
        qh = torch.randn(1, 6, q, 8, generator=g).to(dtype)
        k, v = (torch.randn(1, 2, 20, 8, generator=g).to(dtype) for _ in range(2))
        allowed = torch.ones(q, 20, dtype=torch.bool).tril(20 - q)[None, None]
        ours = cpu_gqa_attention(M(), qh, k, v, allowed)[0]
        assert torch.equal(ours, sdpa_attention_forward(M(), qh, k, v, allowed)[0])


def test_a_bf16_model_decodes_the_same_tokens_with_it(tiny_llama):
    """The tiny Llama in bf16, SDPA against cpu_gqa: greedy decoding with a KV cache gives the same tokens and
    close logits; fp32 models are switched too (their attention is SDPA's)."""
    from models.core.hf_compat import cache_kwargs
    from models.core.kernels import cast_copy

    ref = cast_copy(tiny_llama, torch.bfloat16)
    ours = cast_copy(tiny_llama, torch.bfloat16)
    use_cpu_gqa(ours)
    assert ours.config._attn_implementation == NAME and ref.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11]])
    toks = {}
    with torch.no_grad():
        for name, m in (("sdpa", ref), ("ours", ours)):
            out = m(ids, use_cache=True)
            cache, x, seq, logits = out.past_key_values, out.logits[:, -1:].argmax(-1), [], []
            for _ in range(12):
                o = m(x, use_cache=True, **cache_kwargs(m, cache))
                cache, x = o.past_key_values, o.logits[:, -1:].argmax(-1)
                seq.append(int(x))
                logits.append(o.logits[0, -1].float())
            toks[name] = (seq, torch.stack(logits))
    assert toks["sdpa"][0] == toks["ours"][0]
    torch.testing.assert_close(toks["ours"][1], toks["sdpa"][1], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("mask", ["none", "bool"])
def test_views_of_a_preallocated_buffer_read_the_whole_buffer_masked(mask):
    """K/V handed over as views of the filled columns of larger zero-initialised buffers (the preallocated KV
    cache): attention runs on the contiguous buffers with the extra columns masked, and gives what it gives on
    contiguous copies of the views."""
    from models.core.attention import _whole_buffers

    g = torch.Generator().manual_seed(7)
    b, c, q, cap = 3, 20, 2, 50
    kb, vb = torch.zeros(b, 2, cap, 8).bfloat16(), torch.zeros(b, 2, cap, 8).bfloat16()
    kb[:, :, :c] = torch.randn(b, 2, c, 8, generator=g).bfloat16()
    vb[:, :, :c] = torch.randn(b, 2, c, 8, generator=g).bfloat16()
    k, v = kb[:, :, :c], vb[:, :, :c]
    assert _whole_buffers(k, v)[2] == cap - c and _whole_buffers(k.contiguous(), v.contiguous())[2] == 0
    qh = torch.randn(b, 6, q, 8, generator=g).bfloat16()
    allowed = torch.ones(q, c, dtype=torch.bool).tril(c - q)[None, None].repeat(b, 1, 1, 1)
    allowed[1, :, :, :4] = False
    arg = None if mask == "none" else allowed
    got = cpu_gqa_attention(None, qh, k, v, arg, scaling=8**-0.5)[0]
    want = cpu_gqa_attention(None, qh, k.contiguous(), v.contiguous(), arg, scaling=8**-0.5)[0]
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    ref_mask = allowed if mask == "bool" else allowed.clone().fill_(True).tril(c - q)
    torch.testing.assert_close(got.float(), _reference(qh, k, v, ref_mask[..., :q, :]), atol=2e-2, rtol=2e-2)


native = pytest.mark.skipif(gemv.unavailable() is not None, reason=f"no native kernels here: {gemv.unavailable()}")


@native
@pytest.mark.parametrize("b,h,kv,q,c,d", [(1, 9, 3, 1, 256, 64), (1, 4, 1, 5, 40, 256), (2, 6, 2, 16, 33, 8),
                                          (3, 4, 4, 3, 70, 80)])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_the_native_decoding_attention_matches_sdpa(b, h, kv, q, c, d, mask):
    """draftsmith::gqa_decode against fp32 SDPA: head dims with a tail (8, 80), per-row masks, the three mask forms,
    and columns past every row's last visible one holding huge values it must never read."""
    g = torch.Generator().manual_seed(b * 1000 + q * 10 + d)
    qh = torch.randn(b, h, q, d, generator=g).bfloat16()
    k, v = (torch.randn(b, kv, c, d, generator=g).bfloat16() for _ in range(2))
    filled = c - 7
    allowed = torch.ones(q, filled, dtype=torch.bool).tril(filled - q)[None, None].repeat(b, 1, 1, 1)
    allowed = F.pad(allowed, (0, c - filled), value=False)
    k[:, :, filled:], v[:, :, filled:] = 3e38, -3e38  # the unfilled capacity: finite garbage, never to be seen
    if mask != "none":
        allowed[-1, :, :, : min(3, filled - q)] = False  # left padding of the last row
    arg = {"none": None, "bool": allowed,
           "float": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.bfloat16).min).bfloat16()}
    if mask == "none":  # grouped_attention's None: every column (cpu_gqa_attention makes the causal mask itself)
        k, v, allowed = k[:, :, :filled], v[:, :, :filled], torch.ones_like(allowed[..., :filled])
    got = attention._native(qh, k, v, arg[mask], d**-0.5)
    assert got.shape == (b, q, h, d) and got.dtype == torch.bfloat16
    want = _reference(qh, k[:, :, :filled], v[:, :, :filled], allowed[..., :filled])  # SDPA would read the garbage
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@native
@pytest.mark.parametrize("form", ["bool", "float"])
def test_the_native_attention_follows_a_tree_mask_with_holes(form):
    """A draft tree's verify: each of 16 rows sees the prefix and a scattered set of the new columns (its ancestors),
    across 16-column blocks and a ragged last block."""
    g = torch.Generator().manual_seed(11)
    qh = torch.randn(1, 9, 16, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 3, 53, 64, generator=g).bfloat16() for _ in range(2))
    allowed = torch.ones(1, 1, 16, 53, dtype=torch.bool)
    allowed[..., 37:] = torch.rand(16, 16, generator=g) < 0.4
    allowed[0, 0, torch.arange(16), 37 + torch.arange(16)] = True  # every node sees itself
    allowed[0, 0, 3, 5:20] = False  # and a hole inside the prefix
    arg = allowed if form == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    got = attention._native(qh, k, v, arg, 0.125)
    torch.testing.assert_close(got.float(), _reference(qh, k, v, allowed), atol=2e-2, rtol=2e-2)


@native
def test_the_native_attention_averages_a_row_that_sees_nothing_and_reads_strided_caches():
    """A row with every column hidden averages v, as a softmax of equal scores does (no NaN for the next layer); a
    view into a larger cache buffer (strided heads and batch) reads like the contiguous copy."""
    g = torch.Generator().manual_seed(7)
    qh = torch.randn(2, 4, 2, 64, generator=g).bfloat16()
    buf_k, buf_v = (torch.randn(2, 2, 50, 64, generator=g).bfloat16() for _ in range(2))
    k, v = buf_k[:, :, :30], buf_v[:, :, :30]
    allowed = torch.ones(2, 1, 2, 30, dtype=torch.bool)
    allowed[0, 0, 1] = False
    got = attention._native(qh, k, v, allowed, 0.125)
    torch.testing.assert_close(got[0, 1].float(), v[0].float().mean(1).repeat_interleave(2, 0), atol=1e-2, rtol=1e-2)
    want = attention._native(qh, k.contiguous(), v.contiguous(), allowed, 0.125)
    assert torch.equal(got, want)
    torch.testing.assert_close(got[1].float(), _reference(qh[1:], k[1:], v[1:], allowed[1:])[0], atol=2e-2,
                               rtol=2e-2)


@native
def test_the_native_attention_op_agrees_with_its_fake_for_tracing():
    """The compiled step traces the op through its fake impl and runs without inductor's size asserts
    (models/core/static_kv.py): torch's opcheck compares the fake's shapes and strides with the real op's."""
    g = torch.Generator().manual_seed(3)
    qh = torch.randn(1, 9, 16, 8, 64, generator=g).bfloat16()[:, :, :, 0]  # strided query rows, as a model's
    k, v = (torch.randn(1, 3, 40, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(1, 16, 40, generator=g) > 0.3
    torch.library.opcheck(torch.ops.draftsmith.gqa_decode.default, (qh, k, v, mask, 0.125))


def test_the_native_attention_is_left_alone_where_it_cannot_run(monkeypatch):
    """Not loaded, fp32, or gradients wanted: the matmul path (None here)."""
    qh, k, v = (torch.randn(1, n, m, 8).bfloat16() for n, m in ((4, 1), (2, 5), (2, 5)))
    monkeypatch.setattr(attention.gemv, "ready", lambda: False)
    assert attention._native(qh, k, v, None, 1.0) is None
    monkeypatch.setattr(attention.gemv, "ready", lambda: True)
    assert attention._native(qh.float(), k.float(), v.float(), None, 1.0) is None
    assert attention._native(qh.requires_grad_(), k, v, None, 1.0) is None
    odd = [torch.randn(1, n, m, 7).bfloat16() for n, m in ((4, 1), (2, 5), (2, 5))]
    assert attention._native(*odd, None, 1.0) is None  # an odd head dim: no bf16 pairs, the matmuls


def test_queries_up_to_native_rows_take_the_native_kernel(monkeypatch):
    """An AR step's, a drafting step's and a verify's rows call the native kernel; past NATIVE_ROWS the matmuls."""
    calls = []
    monkeypatch.setattr(attention, "_native", lambda *a: calls.append(a[0].shape[2]))
    for q in (1, 5, attention.NATIVE_ROWS, attention.NATIVE_ROWS + 1):
        qh, k, v = (torch.randn(1, n, m, 8).bfloat16() for n, m in ((4, q), (2, 20), (2, 20)))
        attention.grouped_attention(qh, k, v, None, 0.3)
    assert calls == [1, 5, attention.NATIVE_ROWS]
