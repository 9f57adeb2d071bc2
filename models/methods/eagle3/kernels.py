"""EAGLE-3 drafting with a KV cache: the cache (``DraftKV``), the drafting precision (``inference_copy``,
``Int8Linear``) and one midlayer pass over new entries (``entry_qkv`` + ``entry_out`` = ``cached_step``), with q/k/v
and gate/up each fused into one matmul. The proposers (proposers.py) and the tree sizing's cost probe run these.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.core.attention import grouped_attention, use_grouped
from models.core.packed import PackedLinear, pack_linears
from models.core.packed import available as packed_available
from models.core.rope import apply_rope, rope_cos_sin
from models.methods.eagle3.net import Eagle3Drafter, _expand_kv


# ---------------------------------------------------------------------------------------------------------------
# Inference with a KV cache (used by proposers.py). Entries follow the training convention (package docstring):
# the "real" entry at position i reads (emb(t_{i+1}), g_i) and sits at RoPE position i; a drafted token at depth s
# after the last real entry (position n) reads (emb(d_s), a of its parent entry) and sits at RoPE position n + s.
# ---------------------------------------------------------------------------------------------------------------
class DraftKV:
    """The drafter's KV cache: [B, nh, capacity, d] buffers that grow by doubling, so a step writes its new
    entries in place instead of copying the whole cache (``torch.cat``) every drafted token.

    ``n`` entries are committed (the "real" ones); drafted entries are written after them as scratch and are
    overwritten by the next real entries, which is exactly their lifetime in speculative decoding.
    """

    def __init__(self) -> None:
        self.k = self.v = None
        self.n = 0

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, nh, M, d] at [start, start+M); return views of entries [0, start+M)."""
        end = start + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            cap = max(64, 2 * end)
            # zeros: grouped attention may read the whole buffer, the unfilled columns masked (models/core/attention.py)
            grown_k = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
            grown_v = v.new_zeros(grown_k.shape)
            if self.k is not None:
                grown_k[:, :, :start] = self.k[:, :, :start]
                grown_v[:, :, :start] = self.v[:, :, :start]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Int8Linear(nn.Module):
    """Weight-only int8 linear for drafting (``weights: int8``): W ≈ W_q · s with per-output-channel absmax scales
    s, y = (x @ W_qᵀ) · s through torch's ``_weight_int8pack_mm`` kernel. Inference only; activations stay in
    the input dtype. Drafts change slightly, correctness cannot: the target verifies every token."""

    def __init__(self, weight_q: Tensor, scales: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.register_buffer("weight_q", weight_q)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out] in the activation dtype
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight_q.shape

    @classmethod
    def quantize(cls, lin: nn.Linear) -> Int8Linear:
        w = lin.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
        w_q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if lin.bias is None else lin.bias.detach()
        return cls(w_q, scales.to(lin.weight.dtype), bias)

    @classmethod
    def cat(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One int8 linear computing the parts' outputs side by side (fused q/k/v or gate/up)."""
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(torch.cat([p.weight_q for p in parts]), torch.cat([p.scales for p in parts]), bias)

    def forward(self, x: Tensor) -> Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_q, self.scales.to(x.dtype))
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


DRAFT_WEIGHTS = ("float32", "bfloat16", "int8")


def drafting_weights(weights: str, target) -> str:
    """The proposers' ``weights`` option resolved: ``auto`` drafts in bf16 when the target computes in bf16 (the
    draft step's GEMMs read half the bytes: c 0.057 → 0.045 of the bf16 AR step on SmolLM2, docs/throughput.md),
    else in float32; any other value is kept."""
    if weights != "auto":
        return weights
    dtype = getattr(getattr(target, "model", None), "dtype", None)
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def inference_copy(drafter: Eagle3Drafter, weights: str = "float32") -> Eagle3Drafter:
    """The drafter the proposers run, in the drafting precision ``weights`` (a proposer option, benchmarked as
    its own row by eval's ``variants``): float32 = the drafter itself; bfloat16 = a bf16 copy; int8 = a copy
    whose midlayer and lm_head linears are weight-only int8 (``Int8Linear``; the fc that fuses the target's
    states stays in float: it runs once per accepted token, not per drafted one). Cached on the drafter,
    rebuilt when its weights change."""
    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"weights={weights!r}; use one of {list(DRAFT_WEIGHTS)}")
    if weights == "float32":
        return drafter
    key = (weights, tuple((p.data_ptr(), p._version) for p in drafter.parameters()))
    copies = drafter.__dict__.setdefault("_inference_copies", {})
    if weights in copies and copies[weights][0] == key:
        return copies[weights][1]
    # the cache of copies must not be deep-copied into the copy
    copies_ref = drafter.__dict__.pop("_inference_copies")
    infer_ref = drafter.__dict__.pop("_infer_cache", None)
    try:
        out = copy.deepcopy(drafter).eval().requires_grad_(False)
    finally:
        drafter.__dict__["_inference_copies"] = copies_ref
        if infer_ref is not None:
            drafter.__dict__["_infer_cache"] = infer_ref
    if weights == "bfloat16":
        out = out.to(torch.bfloat16)
        pack_linears(out)  # inference only: oneDNN's pre-packed weights (models/core/packed.py)
    else:
        attn, mlp = out.midlayer.self_attn, out.midlayer.mlp
        linears = ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")),
                   (out, ("lm_head",)))
        for mod, names in linears:
            for n in names:
                setattr(mod, n, Int8Linear.quantize(getattr(mod, n)))
    copies[weights] = (key, out)
    return out


def _inference_weights(drafter: Eagle3Drafter) -> dict:
    """q/k/v and gate/up fused (one matmul each instead of three and two), as callables x → y (float or int8
    weights), plus a RoPE table.

    Cached on the module outside its state dict and rebuilt when any source parameter is replaced or updated
    in place (data_ptr / _version), so a drafter that trains on keeps giving correct proposals.
    """
    attn, mlp = drafter.midlayer.self_attn, drafter.midlayer.mlp
    mods = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    src = [m.weight_q if isinstance(m, Int8Linear) else m.weight for m in mods]
    src += [m.bias for m in mods[:3] if m.bias is not None]
    key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in src)
    cached = drafter.__dict__.get("_infer_cache")
    if cached is not None and cached["key"] == key:
        return cached
    if isinstance(mods[0], Int8Linear):
        qkv, gate_up = Int8Linear.cat(mods[:3]), Int8Linear.cat(mods[3:5])
    else:
        w_qkv = torch.cat([m.weight for m in mods[:3]]).detach()
        b_qkv = None if attn.q_proj.bias is None else torch.cat([m.bias for m in mods[:3]]).detach()
        w_gu = torch.cat([m.weight for m in mods[3:5]]).detach()
        qkv, gate_up = _fused_linear(w_qkv, b_qkv), _fused_linear(w_gu, None)
    cached = {"key": key, "qkv": qkv, "gate_up": gate_up, "cos": None, "sin": None}
    drafter.__dict__["_infer_cache"] = cached
    return cached


def _fused_linear(w: Tensor, b: Tensor | None):
    """x → x wᵀ + b for a fused weight: oneDNN-packed when that is available (no gradients flow through a
    proposer's drafting), else ``F.linear``."""
    if not packed_available():
        return lambda x: F.linear(x, w, b)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    lin.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b, requires_grad=False)
    return PackedLinear(lin)


def rope_at(drafter: Eagle3Drafter, positions: torch.Tensor, max_pos: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [M, d] for arbitrary RoPE positions [M] (tree siblings share a position), read from a table
    that grows by doubling (one gather per step instead of ~8 small ops). ``max_pos``: the largest position, when the
    caller knows it on the host (else it is read from the device: a host sync every step)."""
    w = _inference_weights(drafter)
    need = (int(positions.max()) if max_pos is None else max_pos) + 1
    if w["cos"] is None or w["cos"].shape[0] < need:
        pos = torch.arange(max(256, 2 * need), device=drafter.fc.weight.device, dtype=torch.float32)
        w["cos"], w["sin"] = rope_cos_sin(drafter._inv_freq, drafter.rope_scaling_factor, pos, drafter.fc.weight.dtype)
    idx = positions.to(w["cos"].device)
    return w["cos"][idx], w["sin"][idx]


def entry_qkv(drafter: Eagle3Drafter, token_ids: Tensor, h: Tensor, positions: Tensor, max_pos: int | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The first half of a midlayer pass for M new entries: (q, k, v, residual).

    ``token_ids`` [B, M], ``h`` [B, M, H] (see ``cached_step``); ``positions`` [M] (shared by every row) or
    [B, M] (per row: the batched proposer's rows sit at different lengths). q [B, nh, M, d]; k, v RoPE'd and
    GQA-expanded to [B, nh, M, d]; residual [B, M, H]. q/k/v come from one fused matmul."""
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn
    w = _inference_weights(drafter)
    g = h.to(drafter.fc.weight.dtype)
    emb = drafter.embed_tokens(token_ids).to(g.dtype)
    x, residual = layer.pre(emb, g)
    B, M, _ = x.shape
    nq, nkv, d = attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim, attn.head_dim
    qkv = w["qkv"](x)  # [B, M, nq + 2 nkv]
    cos, sin = rope_at(drafter, positions, max_pos)
    if positions.dim() == 2:  # [B, M, d] → broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    q = apply_rope(qkv[..., :nq].view(B, M, attn.heads, d).transpose(1, 2), cos, sin)
    k = apply_rope(qkv[..., nq : nq + nkv].view(B, M, attn.kv_heads, d).transpose(1, 2), cos, sin)
    v = qkv[..., nq + nkv :].view(B, M, attn.kv_heads, d).transpose(1, 2)
    n_rep = attn.heads // attn.kv_heads
    return q, _expand_kv(k, n_rep), _expand_kv(v, n_rep), residual


def entry_out(drafter: Eagle3Drafter, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
              residual: Tensor) -> Tensor:
    """The second half: attention of q over keys/values [B, nh, C, d] (``mask`` bool, True = attend, broadcast
    to [B, nh, M, C]; None = all), o_proj, residual, SwiGLU (gate/up fused) → ``drafter.carry(a)`` [B, M, H]."""
    layer, attn, mlp = drafter.midlayer, drafter.midlayer.self_attn, drafter.midlayer.mlp
    w = _inference_weights(drafter)
    if use_grouped(q, keys):  # bf16 drafting on a CPU: two matmuls, not bf16 SDPA (models/core/attention.py)
        o = grouped_attention(q, keys, values, mask, 1.0 / math.sqrt(attn.head_dim))
    else:
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(attn.head_dim))
    a = residual + attn.out(o)
    gu = w["gate_up"](layer.post_attention_layernorm(a))
    inter = gu.shape[-1] // 2
    return drafter.carry(a + mlp.down_proj(mlp.act(gu[..., :inter]) * gu[..., inter:]))


@torch.no_grad()
def cached_step(
    drafter: Eagle3Drafter,
    token_ids: torch.Tensor,
    h: torch.Tensor,
    positions: torch.Tensor,
    kv: DraftKV,
    start: int,
    mask: torch.Tensor | None = None,
    max_pos: int | None = None,
) -> torch.Tensor:
    """One midlayer pass for M new entries over the first ``start`` entries of the cache ``kv``.

    ``token_ids`` [B, M]: target ids whose embedding each entry reads; ``h`` [B, M, H]: the state it reads
    (fused target state g for real entries, the parent entry's output ``a`` for drafted ones);
    ``positions`` [M] RoPE positions; the new entries' K/V (RoPE applied, GQA-expanded) are written to ``kv``
    at [start, start+M); ``mask`` [M, start + M] bool (True = attend), None = every earlier entry plus causal
    among the new ones; ``max_pos`` the largest position if the caller knows it (``rope_at``). Returns
    ``drafter.carry(a)`` [B, M, H] (``drafter.logits`` of it scores the next token).
    Same maths as the training forward, with q/k/v and gate/up each fused into one matmul.
    """
    q, k, v, residual = entry_qkv(drafter, token_ids, h, positions, max_pos)
    M = q.shape[2]
    keys, values = kv.write(start, k, v)
    if mask is None and M > 1:
        total = start + M
        mask = torch.ones(M, total, dtype=torch.bool, device=q.device).tril(total - M)  # causal, past all visible
    return entry_out(drafter, q, keys, values, mask, residual)
