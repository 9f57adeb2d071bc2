"""DeepSeek-V3-style multi-token prediction (MTP) modules trained on a frozen target.

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

import copy
import inspect
import re
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from models.drafter import softcap
from models.losses import distill_step, step_metrics, weighted_total
from models.methods.mtp import export
from models.proposal import Proposal, Sampling, chain_proposal, check_k, pick_token
from models.spec import MethodSpec, ProposerSpec
from models.target import FrozenTarget

HIDDEN_BETWEEN_DEPTHS = ("post_norm", "pre_norm")


@dataclass
class MTPConfig:
    num_modules: int = 1  # D: depth k predicts token i+1+k at position i
    step_weight: float = 0.8  # depth k (1-based) weighted step_weight^(k-1)
    distill: bool = True  # soft CE against the target's distribution; False → ground-truth tokens
    # Decoder-block shape; None = the target's (required for native MTP weights).
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    # What depth k >= 2 reads as h^{k-1}: "post_norm" = shared_head.norm(h^{k-1}), what vLLM (deepseek_mtp.py,
    # v1/spec_decode/llm_base_proposer.py) and SGLang NextN (deepseek_nextn.py) feed the next step; "pre_norm" =
    # the block output itself (DeepSeek-V3 report eq. 21; draftsmith before this option: older checkpoints).
    hidden_between_depths: str = "post_norm"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.num_modules <= 0:
            raise ValueError(f"mtp num_modules must be >= 1, got {self.num_modules}")
        if self.hidden_between_depths not in HIDDEN_BETWEEN_DEPTHS:
            raise ValueError(f"mtp hidden_between_depths must be one of {HIDDEN_BETWEEN_DEPTHS}, got "
                             f"{self.hidden_between_depths!r}")


def decoder_config(cfg: MTPConfig, target_config: PreTrainedConfig) -> PreTrainedConfig:
    """The target's config with the MTP block overrides applied (a copy)."""
    dc = copy.deepcopy(target_config)
    if cfg.intermediate_size is not None:
        dc.intermediate_size = cfg.intermediate_size
    if cfg.num_attention_heads is not None:
        dc.num_attention_heads = cfg.num_attention_heads
        dc.head_dim = dc.hidden_size // cfg.num_attention_heads
    if cfg.num_key_value_heads is not None:
        dc.num_key_value_heads = cfg.num_key_value_heads
    # Families with per-layer attention types (Qwen2/3, Mistral-style `layer_types`) index them by layer_idx;
    # MTP modules sit at L..L+D-1, so extend the list with full attention (our mask is plain causal).
    layer_types = getattr(dc, "layer_types", None)
    if layer_types:
        dc.layer_types = list(layer_types) + ["full_attention"] * cfg.num_modules
    # We pass an explicit additive causal mask, which eager and sdpa both honour (flash kernels do not).
    if getattr(dc, "_attn_implementation", None) not in ("eager", "sdpa"):
        dc._attn_implementation = "sdpa"
    return dc


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


@torch.no_grad()
def propose_chain(drafter: MTPDrafter, input_ids: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy chain of k draft tokens.

    input_ids [B, n+1] = x_0..x_n: the verified prefix plus the target's own next token x_n;
    hidden [B, n, H] = the target's id-L hidden states for x_0..x_{n-1} → drafts [B, k] = x_{n+1}..x_{n+k}.
    Step j (0-based) runs module min(j, D-1) over the whole prefix: input h^j (the previous step's output,
    h^0 = hidden) and emb(x_{i+j+1}) for i = 0..n-1, drafting from its last position. Beyond D modules the
    last one is reused recursively (as engines do with a single native MTP layer). No KV cache: each step
    recomputes its module over all n positions (O(k·n) per proposal); all rows share the same n.
    """
    B, n1 = input_ids.shape
    n = n1 - 1
    if hidden.shape[1] != n:
        raise ValueError(f"hidden covers {hidden.shape[1]} positions, expected len(input_ids) - 1 = {n}")
    D = drafter.cfg.num_modules
    tokens, prev = input_ids, hidden
    drafts = []
    for j in range(k):
        d = min(j, D - 1)
        h = drafter.run_module(d, prev, tokens[:, j + 1 : j + 1 + n])  # [B, n, H]
        nxt = drafter.logits(d, h[:, -1]).argmax(-1)  # [B]
        prev = drafter.hand_on(d, h)
        drafts.append(nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return torch.stack(drafts, dim=1) if drafts else input_ids.new_zeros(B, 0)


# ----------------------------------------------------------------------------------- native MTP weights

_OWN_PREFIXES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the target's, shipped per layer
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _native_to_ours(suffix: str) -> str:
    return suffix if suffix.startswith(_OWN_PREFIXES) else f"block.{suffix}"


def _ours_to_native(suffix: str) -> str:
    return suffix.removeprefix("block.")


def to_native_state_dict(drafter: MTPDrafter, include_shared: bool = True) -> dict[str, torch.Tensor]:
    """Our weights in the DeepSeek layout ``model.layers.{L+d}.…`` (with the per-layer copies of the
    shared embedding and head when ``include_shared``)."""
    L = drafter.num_target_layers
    out: dict[str, torch.Tensor] = {}
    for name, t in drafter.state_dict().items():
        if not name.startswith("mtp."):
            continue
        _, d, suffix = name.split(".", 2)
        out[f"model.layers.{L + int(d)}.{_ours_to_native(suffix)}"] = t.detach().clone()
    if include_shared:
        for d in range(drafter.cfg.num_modules):
            out[f"model.layers.{L + d}.embed_tokens.weight"] = drafter.embed_weight.detach().clone()
            out[f"model.layers.{L + d}.shared_head.head.weight"] = drafter.lm_head_weight.detach().clone()
    return out


def init_from_native(drafter: MTPDrafter, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a target's native MTP weights (config ``num_nextn_predict_layers``; DeepSeek layout
    ``model.layers.{L+d}.{enorm,hnorm,eh_proj,shared_head.norm,self_attn…,mlp…,*_layernorm}``).

    ``state_dict`` may be the whole checkpoint: keys outside ``model.layers.{j}`` with j ≥ L belong to the
    main model and are ignored. Every MTP key must map to a drafter weight of the same shape and every
    drafter weight must be provided; the per-layer copies of the embedding/lm_head must equal the target's
    (draftsmith shares the target's, frozen). Anything else raises a one-line ValueError.
    """
    L, D = drafter.num_target_layers, drafter.cfg.num_modules
    expected = {n: t for n, t in drafter.state_dict().items() if n.startswith("mtp.")}
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    shared = {"embed_tokens.weight": drafter.embed_weight, "shared_head.head.weight": drafter.lm_head_weight}
    for key, t in state_dict.items():
        m = _LAYER_KEY.match(key)
        if m is None or int(m.group(1)) < L:
            continue  # main-model weight
        d, suffix = int(m.group(1)) - L, m.group(2)
        if suffix in _SHARED:
            ref = shared[suffix]
            if tuple(t.shape) != tuple(ref.shape) or not torch.equal(t.to(ref.device, ref.dtype), ref):
                raise ValueError(f"native MTP {key} differs from the target's {suffix.split('.')[0]}; "
                                 "draftsmith shares the target's frozen weights")
            continue
        ours = f"mtp.{d}.{_native_to_ours(suffix)}"
        if d >= D or ours not in expected:
            unexpected.append(key)
        else:
            mapped[ours] = t
    missing = sorted(set(expected) - set(mapped))
    if unexpected:
        raise ValueError(f"native MTP weights have {len(unexpected)} unexpected keys for num_modules={D} "
                         f"after {L} target layers, e.g. {unexpected[:3]}")
    if missing:
        native = [f"model.layers.{L + int(n.split('.')[1])}.{_ours_to_native(n.split('.', 2)[2])}" for n in missing]
        raise ValueError(f"native MTP weights are missing {len(missing)} keys, e.g. {native[:3]}")
    bad = [f"{n} {tuple(t.shape)} vs {tuple(expected[n].shape)}" for n, t in mapped.items()
           if tuple(t.shape) != tuple(expected[n].shape)]
    if bad:
        raise ValueError(f"native MTP weight shapes differ from the drafter's: {bad[:3]}")
    drafter.load_state_dict(mapped, strict=True)


# ------------------------------------------------------------------------------------- inference with a KV cache
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
                       cache=cache, use_cache=True)
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------------------- proposers

@dataclass
class _Stream:
    """One MTP depth j of the chain: module min(j, D-1) over positions 0..m-1 (input x_{i+j+1} and the previous
    stream's output). ``cache`` holds its confirmed entries 0..n-1 (inputs made of context tokens only);
    ``out`` its confirmed outputs for positions out_start..n-1 (what stream j+1 still needs)."""

    cache: DynamicCache
    n: int
    out: Tensor
    out_start: int


class MTPProposer:
    """MTP chain with a KV cache per depth, identical to models/methods/mtp ``propose_chain`` (each step j runs
    module min(j, D-1) over the whole context; entries that read a drafted token are recomputed each round)."""

    def __init__(self, drafter, k: int | None = None, sample_drafts: bool = True):
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.layer_ids)
        self.k = check_k("k", drafter.cfg.num_modules if k is None else k)
        self.sample_drafts = sample_drafts

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.ctx = tokens[0].long().clone()
        h0 = hidden[self.layer_ids[0]]
        self.h0, self.h0_start = h0, 0  # target states for positions h0_start..m-1
        empty = h0[:, :0]
        self.streams = [_Stream(DynamicCache(), 0, empty, 0) for _ in range(self.k)]

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.ctx = torch.cat([self.ctx, tokens[0].to(self.ctx)])
        self.h0 = torch.cat([self.h0, hidden[self.layer_ids[0]]], dim=1)

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        dr = self.drafter
        k = min(self.k, max_depth)
        m = self.ctx.shape[0] - 1  # positions 0..m-1 have target states; x_m is the newest token
        ext = self.ctx
        prev, prev_start = self.h0, self.h0_start  # the previous stream's outputs for prev_start..m-1
        toks, qs = [], []
        for j in range(k):
            st = self.streams[j]
            c = st.n
            h = run_module_cached(dr, min(j, dr.cfg.num_modules - 1), prev[:, c - prev_start:],
                                  ext[c + j + 1 : m + j + 1][None], st.cache, start=c)  # [1, m - c, H]
            conf = max(0, m - j - c)  # positions i <= m-1-j read context tokens only: keep them
            if m - c > conf:
                st.cache.crop(conf - (m - c))
            # this stream's outputs for st.out_start..m-1, as the next depth reads them (MTPDrafter.hand_on)
            full = torch.cat([st.out, dr.hand_on(min(j, dr.cfg.num_modules - 1), h)], dim=1)
            st.out = full[:, : c + conf - st.out_start]
            st.n = c + conf
            prev, prev_start = full, st.out_start
            tok, q = pick_token(dr.logits(min(j, dr.cfg.num_modules - 1), h[:, -1])[0], self.sampling,
                           self.sample_drafts, None, dr.vocab_size)
            toks.append(tok)
            qs.append(q)
            ext = torch.cat([ext, tok])
        self._trim()
        return chain_proposal(toks, qs, self.ctx.device)

    def _trim(self) -> None:
        """Drop stored outputs no later stream needs (stream j+1 restarts at its own confirmed count)."""
        need = self.streams[0].n
        self.h0, self.h0_start = self.h0[:, need - self.h0_start:], need
        for j in range(self.k - 1):
            st, nxt = self.streams[j], self.streams[j + 1]
            cut = max(nxt.n - st.out_start, 0)
            st.out, st.out_start = st.out[:, cut:], st.out_start + cut
        last = self.streams[-1]
        last.out, last.out_start = last.out[:, last.out.shape[1]:], last.n


# --------------------------------------------------------------------------------------------- the method
def _default_k(drafter: MTPDrafter, _ckpt_dir: str | None, o: dict) -> dict:
    return {**o, "k": int(o["k"] or drafter.cfg.num_modules)}  # None → one draft per module


SPEC = MethodSpec(
    name="mtp", config=MTPConfig, build=lambda cfg, target, rows=None: MTPDrafter.from_target(cfg, target),
    rebuild=MTPDrafter.from_target, export_formats=export.FORMATS,
    # checkpoints written before hidden_between_depths existed chained the pre-norm state
    checkpoint_defaults={"hidden_between_depths": "pre_norm"},
    proposers=(ProposerSpec("mtp", lambda d, _t, **o: MTPProposer(d, **o), {"k": None}, prepare=_default_k,
                            recommend_rank=2),),
)
