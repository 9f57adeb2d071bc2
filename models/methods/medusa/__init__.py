"""Medusa heads trained on a frozen target (build, tree sizing, ``SPEC``).

The package, one seam per module:

    config.py     ``MedusaConfig`` (``draft.config``)
    net.py        the heads and their self-distillation loss (``MedusaHeads``; the method's maths), rank accuracy
    tree.py       the static tree: saved with the checkpoint, rebuilt at another size, its decoding buffers
    proposers.py  ``MedusaProposer`` (the heads' candidates on that tree)
    export.py     the FasterDecoding and vLLM formats
    here          a new drafter, the tree eval prepares and sizes from the measured verify cost, ``SPEC``
                  (its ``after_training`` writes the tree next to the final weights)
"""

from __future__ import annotations

import logging

from models.core.spec import MethodSpec, ProposerSpec
from models.core.target import FrozenTarget
from models.core.tree import tree_capacity
from models.methods.medusa import export
from models.methods.medusa.config import MedusaConfig, check_config
from models.methods.medusa.net import MedusaHeads
from models.methods.medusa.proposers import MedusaProposer
from models.methods.medusa.tree import (
    TREE_FILE,
    build_medusa_tree,
    default_medusa_choices,
    load_rank_accuracy,
    load_static_tree,
    size_tree,
)

log = logging.getLogger(__name__)


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
    export_formats=export.FORMATS, default_num_speculative_tokens=lambda heads: heads.cfg.num_heads,
    check_config=check_config,
    after_training=lambda heads, out_dir, metrics: heads.save_static_tree(out_dir, metrics), final_files=(TREE_FILE,),
    proposers=(ProposerSpec(
        "medusa", lambda heads, _t, **o: MedusaProposer(heads, choices=o["choices"]),
        {"top_k": 4, "num_nodes": "auto", "max_nodes": 24, "choices": None},
        chain=False, prepare=_prepare_tree, size=_size_tree, nodes=lambda o: int(o["num_nodes"]),
        # an engine's Medusa chain of K: the top-1 of each of the first K heads (vLLM's medusa proposer)
        engine_options=lambda n: {"choices": [[0] * i for i in range(1, n + 1)], "num_nodes": n}),),
)
