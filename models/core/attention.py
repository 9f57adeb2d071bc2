"""Decoding attention for bf16 on a CPU: grouped-query attention as two matmuls.

torch's CPU ``scaled_dot_product_attention`` in bf16 is slow at decoding's few query rows: SmolLM2's shapes (9 query
heads over 3 KV heads, head dim 64), one thread, quiet Zen 5 (``python scripts/bench_attention.py``):

| rows × cached tokens × new | bf16 SDPA | these two matmuls | fp32 SDPA |
|---|---|---|---|
| 1 × 700 × 1 | 0.66 ms | 0.13 ms | 0.09 ms |
| 1 × 700 × 5 | 0.30 ms | 0.22 ms | 0.23 ms |
| 64 × 400 × 1 | 25.6 ms | 1.9 ms | 4.4 ms |

so a bf16 decoding step spent more in attention than in its weights (30 layers × 0.66 ms at 700 tokens; two
thirds of a regeneration step at batch 64). ``cpu_gqa`` reads each KV head once for its group of query heads (no
``repeat_kv`` copy), computes the scores in the model dtype with fp32 accumulation, softmax in fp32, and the
weighted sum in the model dtype. Longer queries (prefill, training), fp32 and other devices go to transformers'
own SDPA unchanged. The mask is the one transformers builds for SDPA (boolean, True = attend; None = causal).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from models.core import gemv

NAME = "draftsmith_cpu_gqa"
MAX_QUERY = 16  # a draft tree's or a chain's verification rows, at most; longer queries are prefill
# query rows up to which the native kernel is used: every grouped query. Its scores take 16 columns at a time (the
# keys transposed once per block for all rows), so it beats the two matmuls at a verify's rows too: 5 x 600 columns
# 155 vs 227 us, 16 x 140 116 vs 464, 16 x 600 408 vs 463 (SmolLM2's shapes, capacity 768, one thread, Zen 5, alone:
# scripts/bench_decode_attention.py, bench/attention/). It reads only the filled columns, the matmuls the whole
# capacity; only a full cache at 16 rows favours the matmuls (16 x 760: 502 vs 477)
NATIVE_ROWS = MAX_QUERY


def cpu_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """query [B, H, Q, D], key/value [B, KV, C, D] → ([B, Q, H, D], None), as transformers' attention functions."""
    b, h, q, d = query.shape
    c = key.shape[2]
    if (not use_grouped(query, key) or dropout or kwargs.get("sliding_window")
            or getattr(module, "sinks", None) is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is None:  # transformers skipped a purely causal mask: query row i sees columns <= c - q + i
        attention_mask = torch.ones(q, c, dtype=torch.bool, device=query.device).tril(c - q)
    scale = d**-0.5 if scaling is None else scaling
    return grouped_attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None


def grouped_attention(query, key, value, mask, scale: float):
    """softmax(q kᵀ · scale + mask) v for few query rows: query [B, H, Q, D], key/value [B, KV, C, D] with H a
    multiple of KV (head i reads KV head i // (H / KV), transformers' repeat_kv order) → [B, H, Q, D]. ``mask``:
    None (every column), boolean (True = attend) or additive, broadcastable to [B, 1 or KV, Q, C]. Scores and
    softmax in fp32; the matmuls in the inputs' dtype."""
    b, h, q, d = query.shape
    kv, c = key.shape[1], key.shape[2]
    g = h // kv
    key, value, extra = _whole_buffers(key, value)
    if extra:  # the buffer's columns past the filled ones: never attended
        if mask is None:
            mask = torch.ones(q, c, dtype=torch.bool, device=query.device)
        mask = torch.nn.functional.pad(mask[..., -c:], (0, extra),
                                       value=False if mask.dtype == torch.bool else float("-inf"))
        c += extra
    native = _native(query, key, value, mask, scale) if q <= NATIVE_ROWS else None
    if native is not None:
        return native.transpose(1, 2)
    s = torch.matmul(query.reshape(b, kv, g * q, d), key.transpose(-1, -2)).float().view(b, kv, g, q, c) * scale
    if mask is not None:
        while mask.dim() < 4:
            mask = mask[None]
        m = mask[:, :, None, :, -c:]  # [B or 1, 1 or KV, 1, Q, C] against the scores' [B, KV, G, Q, C]
        # the lowest finite score, not -inf: a query row with every column masked (a left-padding position in a
        # batched prefill) then averages instead of giving NaN, whose K/V would poison the next layer (0 × NaN)
        low = torch.finfo(s.dtype).min
        s = s.masked_fill(~m, low) if m.dtype == torch.bool else (s + m.float()).clamp_min(low)
    p = torch.softmax(s, dim=-1).to(value.dtype).view(b, kv, g * q, c)
    return torch.matmul(p, value).view(b, h, q, d)


def _native(query, key, value, mask, scale: float):
    """``draftsmith::gqa_decode`` (models/core/csrc/gqa_decode.cpp) where it runs: [B, Q, H, D], or None. It stops
    each query row at the last column it may see, so a static cache's unfilled capacity costs nothing, and does in
    one call what the two matmuls do in two (each ~30 us of fixed cost in bf16). Its mask is one per batch row."""
    b, h, q, d = query.shape
    c = key.shape[2]
    if (not gemv.ready() or not query.dtype == key.dtype == value.dtype == torch.bfloat16
            or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1
            or d % 2 or key.stride(-2) % 2 or any(st % 2 for st in query.stride()[:-1])):  # bf16 pairs
        return None
    if mask is None:
        mask = torch.ones(1, q, c, dtype=torch.bool, device=query.device)
    else:
        while mask.dim() < 4:
            mask = mask[None]
        if mask.shape[1] != 1 or mask.shape[0] not in (1, b):
            return None
        mask = mask[:, 0, :, -c:].expand(mask.shape[0], q, c)
        mask = (mask if mask.dtype == torch.bool else mask.float()).contiguous()
    return torch.ops.draftsmith.gqa_decode(query, key, value, mask, scale)


def use_grouped(query, key) -> bool:
    """Whether ``grouped_attention`` beats torch's SDPA here: a bf16/fp16 query of at most ``MAX_QUERY`` rows on
    a CPU (fp32 SDPA is as fast, and other devices have their own kernels)."""
    return (query.device.type == "cpu" and query.dtype != torch.float32 and query.shape[2] <= MAX_QUERY
            and query.shape[1] % key.shape[1] == 0)


def _whole_buffers(key, value):
    """(key, value, extra columns): a KV cache that preallocates (models/core/generate.py) hands attention views of
    the filled columns of ``[B, KV, capacity, D]`` buffers; their batch stride is not C×D, and torch's bf16 batched
    matmul then runs 5-15x slower than on the contiguous buffer (SmolLM2, 64 rows × 800 columns). The whole
    buffers are used instead when both views start them, the columns past the view masked (they hold zeros or
    finite stale states, never NaN: the buffers are zero-initialised)."""
    if key.is_contiguous():  # a whole buffer already (a static cache's; ``_base`` is not traced by torch.compile)
        return key, value, 0
    kb, vb = key._base, value._base
    if (kb is None or vb is None or key.is_contiguous() or kb.dim() != 4 or vb.dim() != 4
            or not kb.is_contiguous() or not vb.is_contiguous()
            or kb.shape[:2] != key.shape[:2] or kb.shape[3] != key.shape[3] or vb.shape != kb.shape
            or key.data_ptr() != kb.data_ptr() or value.data_ptr() != vb.data_ptr()
            or kb.shape[2] > 2 * key.shape[2] + 64):
        return key, value, 0
    return kb, vb, kb.shape[2] - key.shape[2]


_LIB = torch.library.Library("draftsmith", "FRAGMENT")
_LIB.define("gqa_decode(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")


@torch.library.register_fake("draftsmith::gqa_decode", lib=_LIB)
def _(q, k, v, mask, scale):
    b, h, n, d = q.shape
    return q.new_empty((b, n, h, d))


AttentionInterface.register(NAME, cpu_gqa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_cpu_gqa(model) -> None:
    """Switch a model that runs transformers' SDPA to ``cpu_gqa`` (same results in fp32 and for long queries:
    those still go to SDPA); models with another attention implementation are left alone."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return
    if next(model.parameters()).dtype == torch.bfloat16:
        gemv.unavailable()  # loads the decoding-attention kernel where it runs, before any step is traced
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):  # a model class that refuses custom implementations keeps SDPA
        pass
