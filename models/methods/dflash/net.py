"""DFlash: a block-parallel drafter — one forward drafts B−1 tokens (the network and its training loss).

Method (DFlash, arXiv 2602.06036; facts and sources in shared/design/dflash.md, read against z-lab/dflash,
vllm-project/speculators, SpecForge and ModelOpt):

- Context features: F target hidden states per context position, concatenated [T, F·H] → ``fc`` (no bias) →
  ``hidden_norm``: ctx [T, H], computed once and shared by every draft layer.
- Block: [anchor token, mask × (B−1)] at positions a..a+B−1, embedded with the target's frozen embedding
  (``mask_token_id`` is an existing embedding row, recorded in the config).
- L_d Qwen3-style pre-norm decoder layers over the block only. **KV injection**: each layer projects ctx with
  its own k/v projections and prepends them to the block's K/V: K = k_norm([k(ctx); k(x)]), V = [v(ctx); v(x)]
  (QK-norm per head, V un-normed, RoPE after the norm: ctx keys at their positions, block at a..a+B−1).
  Inside the block attention is bidirectional; the block sees context positions c < a only (strictly before
  its anchor: the anchor's own target state is not visible).
- Output: final ``norm``, then the target's frozen lm_head (optionally a draft vocabulary: its rows selected
  by ``t2d``, d2t/t2d as in models/core/vocab.py). Slot k (1..B−1) predicts token a+k; slot 0 is not scored.

Training (teacher forced, one forward per batch): up to ``num_anchors`` random anchors per row, redrawn every
step, inside the loss-masked region; all blocks of a row in one attention call with one [N·B, T+N·B] mask.
Label of slot k = the target's greedy token at a+k (argmax of its logits at a+k−1; ``loss: kl`` distils the
whole distribution), scored (``label_path: greedy``) only where tokens a+1..a+k−1 are themselves the target's
greedy choices, i.e. where the label is what a verifier accepts after slots 1..k−1; weight exp(−(k−1)/γ)
(paper Eq. 4), D-PACE weights as an option. ``acc_{k-1}`` is the agreement of slot k *given slots 1..k−1
agreed*, so ``chain_tau`` of them is the expected accepted
length of a greedy block.

Inference (models/methods/dflash/proposers.py): the drafter keeps a KV cache of the injected context only (per
layer, positions 0..n−1); a round feeds the new context features (one row per newly committed token), then one
forward over the block at positions n..n+B−1 with no mask (all context precedes the anchor); block K/V are never
cached. The cached-drafting kernels the proposers call (``context``, ``context_kv``, ``blocks``, ``logits``) are
the drafter's own methods here: training runs the same ones, with the block mask.

DSpark (``block_head``, ``sample_from_anchor``; heads.py): the same backbone; the anchor slot drafts
too (B tokens, draft j → token a+j+1) and a small head conditions each slot on the token before it.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from models.core.acceptance import chain_tau
from models.core.norm import RMSNorm
from models.core.rope import apply_rope, rope_cos_sin, rope_inv_freq
from models.core.target import validate_layer_ids
from models.core.vocab import check_mapping, draft_to_target
from models.methods.dflash.config import DFlashConfig, check_config, default_layer_ids
from models.methods.dflash.heads import build_block_head


class DFlashAttention(nn.Module):
    """Qwen3 attention with KV injection: q from the block, k/v from [context features; block]."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, H] → K, V [B, kv_heads, T, d] (K normed then rotated at the rows' positions)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor,
                mask: Tensor | None) -> Tensor:
        """x [B, Q, H] block rows at positions (cos/sin [B, 1, Q, d]); ctx_k/v [B, kv, C, d] already rotated;
        mask [B, 1, Q, C+Q] bool (True = visible) or None (everything visible: inference)."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        bk, bv = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, bk], dim=2), torch.cat([ctx_v, bv], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))


class DFlashLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DFlashAttention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(hidden, intermediate, bias=False),
                                  "up_proj": nn.Linear(hidden, intermediate, bias=False),
                                  "down_proj": nn.Linear(intermediate, hidden, bias=False)})

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor,
                mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


# the drafter's constructor checks, in the order it runs them: first the block and loss options (no target
# needed), then which target hidden states it fuses; the vocabulary and mask row are checked in __init__ itself
def _check_options(cfg: DFlashConfig) -> None:
    """The block and loss options of ``draft.config``: the spec's own check (config.py ``check_config``), so the
    yaml path and a config built in code are refused by the same lines."""
    check_config(asdict(cfg))


def _fused_layer_ids(cfg: DFlashConfig, L: int) -> list[int]:
    """The target hidden states the drafter fuses (``layer_ids`` or the z-lab default), checked for an L-layer
    target."""
    ids = list(cfg.layer_ids) if cfg.layer_ids is not None else default_layer_ids(L, cfg.num_layers)
    if not ids:
        raise ValueError("draft.config.layer_ids is empty; DFlash fuses at least one target hidden state")
    out = validate_layer_ids(ids, L)
    if L in out:  # id L is the target's *post*-norm state here, vLLM's L is the pre-norm one
        raise ValueError(f"layer_ids={ids}: id {L} is the target's post-norm output here but the pre-norm "
                         f"state in vLLM/SGLang capture; use ids < {L}")
    return out


class DFlashDrafter(nn.Module):
    """The DFlash drafter for a frozen target (module docstring: the maths, masks and positions)."""

    def __init__(self, cfg: DFlashConfig, target_config: PretrainedConfig, embed_weight: Tensor,
                 lm_head_weight: Tensor, d2t: Tensor | None = None, t2d: Tensor | None = None):
        super().__init__()
        tc = target_config
        L, H, V = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size
        self.cfg = cfg
        _check_options(cfg)
        self.layer_ids = _fused_layer_ids(cfg, L)
        if cfg.mask_token_id is None or not 0 <= int(cfg.mask_token_id) < V:
            raise ValueError(f"draft.config.mask_token_id={cfg.mask_token_id} is not a row of the target's "
                             f"embedding (0..{V - 1}); pick an existing unused row (e.g. the first padding row)")
        vd = cfg.draft_vocab_size or V
        if not 0 < vd <= V:
            raise ValueError(f"draft_vocab_size={vd} must be in 1..{V} (the target's vocabulary)")
        if d2t is None and t2d is None:  # the first vd ids; a checkpoint's own buffers overwrite them
            t2d, d2t = torch.arange(V) < vd, torch.zeros(vd, dtype=torch.long)
        check_mapping(d2t, t2d)
        if d2t.numel() != vd or t2d.numel() != V:
            raise ValueError(f"d2t/t2d sizes ({d2t.numel()}, {t2d.numel()}) do not match draft_vocab_size={vd} "
                             f"and the target vocab {V}")
        heads = tc.num_attention_heads
        kv_heads = getattr(tc, "num_key_value_heads", None) or heads
        head_dim = int(getattr(tc, "head_dim", None) or H // heads)
        inter = cfg.intermediate_size or getattr(tc, "intermediate_size", None) or 3 * H
        eps = float(getattr(tc, "rms_norm_eps", 1e-6))
        self.vocab_size, self.draft_vocab_size, self.hidden_size = V, vd, H
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate_size, self.rms_norm_eps, self.num_target_layers = inter, eps, L
        self.final_logit_softcapping = getattr(tc, "final_logit_softcapping", None)

        # frozen, borrowed from the target (never stored in checkpoints)
        self.embed_tokens = nn.Parameter(embed_weight.detach().float().clone(), requires_grad=False)
        rows = draft_to_target(d2t)
        self.lm_head = nn.Parameter(lm_head_weight.detach().float()[rows].clone(), requires_grad=False)
        self.fc = nn.Linear(len(self.layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList(DFlashLayer(H, inter, heads, kv_heads, head_dim, eps)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps)
        self.block_head = build_block_head(cfg, H, V, vd)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self._lm_head_full = lm_head_weight.detach()  # rebuild rows when a checkpoint's d2t is loaded
        self._inv_freq, self._rope_factor, self.rope_parameters = rope_inv_freq(tc, head_dim)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        with torch.no_grad():  # the frozen head rows follow the loaded draft vocabulary
            self.lm_head.copy_(self._lm_head_full.float()[draft_to_target(self.d2t).to(self._lm_head_full.device)])

    # ------------------------------------------------------------------ pieces
    @property
    def draft_ids(self) -> Tensor:
        return draft_to_target(self.d2t)

    @property
    def block_size(self) -> int:
        return int(self.cfg.block_size)

    @property
    def num_spec(self) -> int:
        """Speculative tokens per block: B−1 (DFlash: slot 0 is the anchor), B with ``sample_from_anchor``."""
        return self.block_size - (0 if self.cfg.sample_from_anchor else 1)

    @property
    def slot_offset(self) -> int:
        """The block slot whose output drafts the first token (0 with ``sample_from_anchor``, else 1)."""
        return 0 if self.cfg.sample_from_anchor else 1

    def config_dict(self) -> dict:
        d = asdict(self.cfg)
        d.update(method="dflash", layer_ids=list(self.layer_ids), draft_vocab_size=self.draft_vocab_size,
                 intermediate_size=self.intermediate_size, hidden_size=self.hidden_size,
                 num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                 head_dim=self.head_dim, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                 num_target_layers=self.num_target_layers)
        return d

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, T] → cos, sin [B, 1, T, d] in the drafter's dtype."""
        b, t = positions.shape
        cos, sin = rope_cos_sin(self._inv_freq, self._rope_factor, positions.reshape(-1).float(), self.fc.weight.dtype)
        return cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)

    def context(self, hidden: dict[int, Tensor] | Tensor) -> Tensor:
        """{id: [B, T, H]} (or the concatenation [B, T, F·H]) → ctx [B, T, H] = hidden_norm(fc(cat))."""
        if isinstance(hidden, dict):
            hidden = torch.cat([hidden[k] for k in self.layer_ids], dim=-1)
        return self.hidden_norm(self.fc(hidden.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer (K, V) [B, kv, T, d] of the context features at their positions."""
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, anchor_ids: Tensor, kvs: list[tuple[Tensor, Tensor]], positions: Tensor,
               mask: Tensor | None) -> Tensor:
        """anchor_ids [B, N] → block outputs [B, N·B_blk, H] (after the final norm); rows j·B_blk + s are block
        j's slot s at positions [B, N·B_blk]."""
        b, n = anchor_ids.shape
        blk = self.block_size
        ids = torch.full((b, n, blk), int(self.cfg.mask_token_id), dtype=torch.long, device=anchor_ids.device)
        ids[:, :, 0] = anchor_ids
        x = F.embedding(ids.view(b, n * blk), self.embed_tokens).to(self.fc.weight.dtype)
        cos, sin = self.rope(positions)
        for layer, (k, v) in zip(self.layers, kvs):
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x)

    def logits(self, out: Tensor) -> Tensor:
        """[..., H] → draft-vocabulary logits [..., Vd] (the target's frozen head rows; Gemma soft-capping)."""
        z = out @ self.lm_head.t().to(out.dtype)
        cap = self.final_logit_softcapping
        return z if not cap else torch.tanh(z / cap) * cap

    # ------------------------------------------------------------------ training
    def sample_anchors(self, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Up to num_anchors random anchors per row where token a+1 is a training target → (anchors [B, N] long,
        keep [B, N] bool; padding anchors are 0 with keep False). Uses torch's global RNG (checkpointed)."""
        b, t = loss_mask.shape
        valid = torch.zeros_like(loss_mask, dtype=torch.bool)
        valid[:, :-1] = loss_mask[:, 1:].bool()
        n = min(int(self.cfg.num_anchors), max(int(valid.sum(1).max()), 1))
        score = torch.rand(b, t, device=loss_mask.device).masked_fill(~valid, -1.0)
        top = score.topk(n, dim=1)
        keep = top.values >= 0
        anchors = torch.where(keep, top.indices, 0)
        order = anchors.masked_fill(~keep, t).argsort(dim=1)  # sorted anchors, padding last
        return anchors.gather(1, order), keep.gather(1, order)

    def block_mask(self, anchors: Tensor, keep: Tensor, ctx_valid: Tensor) -> Tensor:
        """[B, 1, N·B_blk, T + N·B_blk] bool: a query of block j sees context c iff c < a_j (and c is a real token),
        and the keys of its own block only (bidirectional). Padding blocks see only themselves (scored 0)."""
        b, n = anchors.shape
        t = ctx_valid.shape[1]
        blk = self.block_size
        c = torch.arange(t, device=anchors.device)
        see_ctx = (c[None, None, :] < anchors[:, :, None]) & ctx_valid[:, None, :].bool() & keep[:, :, None]
        see_ctx = see_ctx.repeat_interleave(blk, dim=1)  # [B, N·blk, T]
        j = torch.arange(n * blk, device=anchors.device) // blk
        same = (j[:, None] == j[None, :]).expand(b, -1, -1)
        return torch.cat([see_ctx, same], dim=2)[:, None]

    def slot_weights(self) -> Tensor:
        """w_j = exp(−j/γ) for drafts j = 0..S−1 (paper Eq. 4: exp(−(k−1)/γ) for DFlash slots k = 1..B−1)."""
        gamma = self.cfg.decay_gamma or (7.0 if self.block_size >= 16 else 4.0)
        return torch.exp(-torch.arange(self.num_spec, dtype=torch.float32) / gamma)

    def training_loss(self, input_ids: Tensor, loss_mask: Tensor, hidden: dict[int, Tensor],
                      target_logits: Tensor) -> tuple[Tensor, dict[str, float]]:
        b, t = input_ids.shape
        blk = self.block_size
        anchors, keep = self.sample_anchors(loss_mask)  # [B, N]
        n = anchors.shape[1]
        ctx = self.context(hidden)
        pos_ctx = torch.arange(t, device=input_ids.device).expand(b, t)
        kvs = self.context_kv(ctx, pos_ctx)
        slot = torch.arange(blk, device=input_ids.device)
        pos_blk = (anchors[:, :, None] + slot).view(b, n * blk)
        ctx_valid = torch.ones_like(loss_mask, dtype=torch.bool)  # the loop right-pads; padding is never < anchor
        mask = self.block_mask(anchors, keep, ctx_valid)
        s_, off = self.num_spec, self.slot_offset
        out = self.blocks(input_ids.gather(1, anchors), kvs, pos_blk, mask).view(b, n, blk, -1)[:, :, off:off + s_]
        # labels: draft j (block slot j + offset) predicts token a+j+1 = the target's choice at a+j; the token before
        # it (a+j: the anchor for j = 0) is what an intra-block head conditions on (teacher forced)
        lab_pos = anchors[:, :, None] + 1 + torch.arange(s_, device=input_ids.device)  # [B, N, S]
        valid = keep[:, :, None] & (lab_pos < t)
        lab_pos = lab_pos.clamp_max(t - 1)
        valid &= loss_mask.gather(1, lab_pos.view(b, -1)).view_as(lab_pos).bool()
        if self.cfg.label_path == "greedy":  # tokens a+1..a+j must be the target's greedy path
            on = torch.zeros_like(input_ids, dtype=torch.bool)
            on[:, 1:] = input_ids[:, 1:] == target_logits[:, :-1].argmax(-1)  # token p = target's choice at p-1
            on_k = on.gather(1, lab_pos.view(b, -1)).view_as(lab_pos)  # token a+j+1 on the path
            before = torch.cat([torch.ones_like(on_k[:, :, :1]), on_k[:, :, :-1]], dim=2)
            valid &= torch.cumprod(before.long(), dim=2).bool()
        teacher = target_logits.gather(1, (lab_pos - 1).view(b, -1, 1).expand(-1, -1, target_logits.shape[-1]))
        teacher = teacher.view(b, n, s_, -1)
        prev = input_ids.gather(1, (lab_pos - 1).view(b, -1)).view_as(lab_pos)
        return self._scored(out, teacher, valid, prev)

    def _scored(self, out: Tensor, teacher: Tensor, valid: Tensor, prev: Tensor | None = None
                ) -> tuple[Tensor, dict[str, float]]:
        """out [B, N, S, H], teacher logits over the target vocab [B, N, S, V], valid [B, N, S], prev [B, N, S] the
        token before each label (for a block head) → weighted loss. Chunked by whole blocks (a head reads a
        block's slots in order), never all slots × V at once."""
        b, n, s = out.shape[:3]
        ids = self.draft_ids.to(out.device)
        label = teacher.argmax(-1)  # the target's greedy token, target ids
        in_vocab = self.t2d.to(out.device)[label]
        valid = valid & in_vocab  # a target token outside the draft vocabulary cannot be drafted: not scored
        label_d = torch.searchsorted(ids, label.clamp_min(0)).clamp_max(ids.numel() - 1)
        if prev is None:
            prev = torch.zeros_like(label)
        flat = [x.reshape(b * n, s, *x.shape[3:]) for x in (out, teacher, label_d, prev)]
        fv = valid.reshape(b * n, s)
        sel = fv.any(1).nonzero().flatten()
        parts = {key: torch.zeros(b * n, s, device=out.device) for key in ("ce", "hit", "bce", "conf", "cstar")}
        step = max(1, int(self.cfg.loss_chunk) // s)
        for i in range(0, sel.numel(), step):  # chunked: never all slots × V at once
            rows = sel[i : i + step]
            got = checkpoint(self._chunk_loss, *(x[rows] for x in flat), use_reentrant=False)
            for key, v in zip(parts, got):
                parts[key] = parts[key].index_put((rows,), v.float())
        ce, hit = parts["ce"].view(valid.shape), parts["hit"].view(valid.shape).bool()
        w = self.slot_weights().to(out.device).expand_as(ce)
        if self.cfg.dpace:
            w = w * _dpace_weights(ce.detach(), valid, self.cfg.dpace_alpha)
        wv = w * valid
        loss = (wv * ce).sum() / wv.sum().clamp_min(1e-9)
        metrics: dict[str, float] = {}
        has_conf = self.block_head is not None and getattr(self.block_head, "confidence_head", None) is not None
        if has_conf:  # the confidence head's BCE against c* = 1 - TV(p, q), same slot weights
            bce = parts["bce"].view(valid.shape)
            conf_loss = (wv * bce).sum() / wv.sum().clamp_min(1e-9)
            loss = loss + float(self.cfg.confidence_alpha) * conf_loss
            metrics["conf_bce"] = float(conf_loss.detach())
        prefix = torch.ones(valid.shape[:2], dtype=torch.bool, device=out.device)
        accs = []
        for k in range(s):  # agreement of draft k+1 given drafts 1..k agreed (what a greedy verifier accepts)
            tried = prefix & valid[:, :, k]
            n_k = int(tried.sum())
            a_k = float((tried & hit[:, :, k]).sum()) / max(n_k, 1)
            vk = valid[:, :, k]
            metrics[f"loss_{k}"] = float((ce.detach()[:, :, k] * vk).sum() / vk.sum().clamp_min(1))
            metrics[f"acc_{k}"], metrics[f"n_{k}"] = a_k, float(n_k)
            if has_conf:  # mean predicted vs actual acceptance (1 - TV) of the slot: the head's calibration
                for key in ("conf", "cstar"):
                    metrics[f"{key}_{k}"] = float((parts[key].view(valid.shape)[:, :, k] * vk).sum()
                                                  / vk.sum().clamp_min(1))
            accs.append(a_k)
            prefix = tried & hit[:, :, k]
        metrics["sim_tau"] = chain_tau(accs)
        return loss, metrics

    def _chunk_loss(self, o: Tensor, teacher: Tensor, label: Tensor, prev: Tensor) -> tuple[Tensor, ...]:
        """One chunk of whole blocks: o [c, S, H], teacher [c, S, V], label [c, S] draft ids, prev [c, S] target
        ids → per slot (loss, hit, confidence BCE, confidence, c*)."""
        z = self.logits(o).float()
        conf = None
        if self.block_head is not None:
            z, conf = self.block_head.block_logits(z, o, prev)
            z = z.float()
        cfg = self.cfg
        logq = F.log_softmax(z, -1)
        need_p = cfg.loss == "kl" or cfg.tv_weight or conf is not None
        p = F.softmax(teacher.float(), -1)[..., self.draft_ids.to(o.device)] if need_p else None
        if cfg.loss == "kl":
            ce = -(p * logq).sum(-1)
        else:
            ce = F.cross_entropy(z.flatten(0, -2), label.flatten(), reduction="none").view(label.shape)
        ce = ce * float(cfg.ce_weight)
        # c* = Σ min(p, q) = 1 - TV(p, q) (the target's mass outside the draft ids counts as disagreement)
        overlap = torch.minimum(p, logq.exp()).sum(-1) if need_p else None
        if cfg.tv_weight:
            ce = ce + float(cfg.tv_weight) * (1 - overlap)
        zero = torch.zeros_like(ce)
        if conf is None:
            return ce, z.argmax(-1) == label, zero, zero, zero
        cstar = overlap.detach()
        bce = F.binary_cross_entropy_with_logits(conf.float(), cstar, reduction="none")
        return ce, z.argmax(-1) == label, bce, torch.sigmoid(conf.detach().float()), cstar


def _dpace_weights(ce: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE (arXiv 2605.18810): q_i = exp(−CE_i), q̃ = (1−α)q + α, C_j = Π_{i≤j} q̃_i (invalid = 1),
    w_j = Σ_{m≥j} C_m·mask_m; detached."""
    q = (1 - alpha) * torch.exp(-ce) + alpha
    q = torch.where(valid, q, torch.ones_like(q))
    c = torch.cumprod(q, dim=-1) * valid
    return torch.flip(torch.cumsum(torch.flip(c, [-1]), -1), [-1])

