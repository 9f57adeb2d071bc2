"""EAGLE-3: the method (drafter, training-time-test loss, chain and tree proposers, exports).

Architecture (arXiv 2503.01840; SafeAILab/EAGLE `eagle/traineagle3/cnets.py`), for a target with hidden size H
and vocab V:

    g  = fc(cat(h_{l0}, h_{l1}, h_{l2}))                 fc: 3H → H, no bias
    x  = cat(input_layernorm(emb(t)), hidden_norm(g))    2H, embedding first
    a' = g + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))     (residual = hidden_norm(g) if norm_before_residual)
    a  = a' + mlp(post_attention_layernorm(a'))          SwiGLU
    q  = softmax(lm_head(norm(a)))                       over the Vd draft ids (models/core/vocab.py)

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

The package: ``config.py`` (Eagle3Config), ``net.py`` (the network and its TTT loss, what training and export
read), ``kernels.py`` (drafting with a KV cache), ``proposers.py`` (chain, batched chain, EAGLE-2 tree),
``export.py`` (the engine formats), ``check.py`` (their validator); here: build/rebuild, the EAGLE-2 tree sizing
and ``SPEC``.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from models.core.acceptance import best_by_cost, rank_accuracy
from models.core.config_checks import depth_check
from models.core.lookup import LookupFirst, with_lookup
from models.core.proposal import MAX_TREE_NODES
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS, MethodSpec, ProposerSpec
from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab, count_tokens
from models.methods.eagle3 import export
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.kernels import DraftKV, cached_step, drafting_weights
from models.methods.eagle3.net import RANKS, Eagle3Drafter
from models.methods.eagle3.proposers import Eagle3ChainProposer, Eagle3TreeProposer


# --------------------------------------------------------------------------------------------- the method
def build(cfg: Eagle3Config, target: FrozenTarget, train_rows: list[dict]) -> Eagle3Drafter:
    """A new drafter; its draft vocabulary = the most frequent tokens at loss-masked positions of the data."""
    if cfg.draft_vocab_size > target.vocab_size:
        raise ValueError(f"draft.config.draft_vocab_size={cfg.draft_vocab_size} is larger than the target's "
                         f"vocabulary ({target.vocab_size}); set it <= {target.vocab_size}")
    d2t, t2d = build_draft_vocab(count_tokens(train_rows, target.vocab_size), cfg.draft_vocab_size)
    d = Eagle3Drafter(cfg, target.model.config, target.embed.weight.detach().clone(), d2t, t2d)
    if cfg.lm_head != "new":  # a new drafter only: on rebuild, the checkpoint's saved rows replace these
        head = target.model.get_output_embeddings().weight
        with torch.no_grad():
            d.lm_head.weight.copy_(head.detach().float()[d.draft_ids.to(head.device)])
    return d


def rebuild(cfg: Eagle3Config, target: FrozenTarget) -> Eagle3Drafter:
    return Eagle3Drafter(cfg, target.model.config, target.embed.weight.detach().clone())


def eagle_rank_accuracy(metrics: dict, steps: int, size_for: float = 0) -> Tensor:
    """[steps, RANKS] P(the depth-(k+1) rank-r draft is accepted | its path was) from held-out ``rank_metrics``:
    greedy hits (``top{j}_{k}``) when sizing for T=0, the target's probability mass (``mass{j}_{k}``) for T>0."""
    # TTT step k is scored on paths whose first k drafts were right: row k is already conditional
    return rank_accuracy(metrics, steps, RANKS, "top" if float(size_for) == 0 else "mass",
                         why_missing="EAGLE-2 tree sizing reads them from the checkpoint's eval.json, written by "
                                     "training; retrain, or give depth/top_k/total_tokens as numbers")


# the lookup's chain behind EAGLE-3 (``lookup``), whatever the chain's K or the sized tree's depth (2 on SmolLM2):
# on the on-policy drafter (chain K=4, lookup 2, 24 prompts x 64 tokens, T=0) 4 / 6 / 8 lookup tokens gave τ
# 2.22 / 2.35 / 2.40 on HumanEval and 1.76 / 1.79 / 1.81 on MT-Bench at equal wall time
LOOKUP_TOKENS = 6
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

    from models.core.tree import build_rank_tree, expected_tree_tau, tree_capacity

    if not o.get("auto_size"):
        return None
    acc = eagle_rank_accuracy(json.loads((Path(ckpt_dir) / "eval.json").read_text()), int(o["depth"]),
                              o["size_for"])[:, : int(o["top_k"])]
    passes = _draft_pass_cost(d, list(range(1, acc.shape[1] + 1)), t1_s) if t1_s else None
    trees = {n: build_rank_tree(acc, n) for n in range(1, min(int(o["total_tokens"]), tree_capacity(*acc.shape)) + 1)}
    shape = {n: (max(len(c) for c in t), max(max(c) for c in t) + 1) for n, t in trees.items()}  # (depth, width)

    def round_cost(n: int) -> float:  # drafting (root pass + depth-1 passes of width entries) + verifying n nodes
        draft = 0.0 if passes is None else passes[1] + (shape[n][0] - 1) * passes[shape[n][1]]
        return draft + float(verify_cost(n))

    n, pred = best_by_cost(trees, lambda n: expected_tree_tau(acc, trees[n]), round_cost)
    depth, width = shape[n]
    return {**o, "depth": depth, "top_k": width, "total_tokens": n,
            "tree_sized": {"total_tokens": n, "depth": depth, "top_k": width, "size_for": o["size_for"],
                           "pass_cost": None if passes is None else {k: round(v, 4) for k, v in passes.items()},
                           "predicted_bound": {k: round(v, 3) for k, v in pred.items()}}}


def _chain(d, t, weights: str = "auto", lookup: int = 0, lookup_tokens: int = LOOKUP_TOKENS,
           **o) -> Eagle3ChainProposer | LookupFirst:
    chain = Eagle3ChainProposer(d, **o, weights=drafting_weights(weights, t))
    return with_lookup(chain, lookup, lookup_tokens)


def _tree(d, t, max_nodes: int = MAX_TREE_NODES, size_for: float = 0, weights: str = "auto", lookup: int = 0,
          lookup_tokens: int = LOOKUP_TOKENS, **o) -> Eagle3TreeProposer | LookupFirst:
    tree = Eagle3TreeProposer(d, **o, max_nodes=max(int(max_nodes), int(o["total_tokens"])),
                              weights=drafting_weights(weights, t))
    return with_lookup(tree, lookup, lookup_tokens)


SPEC = MethodSpec(
    name="eagle3", config=Eagle3Config, build=build, rebuild=rebuild,
    export_formats=export.FORMATS,
    default_num_speculative_tokens=lambda _d: DEFAULT_NUM_SPECULATIVE_TOKENS,  # an export's K without eval results
    check_config=depth_check("ttt_steps", "step_weight"),  # ttt_steps: the chain trained (training-time test)
    proposers=(
        # weights: the drafting precision (auto: the target's when bf16, else float32 | float32 | bfloat16 | int8;
        # ``drafting_weights``, ``inference_copy``)
        # eval's variants: the same chain drafting in bf16 / int8, benchmarked side by side (what the switch buys)
        # lookup: prompt lookup first (models/core/lookup.py ``with_lookup``): a round whose context's last
        # lookup..3 tokens occurred before drafts the lookup_tokens that followed them, free; 0 = off.
        # eagle3_lookup / eagle3_tree_lookup: the same drafter behind it, each its own row
        ProposerSpec("eagle3", _chain,
                     {"num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS, "weights": "auto", "lookup": 0,
                      "lookup_tokens": LOOKUP_TOKENS},
                     batched=Eagle3ChainProposer.batched, recommend_rank=0,
                     variants={"eagle3_bf16": {"weights": "bfloat16"}, "eagle3_int8": {"weights": "int8"},
                               "eagle3_lookup": {"lookup": 2}}),
        # EAGLE-2 dynamic tree, sized for CPU (verify cost grows with nodes there; GPU: depth 6, top_k 10, 60)
        # total_tokens auto: sized by the cost model (``_size_tree``; depth and top_k are then caps), for the
        # acceptance at T=0 (size_for 0) or at T=1 (size_for 1)
        ProposerSpec("eagle3_tree", _tree,
                     {"depth": 5, "top_k": 4, "total_tokens": "auto", "max_nodes": 32, "size_for": 0,
                      "weights": "auto", "lookup": 0, "lookup_tokens": LOOKUP_TOKENS},
                     chain=False, prepare=_prepare_tree, size=_size_tree,
                     nodes=lambda o: int(o["total_tokens"]),
                     # eagle3_tree_t1: the tree sized for T=1 acceptance
                     variants={"eagle3_tree_t1": {"size_for": 1}, "eagle3_tree_lookup": {"lookup": 2}}),
    ),
)
