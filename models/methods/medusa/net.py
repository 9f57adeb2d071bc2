"""Medusa heads: the module, its self-distillation loss and the heads' measured rank accuracy.

Method (Cai et al. 2024, "Medusa"; FasterDecoding/Medusa ``medusa/model/medusa_model.py``):

- Input: the frozen target's last hidden state *after* the final norm, h_t = hidden id L ([B, T, H]);
  it is exactly what the target's lm_head reads, so ``lm_head(h_t)`` predicts token t+1.
- Head k (k = 0..K-1) predicts token t+2+k from h_t alone:
      z = h_t;  z ← z + SiLU(W_l z + b_l)   for l = 1..n   (ResBlock, W_l zero-initialised)
      logits_k = W_out,k z                                (Linear H→V, initialised from the lm_head)
  Parameter names follow FasterDecoding's ``medusa_lm_head.safetensors``: head k is an
  ``nn.Sequential(*ResBlocks, Linear)`` stored under ``heads.{k}``, so ``heads.{k}.{l}.linear.weight``
  maps to ``{k}.{l}.linear.weight`` and ``heads.{k}.{n}.weight`` to ``{k}.{n}.weight`` on export
  (``to_fasterdecoding_state_dict``).
- Medusa-1 loss with the backbone frozen: L = Σ_k step_weight^k · CE_k. Here CE_k is, by default,
  self-distillation: the soft cross-entropy against the target's own distribution for the same token,
  softmax(target_logits[:, t+1+k]); with ``distill=False`` the label is the ground-truth token
  input_ids[:, t+2+k].
- Decoding uses a static tree (tree.py); ``propose`` here gives each head's top-k candidates for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig

from models.core.drafter import softcap
from models.core.losses import distill_step, step_metrics, weighted_total
from models.core.target import FrozenTarget
from models.methods.medusa.config import MedusaConfig
from models.methods.medusa.tree import TREE_FILE, build_medusa_tree, rank_accuracy


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised (bias keeps nn.Linear's default init, as in Medusa)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads on the target's post-norm last hidden state (layer id L)."""

    def __init__(self, cfg: MedusaConfig, target_config: PreTrainedConfig, lm_head_weight: torch.Tensor):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.hidden_size = int(target_config.hidden_size)
        self.vocab_size = int(target_config.vocab_size)
        self.layer_ids = [int(target_config.num_hidden_layers)]  # id L: after the final norm
        self.final_logit_softcapping = getattr(target_config, "final_logit_softcapping", None)  # Gemma-2/3
        if tuple(lm_head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"lm_head weight has shape {tuple(lm_head_weight.shape)}, expected "
                             f"[vocab_size, hidden_size] = [{self.vocab_size}, {self.hidden_size}]")
        heads = []
        for _ in range(cfg.num_heads):
            blocks: list[nn.Module] = [ResBlock(self.hidden_size) for _ in range(cfg.num_layers)]
            if not cfg.share_lm_head:
                out = nn.Linear(self.hidden_size, self.vocab_size, bias=False)
                with torch.no_grad():
                    out.weight.copy_(lm_head_weight)
                blocks.append(out)
            heads.append(nn.Sequential(*blocks))
        self.heads = nn.ModuleList(heads)
        # The shared head is borrowed from the target: a non-persistent buffer (moves with .to(), never a
        # parameter, never in the state dict, no copy of the [V, H] matrix).
        self.register_buffer("shared_lm_head", lm_head_weight.detach() if cfg.share_lm_head else None,
                             persistent=False)

    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (post-norm last hidden state) → logits [..., K, V]."""
        x = hidden.to(self._dtype())
        if self.shared_lm_head is None:
            return softcap(torch.stack([head(x) for head in self.heads], dim=-2), self.final_logit_softcapping)
        feats = torch.stack([head(x) for head in self.heads], dim=-2)  # [..., K, H]
        w = self.shared_lm_head
        return softcap(F.linear(feats.to(w.dtype), w), self.final_logit_softcapping)  # one matmul: [..., K, V]

    def training_loss(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: dict[int, torch.Tensor],
        target_logits: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Σ_k step_weight^k · CE_k; head k at position t predicts token t+2+k.

        input_ids/loss_mask [B, T]; hidden {L: [B, T, H]}; target_logits [B, T, V] (position t → token t+1).
        """
        cfg = self.cfg
        _, T = input_ids.shape
        logits = self(hidden[self.layer_ids[0]])  # [B, T, K, V]
        losses, accs, counts, extra = [], [], [], {}
        for k in range(cfg.num_heads):
            n = max(T - 2 - k, 0)  # positions t = 0..n-1 have a token t+2+k inside the window
            lk = logits[:, :n, k].float()  # [B, n, V] head k at position t
            tl = target_logits[:, 1 + k : 1 + k + n].float()  # [B, n, V] target's dist. for token t+2+k
            m = loss_mask[:, 2 + k : 2 + k + n].bool()  # [B, n] is token t+2+k a training target
            labels = None if cfg.distill else input_ids[:, 2 + k : 2 + k + n]
            loss_k, acc_k, count = distill_step(lk, tl, m, labels)
            losses.append(loss_k)
            accs.append(acc_k)
            counts.append(count)
            if cfg.metric_top_k > 0:
                tgt = tl.argmax(-1)  # [B, n] the target's greedy token t+2+k
                top = lk.topk(min(cfg.metric_top_k, lk.shape[-1]), dim=-1).indices  # [B, n, j]
                hit = top == tgt[..., None]
                for j in range(1, cfg.metric_top_k + 1):
                    extra[f"top{j}_{k}"] = float((hit[..., :j].any(-1) & m).sum() / count.clamp_min(1))
        total = weighted_total(losses, cfg.step_weight)
        # Medusa accuracies are marginal, not conditional: head k is scored with the true prefix, not
        # given that heads 0..k-1 were right. Their product over-/under-states the joint acceptance
        # when errors correlate, so sim_tau is a rough guide for Medusa (exact for EAGLE-3's TTT accs).
        metrics = {**step_metrics(losses, accs, counts), **extra}
        metrics["loss"] = float(total.detach())
        return total, metrics

    def config_dict(self) -> dict:
        return {"method": "medusa", **asdict(self.cfg), "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "layer_ids": list(self.layer_ids)}

    def save_static_tree(self, out_dir: Path, metrics: Mapping[str, float]) -> Path | None:
        """Write ``medusa_choices.json`` next to the final weights: the greedy tree of ``cfg.tree_nodes``
        nodes built from the held-out per-head rank accuracies in ``metrics`` (``evaluate``'s top{j}_{k}),
        plus that accuracy table so the eval harness can rebuild a tree of another size. None when the
        run did not measure ranks (metric_top_k = 0)."""
        if self.cfg.metric_top_k <= 0:
            return None
        acc = rank_accuracy(metrics, self.cfg.num_heads, self.cfg.metric_top_k)
        path = Path(out_dir) / TREE_FILE
        path.write_text(json.dumps({"choices": [list(c) for c in build_medusa_tree(acc, self.cfg.tree_nodes)],
                                    "rank_accuracy": acc.tolist()}, indent=1))
        return path

    def to_fasterdecoding_state_dict(self) -> dict[str, torch.Tensor]:
        """FasterDecoding ``medusa_lm_head.safetensors`` names: ``{h}.{l}.linear.{weight,bias}``, ``{h}.{n}.weight``.

        With ``share_lm_head`` the borrowed lm_head is written as every head's output layer (the format has
        no notion of sharing).
        """
        out = {name.removeprefix("heads."): t.detach().clone() for name, t in self.state_dict().items()}
        if self.shared_lm_head is not None:
            for h in range(self.cfg.num_heads):
                out[f"{h}.{self.cfg.num_layers}.weight"] = self.shared_lm_head.detach().clone()
        return out


# the heads' candidates (what the proposer places on the tree) and their measured per-rank accuracy


@torch.no_grad()
def propose(heads: MedusaHeads, last_hidden: torch.Tensor, top_k: int) -> torch.Tensor:
    """last_hidden [B, H] (post-norm hidden at the last verified position) → candidate ids [B, K, top_k].

    ``[b, k, r]`` is head k's rank-r token for position (last + 2 + k), i.e. k+1 tokens after the target's
    own next token.
    """
    return heads(last_hidden).topk(top_k, dim=-1).indices


@torch.no_grad()
def head_topk_hits(
    heads: MedusaHeads,
    loss_mask: torch.Tensor,
    hidden: torch.Tensor,
    target_logits: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts for ``head_topk_accuracy`` on one batch: (hits [K, top_k], total [K]).

    hits[k, r] = #masked positions t where head k's rank-r candidate equals the target's argmax for token
    t+2+k (target_logits[:, t+1+k]); total[k] = #masked positions of head k.
    loss_mask [B, T]; hidden [B, T, H] (id L); target_logits [B, T, V].
    """
    K = heads.cfg.num_heads
    T = hidden.shape[1]
    logits = heads(hidden)  # [B, T, K, V]
    hits = torch.zeros(K, top_k, dtype=torch.float64)
    total = torch.zeros(K, dtype=torch.float64)
    for k in range(K):
        n = max(T - 2 - k, 0)
        cand = logits[:, :n, k].topk(top_k, dim=-1).indices  # [B, n, top_k]
        tgt = target_logits[:, 1 + k : 1 + k + n].argmax(-1)  # [B, n]
        m = loss_mask[:, 2 + k : 2 + k + n].bool()  # [B, n]
        hits[k] = ((cand == tgt[..., None]) & m[..., None]).sum(dim=(0, 1)).double().cpu()
        total[k] = float(m.sum())
    return hits, total


@torch.no_grad()
def head_topk_accuracy(
    heads: MedusaHeads,
    target: FrozenTarget,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    top_k: int,
) -> torch.Tensor:
    """Per-head accuracy of the rank-r candidate on held-out (input_ids, loss_mask) batches → [K, top_k].

    ``target`` is a FrozenTarget (called as ``target(input_ids, layer_ids=heads.layer_ids)``). The reference
    is the target's argmax given the data prefix; on target-generated data that is the greedy continuation
    the tree is verified against. Feed the result to ``build_medusa_tree``.
    """
    L = heads.layer_ids[0]
    hits = torch.zeros(heads.cfg.num_heads, top_k, dtype=torch.float64)
    total = torch.zeros(heads.cfg.num_heads, dtype=torch.float64)
    for input_ids, loss_mask in batches:
        out = target(input_ids, layer_ids=heads.layer_ids)
        h, t = head_topk_hits(heads, loss_mask, out.hidden[L], out.logits, top_k)
        hits += h
        total += t
    return (hits / total.clamp_min(1)[:, None]).float()
