"""DeepSeek-V3-style multi-token prediction (MTP) modules on a frozen target: the network and its loss.

Method (DeepSeek-V3 technical report §2.2, eqs. 21-25; checkpoint layer ``model.layers.{L}``):
for depth k = 1..D and position i,

    h'^k_i   = M_k [ RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h^{k-1}_i) ]      (21)  eh_proj, embedding FIRST
    h^k_{i}  = TRM_k(h'^k_{1:T-k})_i                                       (22)  one causal decoder block
    P^k_{i+k+1} = softmax(OutHead(h^k_i))                                  (23)  shared_head.norm + lm_head

h^0 is the main model's representation: here the frozen target's last hidden state. The embedding
and output head are the target's, shared and frozen (borrowed as non-persistent buffers: never trained,
never in the state dict). Loss (24-25, from a frozen target): depth k is a soft cross-entropy against the
target's distribution for the same token t_{i+1+k} (target_logits[:, i+k]), masked by that token's
loss_mask; total Σ_{k=1..D} step_weight^{k-1} · L_k (depth 1 has weight 1, depth 2 step_weight, …; the
report uses a single λ for the average, a geometric decay favours the depths that are accepted most).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from models.core.drafter import softcap
from models.core.losses import distill_step, step_metrics, weighted_total
from models.core.target import FrozenTarget, cache_kwargs
from models.methods.mtp.config import MTPConfig, decoder_config


class MTPModule(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj (2H→H), a decoder block, shared_head.norm.

    The output head (lm_head) and the embedding are not parameters here; ``MTPDrafter`` borrows them.
    """

    def __init__(self, config: PreTrainedConfig, layer_idx: int, layer_cls: type[nn.Module] = LlamaDecoderLayer):
        super().__init__()
        H, eps = config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)
        self.enorm = LlamaRMSNorm(H, eps=eps)
        self.hnorm = LlamaRMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = layer_cls(config, layer_idx)
        self.shared_head = nn.Module()
        self.shared_head.norm = LlamaRMSNorm(H, eps=eps)

    def fuse(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """eq. 21: emb [B, T, H] (of t_{i+k}), h [B, T, H] (h^{k-1}_i) → eh_proj(cat(enorm(emb), hnorm(h)))."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))

    def forward(
        self,
        emb: torch.Tensor,
        h: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """eq. 21-22 → h^k [B, T, H] (before shared_head.norm; what the next depth consumes)."""
        x = self.fuse(emb, h)
        out = self.block(x, attention_mask=attention_mask, position_ids=position_ids,
                         position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, h: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """eq. 23: h^k [..., H] → logits [..., V] through shared_head.norm and the borrowed lm_head."""
        x = self.shared_head.norm(h)
        return F.linear(x.to(lm_head_weight.dtype), lm_head_weight)


def _causal_mask(T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 where key ≤ query, dtype-min above the diagonal."""
    upper = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(upper, torch.finfo(dtype).min)[None, None]


class MTPDrafter(nn.Module):
    """D chained MTP modules on a frozen target (embedding and lm_head borrowed, frozen)."""

    def __init__(
        self,
        cfg: MTPConfig,
        target_config: PreTrainedConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        layer_cls: type[nn.Module] = LlamaDecoderLayer,
        rotary_cls: type[nn.Module] = LlamaRotaryEmbedding,
    ):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.hidden_size = int(target_config.hidden_size)
        self.vocab_size = int(target_config.vocab_size)
        L = int(target_config.num_hidden_layers)
        # h^0 = id L, the target's last hidden state AFTER the final norm. This is what the engines that
        # run native MTP weights feed the first module (vLLM deepseek_mtp / SGLang NextN take the target
        # model's returned hidden states, which are post-norm), so native weights see the same input
        # here. For weights trained from scratch it barely matters: hnorm re-normalises, and pre- vs
        # post-norm differ only by the final norm's per-channel gain, which hnorm's weight can absorb.
        self.layer_ids = [L]
        for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != (self.vocab_size, self.hidden_size):
                raise ValueError(f"{name} weight has shape {tuple(w.shape)}, expected "
                                 f"[vocab_size, hidden_size] = [{self.vocab_size}, {self.hidden_size}]")
        self.decoder_config = decoder_config(cfg, target_config)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        # module d sits where a native checkpoint puts it: decoder layer L + d
        self.mtp = nn.ModuleList(MTPModule(self.decoder_config, L + d, layer_cls) for d in range(cfg.num_modules))
        self.rotary_emb = rotary_cls(config=self.decoder_config)
        self._rope_by_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        self.final_logit_softcapping = getattr(target_config, "final_logit_softcapping", None)  # Gemma-2/3

    @classmethod
    def from_target(cls, cfg: MTPConfig, target: FrozenTarget) -> MTPDrafter:
        """Build from a FrozenTarget: its embedding, lm_head, decoder-layer and rotary classes, so the block
        has the target's exact shape (e.g. DeepSeek-V3's MLA + MoE layer, Qwen3's q/k norms); the module
        weights are then initialised by the target's own ``_init_weights`` (HF allocates some weights, such
        as fused MoE experts, uninitialised and relies on it)."""
        model = target.model
        base = getattr(model, "model", None) or model.base_model
        drafter = cls(cfg, model.config, target.embed.weight, model.get_output_embeddings().weight,
                      layer_cls=type(target.layers[0]), rotary_cls=type(base.rotary_emb))
        init_fn = getattr(model, "_init_weights", None)
        if init_fn is not None:
            with torch.no_grad():
                drafter.mtp.apply(init_fn)
        return drafter

    @property
    def num_target_layers(self) -> int:
        return self.layer_ids[0]

    def _dtype(self) -> torch.dtype:
        return self.mtp[0].eh_proj.weight.dtype

    def run_module(self, d: int, prev: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Module d (0-based) over a whole sequence: prev [B, n, H] = h^{k-1}_{0..n-1}, next_ids [B, n] =
        t_{k..k+n-1} (the token each position's embedding reads) → h^k [B, n, H]. Causal attention."""
        dtype = self._dtype()
        n = prev.shape[1]
        emb = F.embedding(next_ids, self.embed_weight).to(dtype)  # [B, n, H]
        pos = torch.arange(n, device=prev.device)[None]  # [1, n]; RoPE is relative, offset irrelevant
        pe = self.rope(emb, pos)
        return self.mtp[d](emb, prev.to(dtype), pe, _causal_mask(n, dtype, prev.device), pos)

    def logits(self, d: int, h: torch.Tensor) -> torch.Tensor:
        return softcap(self.mtp[d].logits(h, self.lm_head_weight), self.final_logit_softcapping)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions ``pos``; families with per-layer-type rotary tables (Gemma-3) get the full-attention
        one, the type MTP blocks are given in ``decoder_config``."""
        if self._rope_by_type:
            return self.rotary_emb(x, pos, layer_type="full_attention")
        return self.rotary_emb(x, pos)

    def hand_on(self, d: int, h: torch.Tensor) -> torch.Tensor:
        """What the next depth reads from module d's output h^k (see MTPConfig.hidden_between_depths)."""
        return self.mtp[d].shared_head.norm(h) if self.cfg.hidden_between_depths == "post_norm" else h

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced chain. input_ids [B, T], hidden [B, T, H] (id L) → per depth k = 1..D logits
        [B, T-k, V]; entry [b, i] is depth k's prediction of token i+1+k."""
        T = input_ids.shape[1]
        prev, outs = hidden, []
        for d in range(self.cfg.num_modules):
            k = d + 1
            n = T - k  # positions whose embedding input t_{i+k} exists
            if n <= 0:
                break
            h = self.run_module(d, prev[:, :n], input_ids[:, k : k + n])  # h^k [B, n, H]
            outs.append(self.logits(d, h))
            prev = self.hand_on(d, h)
        return outs

    def training_loss(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: dict[int, torch.Tensor],
        target_logits: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Σ_k step_weight^(k-1) · CE_k over depths; metrics loss_{k-1}, acc_{k-1}, sim_tau.

        input_ids/loss_mask [B, T]; hidden {L: [B, T, H]}; target_logits [B, T, V] (position t → token t+1).
        """
        cfg = self.cfg
        T = input_ids.shape[1]
        h0 = hidden[self.layer_ids[0]]
        per_depth = self(input_ids, h0)
        losses, accs, counts = [], [], []
        for d in range(cfg.num_modules):
            k = d + 1
            n = max(T - 1 - k, 0)  # positions i whose predicted token i+1+k is inside the window
            lk = per_depth[d][:, :n].float() if d < len(per_depth) else h0.new_zeros(h0.shape[0], 0,
                                                                                        self.vocab_size)
            tl = target_logits[:, k : k + n].float()  # [B, n, V] target's distribution for token i+1+k
            m = loss_mask[:, k + 1 : k + 1 + n].bool()  # [B, n]
            labels = None if cfg.distill else input_ids[:, k + 1 : k + 1 + n]
            loss_k, acc_k, count = distill_step(lk, tl, m, labels)
            losses.append(loss_k)
            accs.append(acc_k)
            counts.append(count)
        total = weighted_total(losses, cfg.step_weight)
        # Depth k is teacher-forced (true tokens t_{i+k}), not conditioned on earlier depths being right:
        # sim_tau multiplies these as if they were conditional acceptance rates (approximate).
        metrics = step_metrics(losses, accs, counts)
        metrics["loss"] = float(total.detach())
        return total, metrics

    def config_dict(self) -> dict:
        dc = self.decoder_config
        return {"method": "mtp", **asdict(self.cfg), "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "layer_ids": list(self.layer_ids), "block_intermediate_size": dc.intermediate_size,
                "block_num_attention_heads": dc.num_attention_heads,
                "block_num_key_value_heads": dc.num_key_value_heads}


# decoding: module d with a KV cache (the proposers' kernel; the same maths as MTPDrafter.run_module)
@torch.no_grad()
def run_module_cached(
    drafter: MTPDrafter, d: int, prev: torch.Tensor, next_ids: torch.Tensor, cache, start: int
) -> torch.Tensor:
    """Module d over n new positions start..start+n-1 of one stream, attending to the stream's cached entries.

    Same maths as ``run_module`` (prev [B, n, H] = h^{k-1} at those positions, next_ids [B, n] = the tokens
    their embeddings read) but with absolute RoPE positions and a transformers ``Cache`` (e.g. ``DynamicCache``)
    that holds exactly this stream's ``start`` earlier entries; the new entries are appended to it (the caller
    crops the ones it does not want to keep). Returns h^k [B, n, H].
    """
    dtype = drafter._dtype()
    n = prev.shape[1]
    device = prev.device
    emb = F.embedding(next_ids, drafter.embed_weight).to(dtype)  # [B, n, H]
    pos = torch.arange(start, start + n, device=device)[None]  # [1, n] absolute: cached keys carry theirs
    pe = drafter.rope(emb, pos)
    # [1, 1, n, start + n]: query at start+i sees keys 0..start+i
    visible = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
    mask = torch.zeros(n, start + n, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    module = drafter.mtp[d]
    x = module.fuse(emb, prev.to(dtype))
    out = module.block(x, attention_mask=mask[None, None], position_ids=pos, position_embeddings=pe,
                       use_cache=True, **cache_kwargs(module.block, cache))
    return out[0] if isinstance(out, tuple) else out
