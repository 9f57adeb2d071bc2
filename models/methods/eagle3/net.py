"""The EAGLE-3 network and its training loss (maths and TTT index conventions: the package docstring): attention,
MLP, decoder layer, ``Eagle3Drafter`` (fuse, training-time-test forward and loss, a cache-free greedy draft) and the
held-out ``rank_metrics`` that size the EAGLE-2 tree. Training and export read this module; drafting with a KV cache
is ``kernels.py``."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from models.core.acceptance import chain_tau
from models.core.drafter import DraftVocabTeacher
from models.core.norm import RMSNorm
from models.core.rope import apply_rope, rope_cos_sin, rope_inv_freq
from models.core.target import validate_layer_ids
from models.core.vocab import check_mapping, draft_to_target
from models.methods.eagle3.config import Eagle3Config, decoder_shape, fused_layer_ids


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # [B, n_kv, T, d] → [B, n_kv * n_rep, T, d]; query head h uses kv head h // n_rep (HF repeat_kv)
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of the step-k queries in training-time test (k = len(keys) - 1).

    q: [B, nh, T, d] (RoPE applied); keys/values: per step s = 0..k, [B, nh, T, d] (already expanded
    for GQA). Query i sees keys[0][j] for j <= i (causal) and keys[s][i] for s = 1..k (diagonal).
    The causal block is a [T, T] matmul; the diagonal terms are elementwise dot products; both are
    normalised by one shared logsumexp, so no [T(k+1), T(k+1)] mask is ever built.
    Returns [B, nh, T, d].
    """
    T = q.shape[-2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ keys[0].transpose(-1, -2)).float() * scale                       # [B, nh, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s0, dim=-1)                                            # [B, nh, T]
    if len(keys) > 1:
        diag = torch.stack([(q * k).sum(-1) for k in keys[1:]], dim=-1).float() * scale  # [B, nh, T, k]
        lse = torch.logaddexp(lse, torch.logsumexp(diag, dim=-1))
    out = torch.exp(s0 - lse.unsqueeze(-1)).to(q.dtype) @ values[0]
    for s in range(1, len(keys)):
        w = torch.exp(diag[..., s - 1] - lse).to(q.dtype).unsqueeze(-1)         # [B, nh, T, 1]
        out = out + w * values[s]
    return out


class Eagle3Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        # q/k/v read the 2H concatenation [input_layernorm(emb); hidden_norm(g)]
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, 2H] → q [B, nh, T, d], k/v [B, nh, T, d] (RoPE on q/k, kv expanded for GQA)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        n_rep = self.heads // self.kv_heads
        return apply_rope(q, cos, sin), _expand_kv(apply_rope(k, cos, sin), n_rep), _expand_kv(v, n_rep)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float, bias: bool, act: str, norm_before_residual: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Eagle3Attention(hidden, heads, kv_heads, head_dim, bias)
        self.mlp = Eagle3MLP(hidden, intermediate, act)
        self.norm_before_residual = norm_before_residual

    def pre(self, emb: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [B, T, 2H], residual [B, T, H]) for embeddings ``emb`` and states ``h``."""
        hn = self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(emb), hn], dim=-1)
        return x, (hn if self.norm_before_residual else h)

    def post(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then the SwiGLU block: the pre-norm output ``a`` [B, T, H]."""
        a = residual + self.self_attn.out(attn)
        return a + self.mlp(self.post_attention_layernorm(a))


def _check_vocab_inputs(cfg: Eagle3Config, V: int, H: int, embed_weight: Tensor, d2t: Tensor | None,
                        t2d: Tensor | None) -> None:
    """The draft vocabulary (d2t/t2d) and the target embedding fit the config and the target (vocab V, hidden H)."""
    if not 0 < cfg.draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} exceeds the target vocab ({V}) or is <= 0; "
                         f"set draft_vocab_size <= {V}")
    check_mapping(d2t, t2d)
    if d2t.numel() != cfg.draft_vocab_size or t2d.numel() != V:
        raise ValueError(f"d2t/t2d sizes ({d2t.numel()}, {t2d.numel()}) do not match draft_vocab_size="
                         f"{cfg.draft_vocab_size} and target vocab {V}; rebuild them with build_draft_vocab")
    if tuple(embed_weight.shape) != (V, H):
        raise ValueError(f"embedding weight has shape {tuple(embed_weight.shape)} but the target config says "
                         f"[vocab_size={V}, hidden_size={H}]; pass the target's input embedding")


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft head for a frozen target (see the package docstring for the exact maths)."""

    reads_draft_vocab_teacher = True  # _teacher reads the target's argmax and its draft-vocab logits only

    def __init__(self, cfg: Eagle3Config, target_config: PretrainedConfig, embed_weight: torch.Tensor,
                 d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        """``d2t``/``t2d``: the draft vocabulary (models/core/vocab.py); None → the first draft_vocab_size target ids,
        the shape a checkpoint's own buffers then overwrite (``rebuild``)."""
        super().__init__()
        tc = target_config
        L, H, V = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size
        if d2t is None and t2d is None and 0 < cfg.draft_vocab_size <= V:
            t2d = torch.arange(V) < cfg.draft_vocab_size
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        # validate, in this order: the fused layer ids, the draft vocabulary + embedding, the decoder layer's shape
        self.layer_ids = validate_layer_ids(fused_layer_ids(cfg, L), L)
        _check_vocab_inputs(cfg, V, H, embed_weight, d2t, t2d)
        hidden, intermediate, heads, kv_heads, head_dim, eps, bias, act = decoder_shape(cfg, tc)

        self.cfg = cfg
        self.vocab_size, self.draft_vocab_size = V, cfg.draft_vocab_size
        self.hidden_size, self.intermediate_size = hidden, intermediate
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.rms_norm_eps, self.attention_bias, self.hidden_act = eps, bias, act
        self.target_hidden_size = H

        self.embed_tokens = nn.Embedding(V, H)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight.detach().float())
        self.embed_tokens.weight.requires_grad_(False)
        if cfg.norm_before_fc and cfg.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive (one norm over the concatenation, "
                             "or one per state): set at most one of them")
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * H, eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(H, eps) for _ in range(3))
        self.fc = nn.Linear(3 * H, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(hidden, intermediate, heads, kv_heads, head_dim, eps, bias, act,
                                           cfg.norm_before_residual)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        if cfg.lm_head == "target_frozen":  # the target's rows (build copies them), kept: saved, never trained
            self.lm_head.weight.requires_grad_(False)
            self.saved_frozen = ("lm_head.weight",)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        # Plain attribute, not a buffer: named_parameters/named_buffers stay exactly the export names.
        self._inv_freq, self.rope_scaling_factor, self.rope_parameters = rope_inv_freq(tc, head_dim)

    # ------------------------------------------------------------------ pieces
    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id (LongTensor [Vd]), derived from the d2t buffer."""
        return draft_to_target(self.d2t)

    def config_dict(self) -> dict:
        d = asdict(self.cfg)
        d.update(method="eagle3", layer_ids=list(self.layer_ids), hidden_size=self.hidden_size,
                 intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
                 num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                 rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias, hidden_act=self.hidden_act,
                 vocab_size=self.vocab_size, target_hidden_size=self.target_hidden_size,
                 rope_parameters=copy.deepcopy(self.rope_parameters))
        return d

    def rope(self, T: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, d] for positions offset..offset+T-1."""
        pos = torch.arange(offset, offset + T, device=self.fc.weight.device, dtype=torch.float32)
        return rope_cos_sin(self._inv_freq, self.rope_scaling_factor, pos, self.fc.weight.dtype)

    def fuse(self, hidden: dict[int, torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """g = fc(cat of the 3 target states in layer_ids order): [B, T, H].

        Accepts the {layer id → [B, T, H]} dict of models/core/target.py, an already concatenated
        [B, T, 3H] tensor, or an already fused [B, T, H] tensor (returned as is).
        """
        dtype = self.fc.weight.dtype
        if isinstance(hidden, dict):
            missing = [k for k in self.layer_ids if k not in hidden]
            if missing:
                raise ValueError(f"hidden states for layer ids {missing} missing (got {sorted(hidden)}); "
                                 f"call the target with layer_ids={self.layer_ids}")
            hidden = torch.cat([hidden[k].to(dtype) for k in self.layer_ids], dim=-1)
        H = self.target_hidden_size
        if hidden.shape[-1] == 3 * H:
            hidden = hidden.to(dtype)
            if self.training and self.cfg.hidden_noise > 0:  # training-time augmentation (config.hidden_noise)
                hidden = hidden + torch.randn_like(hidden) * self.cfg.hidden_noise
            if self.cfg.norm_before_fc:
                hidden = self.input_norm(hidden)
            elif self.cfg.fc_norm:
                hidden = torch.cat([n(c) for n, c in zip(self.fc_norm, hidden.chunk(3, dim=-1))], dim=-1)
            return self.fc(hidden)
        if hidden.shape[-1] == self.hidden_size:
            return hidden.to(dtype)
        raise ValueError(f"hidden states have last dim {hidden.shape[-1]}; expected {3 * H} (3 fused target states) "
                         f"or {self.hidden_size} (already fused)")

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [.., Vd] from the state a step hands on (``carry``): lm_head(norm(a)) either way."""
        return self.lm_head(a if self.cfg.norm_output else self.norm(a))

    def carry(self, a: torch.Tensor) -> torch.Tensor:
        """The state the next draft step reads: the layer output ``a``, or norm(a) under norm_output (EAGLE-3.1,
        speculators ``norm_output``). Every step's output goes through here, so ``logits`` takes it as is."""
        return self.norm(a) if self.cfg.norm_output else a

    # ------------------------------------------------------------------ training-time test
    def ttt_forward(self, input_ids: torch.Tensor, hidden: dict[int, torch.Tensor] | torch.Tensor,
                    steps: int | None = None) -> list[torch.Tensor]:
        """Unrolled TTT forward: per step k, draft logits [B, T, Vd] at every position i.

        Step k at position i reads emb(t_{i+1+k}) and its own step k-1 output at i (step 0: g_i);
        positions whose input token lies past the end get a zero embedding (their outputs are
        masked by the loss, and causality keeps them out of every earlier position).
        """
        K = self.cfg.ttt_steps if steps is None else steps
        B, T = input_ids.shape
        g = self.fuse(hidden)
        if g.shape[:2] != (B, T):
            raise ValueError(f"hidden states have shape {tuple(g.shape[:2])} but input_ids {(B, T)}")
        with torch.no_grad():
            emb_all = self.embed_tokens(input_ids).to(g.dtype)
        layer, attn = self.midlayer, self.midlayer.self_attn
        scale = 1.0 / math.sqrt(self.head_dim)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        h = g
        for k in range(K):
            x, residual = layer.pre(_shift(emb_all, 1 + k), h)
            cos, sin = self.rope(T, offset=k)
            q, kk, vv = attn.qkv(x, cos, sin)
            keys.append(kk)
            values.append(vv)
            h = self.carry(layer.post(ttt_attention(q, keys, values, scale), residual))
            out.append(self.logits(h))
        return out

    def training_loss(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: dict[int, torch.Tensor],
                      target_logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Σ_k step_weight^k · L_k with L_k the masked mean soft cross-entropy of step k.

        L_k = mean over positions i of -Σ_v p̃_{i+1+k}(v) log q_k,i(v), where p̃ is the target softmax
        over the draft-vocab columns only, and position i counts when token t_{i+2+k} exists and has
        loss_mask 1, and the target's full-vocab argmax at i+1+k is a draft-vocab token.
        Metrics: loss, loss_k, acc_k (draft argmax as target id == target argmax), n_k (counted
        positions, for aggregation), sim_tau.
        """
        teacher = self._teacher(input_ids, loss_mask, target_logits)
        step_logits = self.ttt_forward(input_ids, hidden)
        total = torch.zeros((), device=step_logits[0].device)
        metrics: dict[str, float] = {}
        accs: list[float] = []
        for k, logits in enumerate(step_logits):
            loss_k, step_metrics = self._step_loss(k, logits, *teacher)
            total = total + (self.cfg.step_weight ** k) * loss_k
            accs.append(step_metrics[f"acc_{k}"])
            metrics.update(step_metrics)
        metrics["loss"] = float(total.detach())
        metrics["sim_tau"] = chain_tau(accs)
        return total, metrics

    def _teacher(self, input_ids: Tensor, loss_mask: Tensor, target_logits: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What every TTT step is scored against (no gradient), after checking the shapes: the target's argmax
        [B, T] (target ids), whether it is a draft-vocab token [B, T], the target softmax over the draft-vocab
        columns [B, T, Vd], and the loss mask as bool [B, T]."""
        B, T = input_ids.shape
        if tuple(loss_mask.shape) != (B, T):
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != input_ids shape {(B, T)}")
        if isinstance(target_logits, DraftVocabTeacher):  # offline: argmax stored, logits at draft_ids only
            if not torch.equal(target_logits.draft_ids, self.draft_ids):
                raise ValueError("the teacher's draft vocabulary is not this drafter's (d2t/t2d changed)")
            target_top, draft_logits = target_logits.top, target_logits.logits
        else:
            if tuple(target_logits.shape) != (B, T, self.vocab_size):
                raise ValueError(f"target_logits shape {tuple(target_logits.shape)} != {(B, T, self.vocab_size)} "
                                 "[batch, seq, target vocab]")
            target_top, draft_logits = None, target_logits.detach().index_select(-1, self.draft_ids)
        with torch.no_grad():
            if target_top is None:
                target_top = target_logits.detach().argmax(-1)                      # [B, T] target ids
            in_draft = self.t2d[target_top]                                         # [B, T]
            p_draft = torch.softmax(draft_logits.float(), dim=-1)                   # [B, T, Vd]
            lm = loss_mask.bool()
        return target_top, in_draft, p_draft, lm

    def _step_loss(self, k: int, logits: Tensor, target_top: Tensor, in_draft: Tensor, p_draft: Tensor, lm: Tensor
                   ) -> tuple[Tensor, dict[str, float]]:
        """Step k's L_k (masked mean soft cross-entropy of its logits [B, T, Vd]) and its metrics loss_k, acc_k,
        n_k, plus the held-out ``rank_metrics`` in eval mode."""
        with torch.no_grad():
            # step k at i predicts t_{i+2+k} against p_{i+1+k}
            mask = _shift(lm, 2 + k) & _shift(in_draft, 1 + k)                      # [B, T]
            n = int(mask.sum())
        p = _shift(p_draft, 1 + k)
        logq = torch.log_softmax(logits.float(), dim=-1)
        ce = -(p * logq).sum(-1)                                                    # [B, T]
        loss_k = (ce * mask).sum() / max(n, 1)
        with torch.no_grad():
            pred = self.draft_ids[logits.argmax(-1)]
            correct = int(((pred == _shift(target_top, 1 + k)) & mask).sum())
        acc = correct / n if n else 0.0
        metrics = {f"loss_{k}": float(loss_k.detach()), f"acc_{k}": acc, f"n_{k}": float(n)}
        if not self.training:  # held-out only: what sizes the EAGLE-2 tree (``rank_metrics``)
            metrics.update(rank_metrics(logits.detach(), _shift(p_draft, 1 + k), _shift(target_top, 1 + k),
                                        self.draft_ids, mask, k))
        return loss_k, metrics

    # ------------------------------------------------------------------ proposal
    @torch.no_grad()
    def draft_greedy(self, hidden: dict[int, torch.Tensor] | torch.Tensor, prefix_tokens: torch.Tensor,
                     num_speculative_tokens: int, return_logits: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """K = num_speculative_tokens greedy draft tokens (target ids, [B, K]) after a verified prefix, without a
        KV cache.

        ``hidden``: the target's states for tokens t_0..t_n (dict, [B, n+1, 3H] or fused [B, n+1, H]);
        ``prefix_tokens``: t_0..t_{n+1} [B, n+2] (includes the target's newest token t_{n+1}).
        The prefix entries are (emb(t_{i+1}), g_i) at positions 0..n; draft s >= 1 enters at position
        n+s as (emb(d_s), a of the previous entry). Every step recomputes the layer with plain causal
        attention over [prefix; drafts] — the inference view that TTT's mask reproduces.
        With ``return_logits`` also returns the draft-vocab logits [B, K, Vd].
        """
        if num_speculative_tokens <= 0:
            raise ValueError(f"draft_greedy needs num_speculative_tokens >= 1, got {num_speculative_tokens}")
        g = self.fuse(hidden)
        B, P = g.shape[:2]
        if tuple(prefix_tokens.shape) != (B, P + 1):
            raise ValueError(f"prefix_tokens shape {tuple(prefix_tokens.shape)} must be {(B, P + 1)}: "
                             "one more token than hidden states (t_0..t_{n+1} for states 0..n)")
        layer, attn = self.midlayer, self.midlayer.self_attn
        emb = self.embed_tokens(prefix_tokens[:, 1:]).to(g.dtype)
        h = g
        ids, all_logits = [], []
        for _ in range(num_speculative_tokens):
            T = emb.shape[1]
            x, residual = layer.pre(emb, h)
            cos, sin = self.rope(T, offset=0)
            q, kk, vv = attn.qkv(x, cos, sin)
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=1.0 / math.sqrt(self.head_dim))
            a_last = self.carry(layer.post(o, residual)[:, -1:])                     # [B, 1, H]
            logits = self.logits(a_last)
            tok = self.draft_ids[logits.argmax(-1)]                                  # [B, 1] target ids
            ids.append(tok)
            all_logits.append(logits)
            emb = torch.cat([emb, self.embed_tokens(tok).to(g.dtype)], dim=1)
            h = torch.cat([h, a_last], dim=1)
        out = torch.cat(ids, dim=1)
        return (out, torch.cat(all_logits, dim=1)) if return_logits else out


RANKS = 4  # draft ranks measured per step on held-out data (tree sizing)


@torch.no_grad()
def rank_metrics(logits: Tensor, p_target: Tensor, target_top: Tensor, draft_ids: Tensor, mask: Tensor,
                 k: int) -> dict[str, float]:
    """Per TTT step k (the chain's depth k+1, its path teacher-forced): for the drafter's rank-r token,
    ``top{j}_{k}`` = P(the target's argmax is among ranks < j) (greedy acceptance of a tree's rank-j siblings)
    and ``mass{j}_{k}`` = E[target probability of ranks < j] (their acceptance when the target samples at T=1).
    Weighted by n_k like acc_k. logits [B, T, Vd], p_target [B, T, Vd] (the target's softmax on draft ids),
    target_top [B, T] its argmax (target id), draft_ids [Vd] the target id of each draft id, mask [B, T] the
    positions step k is scored at."""
    n = mask.sum().clamp_min(1)
    top = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices  # [B, T, R]
    hit = (draft_ids[top] == target_top[..., None]).cumsum(-1).bool() & mask[..., None]
    mass = (p_target.gather(-1, top).cumsum(-1) * mask[..., None]).sum((0, 1))
    out = {}
    for j in range(1, top.shape[-1] + 1):
        out[f"top{j}_{k}"] = float(hit[..., j - 1].sum() / n)
        out[f"mass{j}_{k}"] = float(mass[j - 1] / n)
    return out


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded at the end with zeros/False back to length T (dim 1)."""
    T = x.shape[1]
    if n >= T:
        return torch.zeros_like(x)
    pad = torch.zeros((x.shape[0], n, *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)
