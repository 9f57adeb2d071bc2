"""Medusa heads: module, self-distillation loss, static tree and proposal (one file).

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
- Decoding uses a static tree (``medusa_choices``): node = tuple of per-head ranks along its path;
  node (r_0, …, r_{d-1}) is the token ranked r_{d-1} by head d-1, placed at depth d, and attends to its
  ancestors only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedConfig

from models.config_checks import depth_check
from models.drafter import softcap
from models.losses import distill_step, step_metrics, weighted_total
from models.methods.medusa import export
from models.proposal import MAX_TREE_NODES, Proposal, Sampling
from models.spec import MethodSpec, ProposerSpec
from models.target import FrozenTarget
from models.tree import build_rank_tree as build_medusa_tree
from models.tree import expected_tree_tau, tree_capacity, tree_layout

log = logging.getLogger(__name__)


@dataclass
class MedusaConfig:
    num_heads: int = 4  # K: head k predicts token t+2+k
    num_layers: int = 1  # ResBlocks per head
    share_lm_head: bool = False  # True: every head ends in the target's frozen lm_head (one matmul for all)
    step_weight: float = 0.8  # head k's loss weighted step_weight^k
    distill: bool = True  # soft CE against the target's distribution; False → ground-truth tokens
    metric_top_k: int = 0  # >0: also report top{j}_{k} (target argmax within head k's top-j), j = 1..metric_top_k
    tree_nodes: int = 24  # static tree size saved with the final checkpoint (needs metric_top_k > 0)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.num_heads <= 0:
            raise ValueError(f"medusa num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"medusa num_layers must be >= 0, got {self.num_layers}")
        if self.num_layers == 0 and self.share_lm_head:
            raise ValueError("medusa num_layers=0 with share_lm_head=True leaves nothing to train")
        if self.metric_top_k < 0:
            raise ValueError(f"medusa metric_top_k must be >= 0, got {self.metric_top_k}")
        if self.metric_top_k > 0 and not 0 < self.tree_nodes <= tree_capacity(self.num_heads, self.metric_top_k):
            raise ValueError(f"medusa tree_nodes={self.tree_nodes}: {self.num_heads} heads x top-{self.metric_top_k} "
                             f"address 1..{tree_capacity(self.num_heads, self.metric_top_k)} nodes")


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


# ---------------------------------------------------------------------------------------------- proposal


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


# -------------------------------------------------------------------------------------------------- tree


TREE_FILE = "medusa_choices.json"


def rank_accuracy(metrics: Mapping[str, float], num_heads: int, top_k: int) -> torch.Tensor:
    """[K, top_k] P(head k's rank-r candidate is the target's token) from cumulative top{j}_{k} metrics
    (``MedusaHeads.training_loss`` with metric_top_k): acc[k, r] = top{r+1}_k - top{r}_k."""
    missing = [f"top{j}_{k}" for k in range(num_heads) for j in range(1, top_k + 1) if f"top{j}_{k}" not in metrics]
    if missing:
        raise ValueError(f"rank accuracies need metrics {missing[:3]}...; "
                         f"train with draft.config.metric_top_k >= {top_k}")
    cum = torch.tensor([[float(metrics[f"top{j}_{k}"]) for j in range(1, top_k + 1)] for k in range(num_heads)])
    return torch.diff(cum, dim=1, prepend=torch.zeros(num_heads, 1)).clamp_min(0.0)


def load_static_tree(ckpt_dir: str | Path, num_nodes: int | None = None) -> list[tuple[int, ...]] | None:
    """The tree saved with a checkpoint (``save_static_tree``); with ``num_nodes`` (and a different size)
    rebuilt from the saved rank accuracies. None when the checkpoint has no tree."""
    path = Path(ckpt_dir) / TREE_FILE
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    choices = [tuple(int(r) for r in c) for c in saved["choices"]]
    if num_nodes is None or num_nodes == len(choices):
        return choices
    acc = torch.tensor(saved["rank_accuracy"], dtype=torch.float64)
    return build_medusa_tree(acc, min(int(num_nodes), tree_capacity(*acc.shape)))


def load_rank_accuracy(ckpt_dir: str | Path) -> torch.Tensor | None:
    """The [K, top_k] held-out rank accuracies saved with a checkpoint (``save_static_tree``), or None."""
    path = Path(ckpt_dir) / TREE_FILE
    return torch.tensor(json.loads(path.read_text())["rank_accuracy"], dtype=torch.float64) if path.exists() else None


def size_tree(acc: torch.Tensor, verify_cost, max_nodes: int) -> tuple[int, dict[int, float]]:
    """The tree size n <= max_nodes maximising expected τ(n) / verify_cost(n): a wider tree accepts more but
    its verification forward costs more (on a CPU it grows with width; ``verify_cost(n)`` is the measured cost of
    a forward over n + 1 tokens in one-token-forward units). Medusa drafts every node in one call whatever n is,
    so the draft cost does not enter. Returns (n, {n: predicted speedup bound})."""
    cap = min(int(max_nodes), tree_capacity(*acc.shape))
    pred = {n: expected_tree_tau(acc, build_medusa_tree(acc, n)) / float(verify_cost(n)) for n in range(1, cap + 1)}
    return max(pred, key=pred.get), pred


@dataclass
class MedusaTreeBuffers:
    """What tree decoding needs for N = len(choices) candidate nodes (the root is not a node here).

    The root is the target's own next token (bonus token at the last verified position); decoders put it
    in front of the N nodes: it sits at position ``p`` and every node also attends to it and to the prefix;
    node i sits at position ``p + depth[i]``.
    """

    choices: list[tuple[int, ...]]  # sorted by (depth, path)
    parent: torch.Tensor  # [N] int64, index of the parent node, -1 for depth-1 nodes (parent = root)
    depth: torch.Tensor  # [N] int64, 1-based (= len(path))
    head: torch.Tensor  # [N] int64, head the node's token comes from (= depth - 1)
    rank: torch.Tensor  # [N] int64, rank within that head's top-k (= path[-1])
    attn_mask: torch.Tensor  # [N, N] bool, [i, j] = node j is node i or one of its ancestors
    leaf_paths: torch.Tensor  # [num_leaves, max_depth] int64 node indices root→leaf, right-padded with -1


def tree_buffers(choices: Sequence[Sequence[int]]) -> MedusaTreeBuffers:
    """Parent/depth/(head, rank) per node, the [N, N] ancestor mask and root→leaf paths."""
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
    if len(paths) != len(choices):
        raise ValueError("medusa tree choices contain duplicates")
    if not paths or any(len(p) == 0 for p in paths):
        raise ValueError("medusa tree needs at least one node and no empty path")
    index = {p: i for i, p in enumerate(paths)}
    N = len(paths)
    parent = torch.full((N,), -1, dtype=torch.long)
    for i, p in enumerate(paths):
        if len(p) > 1:
            if p[:-1] not in index:
                raise ValueError(f"medusa tree node {p} has no parent {p[:-1]} in the tree")
            parent[i] = index[p[:-1]]
    depth, mask = tree_layout(parent)  # depth = len(path); mask: itself and every ancestor (prefixes of its path)
    is_parent = torch.zeros(N, dtype=torch.bool)
    is_parent[parent[parent >= 0]] = True
    leaves = [i for i in range(N) if not is_parent[i]]
    max_depth = int(depth.max())
    leaf_paths = torch.full((len(leaves), max_depth), -1, dtype=torch.long)
    for row, i in enumerate(leaves):
        p = paths[i]
        leaf_paths[row, : len(p)] = torch.tensor([index[p[:d]] for d in range(1, len(p) + 1)])
    return MedusaTreeBuffers(
        choices=paths, parent=parent, depth=depth, head=depth - 1,
        rank=torch.tensor([p[-1] for p in paths], dtype=torch.long), attn_mask=mask, leaf_paths=leaf_paths,
    )


def tree_tokens(buffers: MedusaTreeBuffers, candidates: torch.Tensor) -> torch.Tensor:
    """candidates [B, K, top_k] (``propose``) → node tokens [B, N] in ``buffers.choices`` order."""
    return candidates[:, buffers.head.to(candidates.device), buffers.rank.to(candidates.device)]


# --------------------------------------------------------------------------------------------- proposers

def default_medusa_choices(num_heads: int, top_k: int = 10, num_nodes: int = 63) -> list[tuple[int, ...]]:
    """A Medusa tree without measured head accuracies: build_medusa_tree on a made-up table where head k's
    rank-r candidate is right with probability 0.6^(k+1) / (r+1) (deeper heads and lower ranks less often).
    Prefer ``build_medusa_tree(head_topk_accuracy(...), n)`` with the trained heads."""
    acc = torch.tensor([[0.6 ** (k + 1) / (r + 1) for r in range(top_k)] for k in range(num_heads)])
    return build_medusa_tree(acc, min(num_nodes, tree_capacity(num_heads, top_k)))


class MedusaProposer:
    """Medusa heads on a static tree: node (r_0, …, r_{d-1}) is head d-1's rank-r_{d-1} token, read from the
    target's post-norm hidden state of the token before the newest one (head k predicts newest + 1 + k)."""

    def __init__(self, heads, choices: Sequence[Sequence[int]] | None = None, max_nodes: int = MAX_TREE_NODES):
        self.heads = heads.eval()
        self.layer_ids = list(heads.layer_ids)
        K = heads.cfg.num_heads
        choices = default_medusa_choices(K) if choices is None else [tuple(c) for c in choices]
        self.buffers = tree_buffers(choices)
        deepest = int(self.buffers.depth.max())
        if deepest > K:
            raise ValueError(f"medusa choices are {deepest} deep but the drafter has {K} heads: each depth needs "
                             "its own head; use choices of depth <= num_heads")
        if len(choices) > max_nodes:
            raise ValueError(f"medusa tree has {len(choices)} nodes, more than max_nodes={max_nodes}")
        self.top_k = int(self.buffers.rank.max()) + 1
        if self.top_k > heads.vocab_size:
            raise ValueError(f"medusa choices use rank {self.top_k - 1} but the vocabulary has {heads.vocab_size}")
        self.depth_of = self.buffers.depth

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.last_h = hidden[self.layer_ids[0]][:, -1]  # [1, H]

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.last_h = hidden[self.layer_ids[0]][:, -1]

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        b = self.buffers
        cand = propose(self.heads, self.last_h, self.top_k)  # [1, K, top_k]
        tok = tree_tokens(b, cand)[0]
        n = int((b.depth <= max_depth).sum())  # choices are sorted by depth: a prefix is a shallower tree
        return Proposal(tokens=tok[:n], parents=b.parent[:n].to(tok.device), depth=b.depth[:n].to(tok.device),
                        ancestors=b.attn_mask[:n, :n].to(tok.device))


# --------------------------------------------------------------------------------------------- the method
def build(cfg: MedusaConfig, target: FrozenTarget, train_rows: list[dict] | None = None) -> MedusaHeads:
    # the heads' own projections are copies; a shared (frozen) head borrows the target's storage
    return MedusaHeads(cfg, target.model.config, target.model.get_output_embeddings().weight.detach())


def _prepare_tree(heads: MedusaHeads, ckpt_dir: str | None, o: dict) -> dict:
    """The tree before any proposer exists: ``choices`` given, else the one saved with the checkpoint (held-out
    rank accuracies; with ``num_nodes: auto`` at its largest, ``max_nodes``, for ``_size_tree`` to shrink),
    else a made-up-accuracy tree (warned)."""
    choices, auto = o.get("choices"), o.get("num_nodes") == "auto"
    if choices is None and ckpt_dir is not None:
        choices = load_static_tree(ckpt_dir, int(o["max_nodes"]) if auto else o.get("num_nodes"))
    if choices is None and auto:
        raise ValueError(f"options.medusa.num_nodes=auto needs the rank accuracies saved with the checkpoint "
                         f"({ckpt_dir}/{TREE_FILE}, written when trained with metric_top_k > 0); "
                         "pass a number of nodes instead")
    if choices is None:
        n_nodes = min(int(o["num_nodes"]), tree_capacity(heads.cfg.num_heads, int(o["top_k"])))
        log.warning("%s has no %s: using a made-up-accuracy tree of %d nodes", ckpt_dir, TREE_FILE, n_nodes)
        choices = default_medusa_choices(heads.cfg.num_heads, top_k=int(o["top_k"]), num_nodes=n_nodes)
    choices = [tuple(c) for c in choices]
    return {**o, "choices": choices, "num_nodes": len(choices), "auto_size": auto}


def _size_tree(heads: MedusaHeads, ckpt_dir: str | None, o: dict, verify_cost, t1_s: float | None = None
               ) -> dict | None:
    """Cost-model sizing (``num_nodes: auto``): the tree size whose expected τ (saved rank accuracies) over the
    measured verify cost v(n) is largest, up to the prepared tree's size."""
    if not o.get("auto_size"):
        return None
    acc = load_rank_accuracy(ckpt_dir)
    n, pred = size_tree(acc, verify_cost, int(o["num_nodes"]))
    return {**o, "choices": build_medusa_tree(acc, n), "num_nodes": n,
            "choices_sized": {"num_nodes": n, "predicted_bound": {k: round(v, 3) for k, v in pred.items()}}}


SPEC = MethodSpec(
    name="medusa", config=MedusaConfig, build=build, rebuild=build,
    export_formats=export.FORMATS, default_k=lambda heads: heads.cfg.num_heads,
    check_config=depth_check("num_heads", "step_weight"),
    after_training=lambda heads, out_dir, metrics: heads.save_static_tree(out_dir, metrics), final_files=(TREE_FILE,),
    proposers=(ProposerSpec(
        "medusa", lambda heads, _t, **o: MedusaProposer(heads, choices=o["choices"]),
        {"top_k": 4, "num_nodes": "auto", "max_nodes": 24, "choices": None},
        chain=False, k_option=None, prepare=_prepare_tree, size=_size_tree, nodes=lambda o: int(o["num_nodes"])),),
)
