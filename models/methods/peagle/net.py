"""The P-EAGLE network and its COD training loss (the maths: the package docstring): the decoder layer,
``PEagleDrafter`` (fuse, mask entries, the entry forward training and drafting share, COD anchors and loss)."""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from models.core.acceptance import chain_tau
from models.core.norm import RMSNorm
from models.core.rope import apply_rope, rope_cos_sin, rope_inv_freq
from models.core.target import validate_layer_ids
from models.core.vocab import check_mapping, draft_to_target
from models.methods.peagle.config import PEagleConfig, check_config, default_layer_ids


class PEagleLayer(nn.Module):
    """A Llama decoder layer; ``first`` = EAGLE-3's layer 0 (attention input cat(norm(emb), hidden_norm(g)))."""

    def __init__(self, H: int, inter: int, heads: int, kv: int, hd: int, eps: float, first: bool,
                 norm_before_residual: bool = False):
        super().__init__()
        self.first, self.nbr = first, norm_before_residual
        self.heads, self.kv_heads, self.head_dim = heads, kv, hd
        width = 2 * H if first else H
        self.input_layernorm = RMSNorm(H, eps)
        if first:
            self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(width, heads * hd, bias=False),
                                        "k_proj": nn.Linear(width, kv * hd, bias=False),
                                        "v_proj": nn.Linear(width, kv * hd, bias=False),
                                        "o_proj": nn.Linear(heads * hd, H, bias=False)})
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(H, inter, bias=False),
                                  "up_proj": nn.Linear(H, inter, bias=False),
                                  "down_proj": nn.Linear(inter, H, bias=False)})

    def forward(self, x: Tensor, emb: Tensor | None, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None,
                mask: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, Q, H] (layer 0: g), emb [B, Q, H] (layer 0 only); past K/V [B, kv, P, d]; mask [B, 1, Q, P+Q]
        bool or None (causal). Returns (output, this call's K/V)."""
        b, q_len, _ = x.shape
        if self.first:
            inp = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], -1)
            residual = self.hidden_norm(x) if self.nbr else x
        else:
            inp, residual = self.input_layernorm(x), x
        a = self.self_attn
        q = apply_rope(a["q_proj"](inp).view(b, q_len, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(a["k_proj"](inp).view(b, q_len, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = a["v_proj"](inp).view(b, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        kk, vv = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if mask is None:  # causal on top of the past: query i sees keys <= P + i
            p = kk.shape[2] - q_len
            mask = torch.ones(q_len, p + q_len, dtype=torch.bool, device=x.device).tril(p)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        h = residual + a["o_proj"](o.transpose(1, 2).reshape(b, q_len, -1))
        m = self.post_attention_layernorm(h)
        return h + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](m)) * self.mlp["up_proj"](m)), (k, v)


def cod_visibility(anchor: Tensor, depth: Tensor, keep: Tensor) -> Tensor:
    """The training attention mask [B, Q, Q] (True = attend) over the entries [real ones | COD chain entries]:
    ``anchor`` [B, Q] each entry's anchor, ``depth`` [Q] its depth (0 = real), ``keep`` [B, Q] whether a chain
    entry is a sampled one (not padding)."""
    dev, q = anchor.device, anchor.shape[1]
    # visibility: real j <= a (a query's anchor) and, for chain queries, its own chain's depths 1..d
    is_real = depth == 0
    see_real = is_real[None, None, :] & (torch.arange(q, device=dev)[None, None, :] <= anchor[:, :, None])
    same = (anchor[:, :, None] == anchor[:, None, :]) & ~is_real[None, None, :] & ~is_real[None, :, None]
    same &= depth[None, None, :] <= depth[None, :, None]
    same &= keep[:, None, :] & keep[:, :, None]
    return see_real | same | torch.eye(q, dtype=torch.bool, device=dev)[None]  # padding: itself


EMBED, CHANGED_IDS, CHANGED_ROWS = "embed_tokens.weight", "embed_tokens.changed_ids", "embed_tokens.changed_rows"


class PEagleDrafter(nn.Module):
    """The P-EAGLE drafter (package docstring). State-dict names are speculators' P-EAGLE tensor names."""

    def __init__(self, cfg: PEagleConfig, tc: PretrainedConfig, embed_weight: Tensor, lm_head_weight: Tensor,
                 d2t: Tensor | None = None, t2d: Tensor | None = None):
        super().__init__()
        L, H, V = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size
        self.cfg = cfg
        check_config(asdict(cfg))  # the spec's own check (config.py), the same lines as the yaml path
        ids = list(cfg.layer_ids) if cfg.layer_ids is not None else default_layer_ids(L)
        if len(ids) != 3 or len(set(ids)) != 3:
            raise ValueError(f"P-EAGLE fuses 3 distinct target states (EAGLE-3's), got layer_ids={ids}")
        # ascending: the order engines fuse captured states in (vLLM sorts its capture layers, SGLang captures in
        # layer order), so fc's blocks need no permutation
        self.layer_ids = sorted(validate_layer_ids(ids, L))
        if L in self.layer_ids:
            raise ValueError(f"layer_ids={ids}: id {L} is the target's post-norm output here but the pre-norm state "
                             f"in vLLM's capture; use ids < {L}")
        if cfg.mask_token_id is None or not 0 <= int(cfg.mask_token_id) < V:
            raise ValueError(f"draft.config.mask_token_id={cfg.mask_token_id} is not a row of the target's "
                             f"embedding (0..{V - 1})")
        vd = cfg.draft_vocab_size or V
        if not 0 < vd <= V:
            raise ValueError(f"draft_vocab_size={vd} must be in 1..{V}")
        if d2t is None and t2d is None:
            t2d, d2t = torch.arange(V) < vd, torch.zeros(vd, dtype=torch.long)
        check_mapping(d2t, t2d)
        if d2t.numel() != vd or t2d.numel() != V:
            raise ValueError(f"d2t/t2d sizes ({d2t.numel()}, {t2d.numel()}) do not match draft_vocab_size={vd}")
        heads = tc.num_attention_heads
        kv = getattr(tc, "num_key_value_heads", None) or heads
        hd = int(getattr(tc, "head_dim", None) or H // heads)
        inter = cfg.intermediate_size or getattr(tc, "intermediate_size", None) or 3 * H
        eps = float(getattr(tc, "rms_norm_eps", 1e-6))
        self.vocab_size, self.draft_vocab_size, self.hidden_size, self.num_target_layers = V, vd, H, L
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = heads, kv, hd
        self.intermediate_size, self.rms_norm_eps = inter, eps
        self.final_logit_softcapping = getattr(tc, "final_logit_softcapping", None)

        self.embed_tokens = nn.Embedding(V, H)  # trainable, initialised from the target's
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight.detach().float())
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * H))
        self.layers = nn.ModuleList(PEagleLayer(H, inter, heads, kv, hd, eps, i == 0, cfg.norm_before_residual)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Parameter(lm_head_weight.detach().float()[draft_to_target(d2t)].clone(),
                                    requires_grad=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self._lm_head_full = lm_head_weight.detach()
        self._embed_target = embed_weight.detach()  # what pack_state/unpack_state diff the trained embedding against
        self._inv_freq, self._rope_factor, self.rope_parameters = rope_inv_freq(tc, hd)

    # Checkpoints store only the embedding rows training changed (a few tokens' worth of a [V, H] table: 15k of
    # SmolLM2's 49k rows, 17 of 57 MB in fp16); the rest is the target's, which every load has at hand.
    def pack_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        w = state.pop(EMBED)
        ids = (w != self._embed_target.to(w.device, torch.float32)).any(1).nonzero().flatten()
        return {**state, CHANGED_IDS: ids.cpu(), CHANGED_ROWS: w[ids].contiguous()}

    def unpack_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        if EMBED in state:  # the whole table (checkpoints written before the packed form)
            return state
        state = dict(state)
        ids, rows = state.pop(CHANGED_IDS, None), state.pop(CHANGED_ROWS, None)
        V, H = self._embed_target.shape
        if ids is None or rows is None:
            raise ValueError(f"neither {EMBED} nor {CHANGED_IDS} + {CHANGED_ROWS} is stored")
        if ids.dtype != torch.long or ids.dim() != 1 or rows.shape != (ids.numel(), H):
            raise ValueError(f"{CHANGED_IDS} {tuple(ids.shape)} {ids.dtype} and {CHANGED_ROWS} {tuple(rows.shape)} "
                             f"are not N int64 ids with N rows of {H}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != ids.numel()):
            raise ValueError(f"{CHANGED_IDS} holds ids outside 0..{V - 1} or repeats one")
        w = self._embed_target.to("cpu", torch.float32).clone()
        w[ids] = rows.float()
        return {**state, EMBED: w}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        with torch.no_grad():  # the frozen head rows follow the loaded draft vocabulary
            self.lm_head.copy_(self._lm_head_full.float()[draft_to_target(self.d2t).to(self._lm_head_full.device)])

    @property
    def draft_ids(self) -> Tensor:
        return draft_to_target(self.d2t)

    def config_dict(self) -> dict:
        d = asdict(self.cfg)
        d.update(method="peagle", layer_ids=list(self.layer_ids), draft_vocab_size=self.draft_vocab_size,
                 intermediate_size=self.intermediate_size, hidden_size=self.hidden_size,
                 num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                 head_dim=self.head_dim, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                 num_target_layers=self.num_target_layers)
        return d

    def fuse(self, hidden: dict[int, Tensor]) -> Tensor:
        return self.fc(torch.cat([hidden[k] for k in self.layer_ids], -1).to(self.fc.weight.dtype))

    def mask_entry(self, b: int, n: int) -> tuple[Tensor, Tensor]:
        """(emb(mask), fc(mask_hidden)) for n mask entries: [b, n, H] each."""
        dt = self.fc.weight.dtype
        e = self.embed_tokens.weight[int(self.cfg.mask_token_id)].to(dt).expand(b, n, -1)
        return e, self.fc(self.mask_hidden.to(dt)).expand(b, n, -1)

    def forward_entries(self, emb: Tensor, g: Tensor, positions: Tensor, past: list | None, mask: Tensor | None
                        ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Entries [B, Q] (emb, g [B, Q, H]) at positions [B, Q] on top of per-layer ``past`` K/V → (pre-norm
        outputs [B, Q, H], per-layer K/V of these entries)."""
        b, q = positions.shape
        cos, sin = rope_cos_sin(self._inv_freq, self._rope_factor, positions.reshape(-1).float(), g.dtype)
        cos, sin = cos.view(b, 1, q, -1), sin.view(b, 1, q, -1)
        x, kvs = g, []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, emb if i == 0 else None, cos, sin, None if past is None else past[i], mask)
            kvs.append(kv)
        return x, kvs

    def logits(self, x: Tensor) -> Tensor:
        z = self.norm(x) @ self.lm_head.t().to(x.dtype)
        cap = self.final_logit_softcapping
        return z if not cap else torch.tanh(z / cap) * cap

    # ------------------------------------------------------------------ training
    def cod_anchors(self, loss_mask: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per depth d = 1..K−1: (anchors [B, N_d], keep [B, N_d]); depth d's anchors are the first N_d of one
        random order of the valid anchors (a valid anchor: token a+2 is a training target)."""
        b, t = loss_mask.shape
        valid = torch.zeros_like(loss_mask, dtype=torch.bool)
        valid[:, :-2] = loss_mask[:, 2:].bool()
        n_valid = max(int(valid.sum(1).max()), 1)
        c = self.cfg
        n1 = min(c.max_anchors, n_valid)
        score = torch.rand(b, t, device=loss_mask.device).masked_fill(~valid, -1.0)
        top = score.topk(n1, dim=1)
        out = []
        for d in range(1, c.num_depths):
            nd = min(n1, math.ceil(n_valid * max(c.down_sample_ratio ** d, c.down_sample_ratio_min)))
            keep = top.values[:, :nd] >= 0
            out.append((torch.where(keep, top.indices[:, :nd], 0), keep))
        return out

    def training_loss(self, input_ids: Tensor, loss_mask: Tensor, hidden: dict[int, Tensor],
                      target_logits: Tensor) -> tuple[Tensor, dict[str, float]]:
        b, t = input_ids.shape
        dev = input_ids.device
        chains = self.cod_anchors(loss_mask)
        g0 = self.fuse(hidden)
        nxt = torch.cat([input_ids[:, 1:], input_ids.new_full((b, 1), int(self.cfg.mask_token_id))], 1)
        e0 = self.embed_tokens(nxt).to(g0.dtype)  # entry i reads t_{i+1}
        sizes = [a.shape[1] for a, _ in chains]
        nm = sum(sizes)
        em, gm = self.mask_entry(b, nm)
        anchor = torch.cat([torch.arange(t, device=dev).expand(b, t)] + [a for a, _ in chains], 1)  # [B, Q]
        depth = torch.cat([torch.zeros(t, dtype=torch.long, device=dev)]
                          + [torch.full((n,), d + 1, dtype=torch.long, device=dev) for d, n in enumerate(sizes)])
        keep = torch.cat([torch.ones(b, t, dtype=torch.bool, device=dev)] + [k for _, k in chains], 1)
        mask = cod_visibility(anchor, depth, keep)
        x, _ = self.forward_entries(torch.cat([e0, em], 1), torch.cat([g0, gm], 1), anchor + depth, None,
                                    mask[:, None])
        # labels: entry (a, d) predicts t_{a+d+2} = the target's choice at a+d+1
        lab = anchor + depth + 1
        valid = keep & (lab + 1 < t)
        lab = lab.clamp_max(t - 1)
        valid &= loss_mask.gather(1, (lab + 1).clamp_max(t - 1)).bool()
        tl = target_logits.gather(1, lab[:, :, None].expand(-1, -1, target_logits.shape[-1]))
        if self.cfg.label_path == "greedy":  # tokens a+2..a+d+1 on the target's greedy path
            on = torch.zeros_like(input_ids, dtype=torch.bool)
            on[:, 1:] = input_ids[:, 1:] == target_logits[:, :-1].argmax(-1)
            bad = (~on).long().cumsum(1)  # off-path tokens up to each position
            lo, hi = (anchor + 1).clamp_max(t - 1), lab.clamp_max(t - 1)  # tokens a+2..a+d+1 (none at depth 0)
            valid &= (bad.gather(1, hi) - bad.gather(1, lo) == 0) | (depth[None] == 0)
        return self._scored(x, tl, valid, anchor, sizes, t)

    def _scored(self, x: Tensor, tl: Tensor, valid: Tensor, anchor: Tensor, sizes: list[int], t: int
                ) -> tuple[Tensor, dict[str, float]]:
        """x [B, Q, H] entry outputs, tl [B, Q, V] their teacher logits, valid [B, Q]; the entries are [t real |
        sizes[0] depth-1 | sizes[1] depth-2 | …], column j of every depth being the same chain."""
        ids = self.draft_ids.to(x.device)
        top = tl.argmax(-1)
        valid = valid & self.t2d.to(x.device)[top]  # a label outside the draft vocabulary cannot be drafted
        logits = self.logits(x).float()
        p = torch.softmax(tl.float()[..., ids], -1)
        ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
        hit = (ids[logits.argmax(-1)] == top) & valid
        loss = torch.zeros((), device=x.device)
        metrics: dict[str, float] = {}
        accs: list[float] = []
        starts = [0, t]
        for n in sizes:
            starts.append(starts[-1] + n)
        prefix = None  # per chain: depths < d all agreed
        for d in range(len(starts) - 1):
            sl = slice(starts[d], starts[d + 1])
            v, h, c = valid[:, sl], hit[:, sl], ce[:, sl]
            loss = loss + (c * v).sum() / v.sum().clamp_min(1) / self.cfg.num_depths
            tried = v if prefix is None else v & prefix[:, : v.shape[1]]
            n_k = int(tried.sum())
            accs.append(float((tried & h).sum()) / max(n_k, 1))
            metrics[f"loss_{d}"] = float((c.detach() * v).sum() / v.sum().clamp_min(1))
            metrics[f"acc_{d}"], metrics[f"n_{d}"] = accs[-1], float(n_k)
            if d + 1 < len(starts) - 1:
                nxt = sizes[d]
                if prefix is None:  # the depth-0 entry at each chain's anchor
                    prefix = h.gather(1, anchor[:, t : t + nxt])
                else:
                    prefix = (tried & h)[:, :nxt]
        metrics["loss"] = float(loss.detach())
        metrics["sim_tau"] = chain_tau(accs)
        return loss, metrics
