"""EAGLE-3 drafter: module, training-time-test loss and a simple greedy proposal.

Architecture (arXiv 2503.01840; DESIGN.md §2), for a target with hidden size H and vocab V:

    g  = fc(cat(h_{l0}, h_{l1}, h_{l2}))                 fc: 3H → H, no bias
    x  = cat(input_layernorm(emb(t)), hidden_norm(g))    2H, embedding first
    a' = g + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))     (residual = hidden_norm(g) if norm_before_residual)
    a  = a' + mlp(post_attention_layernorm(a'))          SwiGLU
    q  = softmax(lm_head(norm(a)))                       over the Vd draft ids (models/vocab.py)

``a`` (before ``norm``) is what the next draft step receives in place of ``g``. EAGLE-3.1 options (speculators'
names): ``norm_before_fc`` / ``fc_norm`` normalise the three states (jointly / each) before ``fc``; ``norm_output``
hands the next step norm(a) instead of a.

Parameter and buffer names match the native export (``fc.weight``, ``midlayer.self_attn.q_proj.weight``,
…, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``) plus ``embed_tokens.weight`` (frozen copy of
the target's embedding, dropped at export).

Index conventions for training-time test (TTT), tokens t_0..t_{T-1}, g_i the fused target state at
position i, target logits p_i predicting t_{i+1}:

    step 0 at position i:  input (emb(t_{i+1}), g_i),          RoPE position i,   target p_{i+1} (token t_{i+2})
    step k at position i:  input (emb(t_{i+1+k}), a^{k-1}_i),  RoPE position i+k, target p_{i+1+k} (token t_{i+2+k})

A step-k query at position i attends to step-0 keys at positions j <= i and to the step-1..k keys of
its own position i only — exactly what the same query sees at inference, where the prefix was
processed once (step 0) and the chain's earlier drafts sit at positions i+1..i+k.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from models.drafter import simulated_tau
from models.methods.eagle3 import export
from models.norm import RMSNorm
from models.proposal import (
    MAX_TREE_NODES,
    PerRowProposers,
    Proposal,
    Sampling,
    chain_proposal,
    check_k,
    pick_token,
    right_pad,
)
from models.ragged import RaggedKV
from models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from models.spec import MethodSpec, ProposerSpec
from models.target import FrozenTarget, validate_layer_ids
from models.tree import tree_layout
from models.vocab import build_draft_vocab, check_mapping, count_tokens, draft_to_target


@dataclass
class Eagle3Config:
    # Hidden-state ids in the models/target.py convention (index into HF output_hidden_states);
    # None → (2, L//2, L-3), EAGLE-3's (1, L//2-1, L-4) "output of layer" ids.
    layer_ids: list[int] | None = None
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    step_weight: float = 0.8
    # Decoder shape overrides; None → the target's value.
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    # Saved by config_dict and read back, so a reload rebuilds the shapes it was trained with even where the
    # target's head_dim != hidden/heads (Gemma, Qwen3, DeepSeek-V3, gpt-oss, Mistral-Nemo).
    head_dim: int | None = None
    # False: residual = g (EAGLE-3 original, native SGLang/vLLM loader); True: residual = hidden_norm(g).
    norm_before_residual: bool = False
    # EAGLE-3.1 (speculators 0.9.0 Eagle3SpeculatorConfig; same names, same tensors). Defaults = EAGLE-3.
    norm_before_fc: bool = False  # one RMSNorm over cat(h_0, h_1, h_2) [3H] before fc (tensor input_norm.weight)
    fc_norm: bool = False  # one RMSNorm per fused state before the cat (tensors fc_norm.{i}.weight [H])
    norm_output: bool = False  # the next step reads norm(a) instead of a; logits lm_head(norm(a)) either way


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's fused layers (2, L//2, L-3) in our hidden-state index convention."""
    return [2, num_layers // 2, num_layers - 3]


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


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft head for a frozen target (see the module docstring for the exact maths)."""

    def __init__(self, cfg: Eagle3Config, target_config: PretrainedConfig, embed_weight: torch.Tensor,
                 d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        """``d2t``/``t2d``: the draft vocabulary (models/vocab.py); None → the first draft_vocab_size target ids,
        the shape a checkpoint's own buffers then overwrite (``rebuild``)."""
        super().__init__()
        tc = target_config
        L, H, V = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size
        if d2t is None and t2d is None and 0 < cfg.draft_vocab_size <= V:
            t2d = torch.arange(V) < cfg.draft_vocab_size
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        if cfg.layer_ids is None:
            ids = default_layer_ids(L)
            if len(set(ids)) != 3 or min(ids) < 0:
                raise ValueError(f"default EAGLE-3 layer ids (2, L//2, L-3) = {ids} are invalid for a {L}-layer "
                                 "target; set layer_ids to 3 distinct ids in 0..L explicitly")
        else:
            ids = list(cfg.layer_ids)
        if len(ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 hidden states, got layer_ids={ids}; pass 3 ids in 0..{L}")
        self.layer_ids = validate_layer_ids(ids, L)

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

        hidden = cfg.hidden_size or H
        if hidden != H:
            raise ValueError(f"hidden_size={hidden} differs from the target's {H}: the drafter reuses the target's "
                             "embedding, so its hidden size must equal the target's; drop the override")
        heads = cfg.num_attention_heads or tc.num_attention_heads
        kv_heads = cfg.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if cfg.head_dim:
            head_dim = int(cfg.head_dim)
        elif cfg.num_attention_heads is None and getattr(tc, "head_dim", None):
            head_dim = int(tc.head_dim)
        elif hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        else:
            head_dim = hidden // heads
        intermediate = cfg.intermediate_size or tc.intermediate_size
        eps = float(getattr(tc, "rms_norm_eps", 1e-6))
        bias = bool(getattr(tc, "attention_bias", False))
        act = getattr(tc, "hidden_act", "silu")

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

        Accepts the {layer id → [B, T, H]} dict of models/target.py, an already concatenated
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
        B, T = input_ids.shape
        if tuple(loss_mask.shape) != (B, T):
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != input_ids shape {(B, T)}")
        if tuple(target_logits.shape) != (B, T, self.vocab_size):
            raise ValueError(f"target_logits shape {tuple(target_logits.shape)} != {(B, T, self.vocab_size)} "
                             "[batch, seq, target vocab]")
        with torch.no_grad():
            tl = target_logits.detach()
            target_top = tl.argmax(-1)                                              # [B, T] target ids
            in_draft = self.t2d[target_top]                                         # [B, T]
            p_draft = torch.softmax(tl.index_select(-1, self.draft_ids).float(), dim=-1)  # [B, T, Vd]
            lm = loss_mask.bool()
        step_logits = self.ttt_forward(input_ids, hidden)
        total = torch.zeros((), device=step_logits[0].device)
        metrics: dict[str, float] = {}
        accs: list[float] = []
        for k, logits in enumerate(step_logits):
            with torch.no_grad():
                # step k at i predicts t_{i+2+k} against p_{i+1+k}
                mask = _shift(lm, 2 + k) & _shift(in_draft, 1 + k)                  # [B, T]
                n = int(mask.sum())
            p = _shift(p_draft, 1 + k)
            logq = torch.log_softmax(logits.float(), dim=-1)
            ce = -(p * logq).sum(-1)                                                # [B, T]
            loss_k = (ce * mask).sum() / max(n, 1)
            total = total + (self.cfg.step_weight ** k) * loss_k
            with torch.no_grad():
                pred = self.draft_ids[logits.argmax(-1)]
                correct = int(((pred == _shift(target_top, 1 + k)) & mask).sum())
            acc = correct / n if n else 0.0
            accs.append(acc)
            metrics[f"loss_{k}"] = float(loss_k.detach())
            metrics[f"acc_{k}"] = acc
            metrics[f"n_{k}"] = float(n)
            if not self.training:  # held-out only: what sizes the EAGLE-2 tree (``rank_metrics``)
                metrics.update(rank_metrics(logits.detach(), _shift(p_draft, 1 + k), _shift(target_top, 1 + k),
                                            self.draft_ids, mask, k))
        metrics["loss"] = float(total.detach())
        metrics["sim_tau"] = simulated_tau(accs)
        return total, metrics

    # ------------------------------------------------------------------ proposal
    @torch.no_grad()
    def draft_greedy(self, hidden: dict[int, torch.Tensor] | torch.Tensor, prefix_tokens: torch.Tensor, k: int,
                     return_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """k greedy draft tokens (target ids, [B, k]) after a verified prefix, without a KV cache.

        ``hidden``: the target's states for tokens t_0..t_n (dict, [B, n+1, 3H] or fused [B, n+1, H]);
        ``prefix_tokens``: t_0..t_{n+1} [B, n+2] (includes the target's newest token t_{n+1}).
        The prefix entries are (emb(t_{i+1}), g_i) at positions 0..n; draft s >= 1 enters at position
        n+s as (emb(d_s), a of the previous entry). Every step recomputes the layer with plain causal
        attention over [prefix; drafts] — the inference view that TTT's mask reproduces.
        With ``return_logits`` also returns the draft-vocab logits [B, k, Vd].
        """
        if k <= 0:
            raise ValueError(f"draft_greedy needs k >= 1 draft tokens, got k={k}")
        g = self.fuse(hidden)
        B, P = g.shape[:2]
        if tuple(prefix_tokens.shape) != (B, P + 1):
            raise ValueError(f"prefix_tokens shape {tuple(prefix_tokens.shape)} must be {(B, P + 1)}: "
                             "one more token than hidden states (t_0..t_{n+1} for states 0..n)")
        layer, attn = self.midlayer, self.midlayer.self_attn
        emb = self.embed_tokens(prefix_tokens[:, 1:]).to(g.dtype)
        h = g
        ids, all_logits = [], []
        for _ in range(k):
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


# ---------------------------------------------------------------------------------------------------------------
# Inference with a KV cache (used by the proposers below). Entries follow the training convention above: the "real"
# entry at position i reads (emb(t_{i+1}), g_i) and sits at RoPE position i; a drafted token at depth s after the
# last real entry (position n) reads (emb(d_s), a of its parent entry) and sits at RoPE position n + s.
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
            grown_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            grown_v = v.new_empty(grown_k.shape)
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
        qkv = lambda x: F.linear(x, w_qkv, b_qkv)  # noqa: E731
        gate_up = lambda x: F.linear(x, w_gu)  # noqa: E731
    cached = {"key": key, "qkv": qkv, "gate_up": gate_up, "cos": None, "sin": None}
    drafter.__dict__["_infer_cache"] = cached
    return cached


def rope_at(drafter: Eagle3Drafter, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [M, d] for arbitrary RoPE positions [M] (tree siblings share a position), read from a table
    that grows by doubling (one gather per step instead of ~8 small ops)."""
    w = _inference_weights(drafter)
    need = int(positions.max()) + 1
    if w["cos"] is None or w["cos"].shape[0] < need:
        pos = torch.arange(max(256, 2 * need), device=drafter.fc.weight.device, dtype=torch.float32)
        w["cos"], w["sin"] = rope_cos_sin(drafter._inv_freq, drafter.rope_scaling_factor, pos, drafter.fc.weight.dtype)
    idx = positions.to(w["cos"].device)
    return w["cos"][idx], w["sin"][idx]


def entry_qkv(drafter: Eagle3Drafter, token_ids: Tensor, h: Tensor, positions: Tensor
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
    cos, sin = rope_at(drafter, positions)
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
) -> torch.Tensor:
    """One midlayer pass for M new entries over the first ``start`` entries of the cache ``kv``.

    ``token_ids`` [B, M]: target ids whose embedding each entry reads; ``h`` [B, M, H]: the state it reads
    (fused target state g for real entries, the parent entry's output ``a`` for drafted ones);
    ``positions`` [M] RoPE positions; the new entries' K/V (RoPE applied, GQA-expanded) are written to ``kv``
    at [start, start+M); ``mask`` [M, start + M] bool (True = attend), None = every earlier entry plus causal
    among the new ones. Returns ``drafter.carry(a)`` [B, M, H] (``drafter.logits`` of it scores the next token).
    Same maths as the training forward, with q/k/v and gate/up each fused into one matmul.
    """
    q, k, v, residual = entry_qkv(drafter, token_ids, h, positions)
    M = q.shape[2]
    keys, values = kv.write(start, k, v)
    if mask is None and M > 1:
        total = start + M
        mask = torch.ones(M, total, dtype=torch.bool, device=q.device).tril(total - M)  # causal, past all visible
    return entry_out(drafter, q, keys, values, mask, residual)


# --------------------------------------------------------------------------------------------- proposers

class _Eagle3Base:
    """KV cache of the drafter's "real" entries (built from the target's fused states, models/methods/eagle3
    convention: entry i reads (emb(x_{i+1}), g_i) at RoPE position i). Drafted entries never enter it."""

    def __init__(self, drafter, weights: str = "float32"):
        self.drafter = inference_copy(drafter.eval(), weights)
        self.layer_ids = list(drafter.layer_ids)
        self.vocab_ids = drafter.draft_ids  # [Vd] target id of each draft id
        self.vocab_size = drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.kv = DraftKV()  # real entries [0, n_real); drafted ones are scratch after them
        self.n_real = 0
        self.pending_ids = tokens[:, 1:].long()  # the token each pending entry's embedding reads
        self.pending_g = self.drafter.fuse(hidden)  # [1, P, H]

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.pending_ids = torch.cat([self.pending_ids, tokens.long()], dim=1)
        self.pending_g = torch.cat([self.pending_g, self.drafter.fuse(hidden)], dim=1)

    @torch.no_grad()
    def _extend(self) -> Tensor:
        """Add the pending real entries to the cache; return the last one's output a [1, H] (it scores the
        token after the newest context token)."""
        t = self.pending_ids.shape[1]
        pos = torch.arange(self.n_real, self.n_real + t, device=self.pending_g.device)
        a = cached_step(self.drafter, self.pending_ids, self.pending_g, pos, self.kv, self.n_real)
        self.n_real += t
        self.pending_ids = self.pending_ids[:, :0]
        self.pending_g = self.pending_g[:, :0]
        return a[:, -1]


class Eagle3ChainProposer(_Eagle3Base):
    """EAGLE-3 chain of k drafts: draft s (1-based) enters as (emb(d_s), a of the previous entry) at RoPE
    position n + s (n = the last real entry's position) and attends to every real entry and earlier draft."""

    def __init__(self, drafter, k: int = 5, sample_drafts: bool = True, weights: str = "float32"):
        super().__init__(drafter, weights)
        self.k = check_k("k", k)
        self.sample_drafts = sample_drafts

    @classmethod
    def batched(cls, rows: list[Eagle3ChainProposer]) -> Eagle3ChainBatchProposer | PerRowProposers:
        """One proposer for a batch of these (one midlayer pass per drafting step for all rows); rows with
        different drafters or settings draft one after another instead."""
        p0 = rows[0]
        if any((p.drafter, p.k, p.sample_drafts) != (p0.drafter, p0.k, p0.sample_drafts) for p in rows):
            return PerRowProposers(rows)
        return Eagle3ChainBatchProposer(p0.drafter, p0.k, p0.sample_drafts)

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        k = min(self.k, max_depth)
        a = self._extend()  # [1, H]
        last = self.n_real - 1
        toks, qs = [], []
        for s in range(1, k + 1):
            tok, q = pick_token(self.drafter.logits(a)[0].float(), self.sampling, self.sample_drafts, self.vocab_ids,
                           self.vocab_size)
            toks.append(tok)
            qs.append(q)
            if s < k:  # draft s enters as scratch entry n_real + s - 1, RoPE position last + s
                pos = torch.tensor([last + s], device=a.device)
                a = cached_step(self.drafter, tok[None], a[:, None], pos, self.kv, self.n_real + s - 1)[:, -1]
        return chain_proposal(toks, qs, a.device)


class Eagle3ChainBatchProposer:
    """``BatchProposer`` (models/proposal.py) for EAGLE-3 chains: each drafting step is ONE midlayer pass for
    every active row (k+1 passes a round for the whole batch, instead of k+1 per row).

    Rows sit at different lengths n_a, so the real entries live in a ragged cache (models/ragged.py): a round
    first adds every row's pending real entries in one pass (row a's new entry j at RoPE position n_a + j sees
    its own entries 0..n_a + j), then drafts kmax = max budget steps; draft s of row a reads (emb(d_s), a of
    the previous entry) at position n_a − 1 + s and sees row a's real entries and its earlier drafts, which
    are scratch K/V appended after the cache and dropped with the round. Drafts equal the B=1
    ``Eagle3ChainProposer``'s up to float rounding (greedy: the same tokens, tested)."""

    def __init__(self, drafter: Eagle3Drafter, k: int, sample_drafts: bool = True):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        self.k, self.sample_drafts = check_k("k", k), sample_drafts
        self.vocab_ids, self.vocab_size = drafter.draft_ids, drafter.vocab_size

    @torch.no_grad()
    def begin(self, tokens: list[Tensor], hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.cache = RaggedKV(len(tokens), tokens[0].device)
        g = self.drafter.fuse(hidden)  # [B, T, H]: row b's first P_b rows are its prompt's
        self.pending_ids = [t[1:].long() for t in tokens]  # entry i reads (emb(x_{i+1}), g_i)
        self.pending_g = [g[b, : t.shape[0] - 1] for b, t in enumerate(tokens)]

    @torch.no_grad()
    def accept(self, tokens: list[Tensor], hidden: dict[int, Tensor]) -> None:
        g = self.drafter.fuse(hidden)  # [A, R, H], all rows in one fc
        for a, t in enumerate(tokens):
            self.pending_ids[a] = torch.cat([self.pending_ids[a], t.long()])
            self.pending_g[a] = torch.cat([self.pending_g[a], g[a, : t.shape[0]]])

    def retain(self, rows: list[int]) -> None:
        self.cache.retain(rows)
        self.pending_ids = [self.pending_ids[a] for a in rows]
        self.pending_g = [self.pending_g[a] for a in rows]

    def _extend(self) -> Tensor:
        """Add every row's pending real entries (ragged counts r_a) in one pass; return each row's newest entry's
        output a [A, H] (it scores the token after the row's newest context token)."""
        dr, n0 = self.drafter, self.cache.n
        ids, r = right_pad(self.pending_ids, 0)  # [A, R]
        R = ids.shape[1]
        g = torch.stack([torch.cat([x, x.new_zeros(R - x.shape[0], x.shape[1])]) for x in self.pending_g])
        pos = n0[:, None] + torch.arange(R, device=ids.device)  # [A, R]
        q, k, v, residual = entry_qkv(dr, ids, g, pos)
        self.cache.extend([(k, v)], r)
        keys, values = self.cache.kv[0]
        # new entry j of row a sees the row's entries c <= n0_a + j (its own earlier ones and itself)
        mask = torch.arange(keys.shape[2], device=ids.device)[None, None] <= pos[:, :, None]  # [A, R, C]
        out = entry_out(dr, q, keys, values, mask[:, None], residual)
        self.pending_ids = [x[:0] for x in self.pending_ids]
        self.pending_g = [x[:0] for x in self.pending_g]
        return out[torch.arange(out.shape[0], device=out.device), (r - 1).clamp_min(0)]

    def _pick(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """[A, Vd] → (target ids [A], q [A, V] or None): every row's draft in one argmax / one draw call."""
        ids = self.vocab_ids.to(logits.device)
        if self.sampling.greedy or not self.sample_drafts:
            return ids[logits.argmax(-1)], None
        probs = self.sampling.probs(logits)
        idx = torch.multinomial(probs, 1, generator=self.sampling.generator)[:, 0]
        return ids[idx], probs.new_zeros(probs.shape[0], self.vocab_size).index_copy_(1, ids, probs)

    @torch.no_grad()
    def propose(self, max_depth: list[int]) -> list[Proposal]:
        dr = self.drafter
        ks = [min(self.k, d) for d in max_depth]
        kmax = max(ks, default=0)
        device = self.cache.n.device
        if kmax == 0:
            return [Proposal.empty(device) for _ in ks]
        a = self._extend()  # [A, H]
        keys, values = self.cache.kv[0]
        seen = self.cache.visible()  # [A, C] row a's real entries, None when no row has padding
        last = self.cache.n - 1
        toks, qs = [], []
        for s in range(1, kmax + 1):
            tok, q = self._pick(dr.logits(a).float())
            toks.append(tok)
            qs.append(q)
            if s < kmax:  # draft s enters as scratch after the cache, RoPE position last_a + s
                qd, kd, vd, res = entry_qkv(dr, tok[:, None], a[:, None], (last + s)[:, None])
                keys, values = torch.cat([keys, kd], 2), torch.cat([values, vd], 2)
                mask = None
                if seen is not None:
                    seen = torch.cat([seen, seen.new_ones(seen.shape[0], 1)], 1)
                    mask = seen[:, None, None]
                a = entry_out(dr, qd, keys, values, mask, res)[:, 0]
        tok_all = torch.stack(toks, 1)  # [A, kmax]
        q_all = None if qs[0] is None else torch.stack(qs, 1)
        return [Proposal(tokens=tok_all[i, :k].clone(), q=None if q_all is None else q_all[i, :k].clone())
                if k else Proposal.empty(device) for i, k in enumerate(ks)]


class Eagle3TreeProposer(_Eagle3Base):
    """EAGLE-2 dynamic draft tree on an EAGLE-3 head.

    Depth 1: the top_k tokens after the newest context token, score = log q. Then for depth-1 more levels:
    expand the top_k highest-scoring nodes of the newest level (each node's entry reads (emb(token), a of its
    parent's entry) at RoPE position n + depth and sees the real entries, its ancestors' entries and itself),
    give each its top_k children with score = parent score + log q. Finally keep the best ``total_tokens``
    of all generated nodes (ties: shallower first, so the kept set contains every kept node's ancestors).
    Scores use the drafter's softmax at temperature 1; drafts are deterministic (point-mass verification).
    """

    def __init__(self, drafter, depth: int = 6, top_k: int = 10, total_tokens: int = 60,
                 max_nodes: int = MAX_TREE_NODES, weights: str = "float32"):
        super().__init__(drafter, weights)
        self.depth = check_k("depth", depth)
        self.top_k = check_k("top_k", top_k)
        self.total_tokens = check_k("total_tokens", total_tokens)
        if self.top_k > drafter.draft_vocab_size:
            raise ValueError(f"top_k={top_k} exceeds the draft vocabulary ({drafter.draft_vocab_size})")
        if self.total_tokens > max_nodes:
            raise ValueError(f"total_tokens={total_tokens} is more than max_nodes={max_nodes} tree nodes; "
                             "lower total_tokens")

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        dr, top_k = self.drafter, self.top_k
        a_root = self._extend()  # [1, H]
        device = a_root.device
        last = self.n_real - 1
        logp = torch.log_softmax(dr.logits(a_root).float(), -1)[0]  # [Vd]
        top = logp.topk(top_k)
        # the node pool, level by level; pool index order is topological (children appended after parents)
        tokens = [self.vocab_ids[top.indices]]
        scores = [top.values]
        parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]
        depths = [torch.ones(top_k, dtype=torch.long, device=device)]
        n_pool = top_k
        frontier = torch.arange(top_k, device=device)  # pool indices to expand next
        # drafted entries: outputs, KV, ancestor mask over entries (incl. self); entry index of expanded nodes
        ent_a = a_root.new_zeros(0, a_root.shape[-1])
        ent_anc = torch.zeros(0, 0, dtype=torch.bool, device=device)
        node_entry = torch.full((top_k,), -1, dtype=torch.long, device=device)
        all_tok, all_par = tokens[0], parents[0]
        for d in range(1, min(self.depth, max_depth)):
            f = frontier.shape[0]
            e = ent_a.shape[0]
            if d == 1:  # depth-1 nodes hang off the root: they read the last real entry's output
                h_in = a_root.expand(f, -1)
                anc_rows = torch.zeros(f, 0, dtype=torch.bool, device=device)
            else:  # every frontier node's parent was expanded one level up, so it has an entry
                par_ent = node_entry[all_par[frontier]]
                h_in = ent_a[par_ent]
                anc_rows = ent_anc[par_ent]  # [f, e]: the parent's entry and its ancestors' entries
            mask = torch.cat([torch.ones(f, self.n_real, dtype=torch.bool, device=device), anc_rows,
                              torch.eye(f, dtype=torch.bool, device=device)], dim=1)
            pos = torch.full((f,), last + d, device=device)
            out = cached_step(dr, all_tok[frontier][None], h_in[None], pos, self.kv, self.n_real + e, mask)
            ent_anc = torch.cat([torch.cat([ent_anc, torch.zeros(e, f, dtype=torch.bool, device=device)], 1),
                                 torch.cat([anc_rows, torch.eye(f, dtype=torch.bool, device=device)], 1)], 0)
            ent_a = torch.cat([ent_a, out[0]], dim=0)
            node_entry[frontier] = e + torch.arange(f, device=device)
            # children of every expanded node: top_k each, cumulative log q
            logq = torch.log_softmax(dr.logits(out[0]).float(), -1)  # [f, Vd]
            ctop = logq.topk(top_k, dim=-1)
            cscore = torch.cat(scores)[frontier][:, None] + ctop.values  # [f, top_k]
            tokens.append(self.vocab_ids[ctop.indices].reshape(-1))
            scores.append(cscore.reshape(-1))
            parents.append(frontier[:, None].expand(f, top_k).reshape(-1))
            depths.append(torch.full((f * top_k,), d + 1, dtype=torch.long, device=device))
            frontier = n_pool + cscore.reshape(-1).topk(min(top_k, f * top_k)).indices
            n_pool += f * top_k
            node_entry = torch.cat([node_entry, torch.full((f * top_k,), -1, dtype=torch.long, device=device)])
            all_tok, all_par = torch.cat(tokens), torch.cat(parents)
        return self._select(torch.cat(tokens), torch.cat(scores), torch.cat(parents), torch.cat(depths))

    def _select(self, tok: Tensor, score: Tensor, par: Tensor, depth: Tensor) -> Proposal:
        """Keep the best total_tokens nodes (score desc, then depth asc), re-indexed in pool (topological) order."""
        order = depth.argsort(stable=True)
        order = order[score[order].argsort(descending=True, stable=True)]
        keep = order[: self.total_tokens].sort().values
        new_index = torch.full_like(par, -1)
        new_index[keep] = torch.arange(keep.shape[0], device=keep.device)
        kp = par[keep]
        parents = torch.where(kp >= 0, new_index[kp.clamp_min(0)], -1)
        if bool(((kp >= 0) & (parents < 0)).any()):
            raise RuntimeError("EAGLE-2 tree selection dropped an ancestor of a kept node")
        d, anc = tree_layout(parents)
        self.last_scores = score[keep]  # [N] cumulative log q of the kept nodes (for inspection)
        return Proposal(tokens=tok[keep].long(), parents=parents, depth=d, ancestors=anc)


# --------------------------------------------------------------------------------------------- the method
def build(cfg: Eagle3Config, target: FrozenTarget, train_rows: list[dict]) -> Eagle3Drafter:
    """A new drafter; its draft vocabulary = the most frequent tokens at loss-masked positions of the data."""
    if cfg.draft_vocab_size > target.vocab_size:
        raise ValueError(f"draft.config.draft_vocab_size={cfg.draft_vocab_size} is larger than the target's "
                         f"vocabulary ({target.vocab_size}); set it <= {target.vocab_size}")
    d2t, t2d = build_draft_vocab(count_tokens(train_rows, target.vocab_size), cfg.draft_vocab_size)
    return Eagle3Drafter(cfg, target.model.config, target.embed.weight.detach().clone(), d2t, t2d)


def rebuild(cfg: Eagle3Config, target: FrozenTarget) -> Eagle3Drafter:
    return Eagle3Drafter(cfg, target.model.config, target.embed.weight.detach().clone())


def eagle_rank_accuracy(metrics: dict, steps: int, size_for: float = 0) -> Tensor:
    """[steps, RANKS] P(the depth-(k+1) rank-r draft is accepted | its path was) from held-out ``rank_metrics``:
    greedy hits (``top{j}_{k}``) when sizing for T=0, the target's probability mass (``mass{j}_{k}``) for T>0."""
    key = "top" if float(size_for) == 0 else "mass"
    need = [f"{key}{j}_{k}" for k in range(steps) for j in range(1, RANKS + 1)]
    missing = [n for n in need if n not in metrics]
    if missing:
        raise ValueError(f"EAGLE-2 tree sizing needs the held-out rank metrics ({missing[0]}, ...) saved in the "
                         "checkpoint's eval.json by training; retrain, or give depth/top_k/total_tokens as numbers")
    cum = torch.tensor([[float(metrics[f"{key}{j}_{k}"]) for j in range(1, RANKS + 1)] for k in range(steps)],
                       dtype=torch.float64)
    acc = torch.diff(cum, dim=1, prepend=torch.zeros(steps, 1, dtype=torch.float64)).clamp_min(0)
    # TTT step k is scored on paths whose first k drafts were right: acc[k] is already conditional
    return acc


FALLBACK_TREE_NODES = 10  # total_tokens: auto without held-out metrics (the cost-sized trees here: 4 to 11 nodes)


def _prepare_tree(d: Eagle3Drafter, ckpt_dir: str | None, o: dict) -> dict:
    """``total_tokens: auto``: the largest tree allowed (``max_nodes``; depth and top_k as caps) is built now,
    so the cost tables cover it; ``_size_tree`` then shrinks it to the fastest predicted one."""
    if o["total_tokens"] != "auto":
        return {**o, "auto_size": False}
    import json
    from pathlib import Path

    path = Path(ckpt_dir or "") / "eval.json"
    steps = min(int(o["depth"]), d.cfg.ttt_steps)
    if not path.exists():  # training held out no rows (data.val_rows=0 / train.eval_rows=0): a fixed tree
        n = min(int(o["max_nodes"]), FALLBACK_TREE_NODES)
        why = (f"options.eagle3_tree.total_tokens=auto: no held-out rank metrics ({path} is missing: the run held "
               f"out no validation rows); using a fixed tree of {n} nodes (depth {steps}, top_k "
               f"{min(int(o['top_k']), RANKS)}). Give total_tokens as a number, or train with data.val_rows > 0")
        logging.getLogger(__name__).warning(why)
        return {**o, "depth": steps, "top_k": min(int(o["top_k"]), RANKS), "total_tokens": n, "auto_size": False,
                "tree_fallback": why}
    eagle_rank_accuracy(json.loads(path.read_text()), steps, o["size_for"])  # fail now, not after decoding
    return {**o, "depth": steps, "top_k": min(int(o["top_k"]), RANKS), "total_tokens": int(o["max_nodes"]),
            "auto_size": True}


def _draft_pass_cost(d: Eagle3Drafter, widths: list[int], t1_s: float, prefix: int = 192, reps: int = 5
                     ) -> dict[int, float]:
    """Seconds of one midlayer pass of w drafted entries over a ``prefix``-entry cache, in target steps (t1_s)."""
    import time

    kv = DraftKV()
    g = torch.randn(1, prefix, d.hidden_size, dtype=d.fc.weight.dtype) * 3
    ids = torch.zeros(1, prefix, dtype=torch.long, device=d.fc.weight.device)
    cached_step(d, ids, g, torch.arange(prefix), kv, 0)
    out = {}
    for w in widths:
        mask = torch.ones(w, prefix + w, dtype=torch.bool)
        best = float("inf")
        for _ in range(reps + 1):
            t = time.perf_counter()
            a = cached_step(d, ids[:, :w], g[:, :w], torch.full((w,), prefix), kv, prefix, mask)
            d.logits(a).topk(1, dim=-1)
            best = min(best, time.perf_counter() - t)
        out[w] = best / t1_s
    return out


def _size_tree(d: Eagle3Drafter, ckpt_dir: str | None, o: dict, verify_cost, t1_s: float | None = None
               ) -> dict | None:
    """Cost-model sizing of the EAGLE-2 tree (``total_tokens: auto``): for every n <= max_nodes the static tree
    of n nodes with the highest expected acceptance (``build_rank_tree`` on the held-out rank accuracies, greedy
    hits at T=0 or target mass for ``size_for`` > 0) gives τ(n), its depth D(n) and width W(n) (the largest rank
    used + 1); the round costs the root pass (as a chain's first draft) + (D−1) passes of W entries + v(n).
    Pick n maximising τ(n) / cost(n); the dynamic tree then runs with depth D, top_k W, total_tokens n."""
    import json
    from pathlib import Path

    from models.tree import build_rank_tree, expected_tree_tau

    if not o.get("auto_size"):
        return None
    acc = eagle_rank_accuracy(json.loads((Path(ckpt_dir) / "eval.json").read_text()), int(o["depth"]),
                              o["size_for"])[:, : int(o["top_k"])]
    passes = _draft_pass_cost(d, list(range(1, acc.shape[1] + 1)), t1_s) if t1_s else None
    pred, shape = {}, {}
    for n in range(1, int(o["total_tokens"]) + 1):
        if n > sum(acc.shape[1] ** k for k in range(1, acc.shape[0] + 1)):
            break
        tree = build_rank_tree(acc, n)
        depth, width = max(len(c) for c in tree), max(max(c) for c in tree) + 1
        draft = 0.0 if passes is None else passes[1] + (depth - 1) * passes[width]
        pred[n] = expected_tree_tau(acc, tree) / (draft + float(verify_cost(n)))
        shape[n] = (depth, width)
    n = max(pred, key=pred.get)
    depth, width = shape[n]
    return {**o, "depth": depth, "top_k": width, "total_tokens": n,
            "tree_sized": {"total_tokens": n, "depth": depth, "top_k": width, "size_for": o["size_for"],
                           "pass_cost": None if passes is None else {k: round(v, 4) for k, v in passes.items()},
                           "predicted_bound": {k: round(v, 3) for k, v in pred.items()}}}


def _tree(d, _t, max_nodes: int = MAX_TREE_NODES, size_for: float = 0, **o) -> Eagle3TreeProposer:
    return Eagle3TreeProposer(d, **o, max_nodes=max(int(max_nodes), int(o["total_tokens"])))


SPEC = MethodSpec(
    name="eagle3", config=Eagle3Config, build=build, rebuild=rebuild,
    export_formats=export.FORMATS,
    proposers=(
        # weights: the drafting precision (float32 | bfloat16 | int8, ``inference_copy``)
        # eval's variants: the same chain drafting in bf16 / int8, benchmarked side by side (what the switch buys)
        ProposerSpec("eagle3", lambda d, _t, **o: Eagle3ChainProposer(d, **o), {"k": 5, "weights": "float32"},
                     batched=Eagle3ChainProposer.batched, recommend_rank=0,
                     variants={"eagle3_bf16": {"weights": "bfloat16"}, "eagle3_int8": {"weights": "int8"}}),
        # EAGLE-2 dynamic tree, sized for CPU (verify cost grows with nodes there; GPU: depth 6, top_k 10, 60)
        # total_tokens auto: sized by the cost model (``_size_tree``; depth and top_k are then caps), for the
        # acceptance at T=0 (size_for 0) or at T=1 (size_for 1)
        ProposerSpec("eagle3_tree", _tree,
                     {"depth": 5, "top_k": 4, "total_tokens": "auto", "max_nodes": 32, "size_for": 0,
                      "weights": "float32"}, chain=False, k_option=None, prepare=_prepare_tree, size=_size_tree,
                     nodes=lambda o: int(o["total_tokens"]),
                     variants={"eagle3_tree_t1": {"size_for": 1}}),  # the tree sized for T=1 acceptance
    ),
)
