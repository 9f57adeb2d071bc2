"""DFlash / DSpark exports, checked: the validator each of export.py's formats runs on a written (or a user's)
config + tensors before loading or serving — the headers, block conventions, layer ids, mask id, shapes and vocabulary
maps an engine would misread. The format facts are in export.py's docstring.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from models.core.vocab import check_mapping
from models.export.shared.common import (
    TargetInfo,
    Tensors,
    fail,
    require,
    target_num_layers,
)


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def check_dflash(fmt: str, cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None,
                  where: str) -> tuple[dict, dict]:
    """An exported DFlash / DSpark config.json and its tensors → (the expected tensor shapes, what the caller
    compares with the target). The checks run in one fixed order, a step each: the format's own header, the
    block, the layer shapes, the fused layer ids, the mask row, then the tensors."""
    spec, dspark = fmt.endswith("_speculators"), fmt.startswith("dspark")
    if spec:
        layer, ids, mask_id, pm, head_cfg, shift = _speculators_header(cfg, dspark, where)
    else:
        layer, ids, mask_id, pm, head_cfg, shift = _zlab_header(cfg, dspark, where)
    _check_block(cfg, pm if spec else None, dspark, where)
    dims = _layer_dims(cfg, layer, where)
    what = "aux_hidden_state_layer_ids (vLLM capture: input of layer k)" if spec else \
        "dflash_config.target_layer_ids (z-lab: output of layer k)"
    _check_layer_ids(ids, shift, what, target, side, where)
    _check_mask_id(mask_id, dims["V"], side, where)
    H, V, Vd, F_ = dims["H"], dims["V"], dims["Vd"], len(ids)
    if "fc.weight" in t.shapes and tuple(t.shapes["fc.weight"]) != (H, F_ * H):
        fail(where, f"fc.weight has shape {list(t.shapes['fc.weight'])}, expected {[H, F_ * H]} for {F_} fused "
                     f"target states of size {H}")
    exp = _body_shapes(dims, F_)
    if dspark:
        exp.update(_dspark_tensors(head_cfg, H, V, Vd, where))
    if spec:
        exp.update({"embed_tokens.weight": (V, H), "lm_head.weight": (Vd, H)})
        if Vd < V:
            exp.update({"d2t": (Vd,), "t2d": (V,)})
            _check_vocab_maps(t, V, Vd, where)
    name = (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") if spec else None
    return exp, {"hidden_size": H, "vocab_size": V, "name": name, "rope_theta": layer.get("rope_theta")}


def _speculators_header(cfg: dict, dspark: bool, where: str) -> tuple:
    """The speculators keys that say what the drafter is → (layer config, layer ids, mask id, proposal method,
    the config holding the DSpark head keys, the id shift to ours: 0)."""
    kind = "dspark" if dspark else "dflash"
    if cfg.get("speculators_model_type") != kind:
        fail(where, f"speculators_model_type must be {kind!r}, got {cfg.get('speculators_model_type')!r}")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        fail(where, "config.json needs a transformer_layer_config object")
    ids = cfg.get("aux_hidden_state_layer_ids")
    mask_id = cfg.get("mask_token_id")
    sc = cfg.get("speculators_config") or {}
    pm = (sc.get("proposal_methods") or [{}])[0]
    if sc.get("algorithm") != kind or not isinstance(pm.get("speculative_tokens"), int):
        fail(where, f"speculators_config needs algorithm {kind!r} and proposal_methods[0].speculative_tokens")
    if not (sc.get("verifier") or {}).get("name_or_path"):
        fail(where, "speculators_config.verifier.name_or_path is required (vLLM's base.py validation)")
    if cfg.get("sliding_window_non_causal") is False:
        fail(where, "sliding_window_non_causal=false: vLLM serves every draft layer with causal in-block "
                     "attention then, but DFlash drafters attend bidirectionally inside the block (write true "
                     "or leave it out)")
    if dspark and cfg.get("sample_from_anchor") is not True:
        fail(where, "sample_from_anchor must be true for DSpark (the anchor slot drafts: B speculative tokens); "
                     "a mismatch with the engine shifts every slot")
    if not dspark and cfg.get("sample_from_anchor") not in (False, None):
        fail(where, "sample_from_anchor must be false for DFlash (slot 0 is the anchor); true is DSpark's layout")
    return layer, ids, mask_id, pm, cfg, 0


def _zlab_header(cfg: dict, dspark: bool, where: str) -> tuple:
    """The z-lab keys, as ``_speculators_header`` returns them (no proposal method; ids shift by 1 to ours)."""
    arch = ["DSparkDraftModel"] if dspark else ["DFlashDraftModel"]
    if cfg.get("architectures") != arch:
        fail(where, f"architectures must be {arch}, got {cfg.get('architectures')}")
    dc = cfg.get("dflash_config") or {}
    if dspark and dc.get("projector_type") != "dspark":
        fail(where, f"dflash_config.projector_type must be 'dspark', got {dc.get('projector_type')!r}")
    return cfg, dc.get("target_layer_ids"), dc.get("mask_token_id"), {}, dc, 1


def _check_block(cfg: dict, pm: dict | None, dspark: bool, where: str) -> None:
    """block_size, and (speculators: ``pm``) the verified slots engines take from it."""
    B = require(cfg, "block_size", where)
    if B < 2:
        fail(where, f"block_size={B}: a block needs the anchor and at least one drafted slot")
    S = B if dspark else B - 1
    if pm is not None and not 1 <= pm["speculative_tokens"] <= S:
        fail(where, f"speculative_tokens={pm['speculative_tokens']} disagrees with block_size={B}: vLLM verifies "
                     f"1..{'B' if dspark else 'B-1'} = 1..{S} drafted slots (slots past the block were never trained)")
    if pm is not None and pm["speculative_tokens"] < S:
        # vLLM 0.32 v1/spec_decode/dflash.py queries 1 + num_speculative_tokens slots, not the trained block: with
        # bidirectional in-block attention fewer mask slots change every draft (draftsmith runs the whole block)
        warnings.warn(f"{where}: speculative_tokens={pm['speculative_tokens']} < {S} (the block's drafted slots): "
                      f"vLLM then builds a smaller block than the trained {B}, so its drafts differ from "
                      "draftsmith's; serve num_speculative_tokens = the block's drafted slots", UserWarning,
                      stacklevel=3)


def _layer_dims(cfg: dict, layer: dict, where: str) -> dict[str, int]:
    """The draft layers' sizes (H, I, heads, kv heads, head dim, layers, V, draft V); silu only."""
    H = require(layer, "hidden_size", where)
    I_ = require(layer, "intermediate_size", where)
    nh = require(layer, "num_attention_heads", where)
    nkv = layer.get("num_key_value_heads") or nh
    hd = layer.get("head_dim") or H // nh
    Ld = require(layer, "num_hidden_layers", where)
    V = require(layer, "vocab_size", where)
    Vd = cfg.get("draft_vocab_size") or V
    if layer.get("hidden_act", "silu") != "silu":
        fail(where, f"hidden_act must be silu (SGLang's DFlash supports only silu), got {layer.get('hidden_act')!r}")
    return {"H": H, "I": I_, "nh": nh, "nkv": nkv, "hd": hd, "Ld": Ld, "V": V, "Vd": Vd}


def _check_layer_ids(ids: Any, shift: int, what: str, target: TargetInfo | None, side: dict | None,
                     where: str) -> None:
    """The fused ids: distinct integers, in range for the target, and (with a sidecar) the ones trained on."""
    if not _int_list(ids) or len(set(ids)) != len(ids):
        fail(where, f"{what} must list distinct integer layer ids, got {ids!r} (vLLM falls back to 3 EAGLE ids "
                     "silently when they are absent)")
    L = target_num_layers(target, side)
    if L is not None:
        lo, hi = 1 - shift, L - 1 - shift
        bad = [i for i in ids if not lo <= i <= hi]
        if bad:
            fail(where, f"{what} {ids}: {bad} out of range for a {L}-layer target ({lo}..{hi} in this convention; "
                         "ids in the other convention are off by one)")
    ours = [i + shift for i in ids]
    if side is not None and side.get("layer_ids") is not None and list(side["layer_ids"]) != ours:
        fail(where, f"{what} {ids} is {ours} in draftsmith's convention but the drafter was trained on "
                     f"{side['layer_ids']}: one of them is off by one")


def _check_mask_id(mask_id: Any, V: int, side: dict | None, where: str) -> None:
    if not isinstance(mask_id, int) or isinstance(mask_id, bool) or not 0 <= mask_id < V:
        fail(where, f"mask_token_id {mask_id!r} is not a row of the target's {V}-row embedding")
    if side is not None and (side.get("draft") or {}).get("mask_token_id") not in (None, mask_id):
        fail(where, f"mask_token_id {mask_id} differs from the one the drafter was trained with "
                     f"({side['draft']['mask_token_id']})")


def _body_shapes(dims: dict[str, int], F_: int) -> dict[str, tuple[int, ...]]:
    """The backbone's tensor shapes (both formats): fc over F_ fused states, the norms, Ld Qwen3 layers."""
    H, I_, nh, nkv, hd = dims["H"], dims["I"], dims["nh"], dims["nkv"], dims["hd"]
    exp: dict[str, tuple[int, ...]] = {"fc.weight": (H, F_ * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(dims["Ld"]):
        p = f"layers.{i}."
        exp.update({p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                    p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I_, H), p + "mlp.up_proj.weight": (I_, H),
                    p + "mlp.down_proj.weight": (H, I_), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
    return exp


def _check_vocab_maps(t: Tensors, V: int, Vd: int, where: str) -> None:
    """A reduced draft vocabulary's d2t / t2d (speculators): their dtypes and that they are one mapping."""
    for name, dt in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name in t.dtypes and t.dtypes[name] != dt:
            fail(where, f"{name} must be {str(dt).removeprefix('torch.')}, got {t.dtypes[name]}")
    if "d2t" in t.shapes and "t2d" in t.shapes and t.shapes["d2t"] == (Vd,) and t.shapes["t2d"] == (V,):
        try:
            check_mapping(t.get("d2t"), t.get("t2d"))
        except ValueError as e:
            fail(where, f"d2t/t2d rejected: {e}")


def _dspark_tensors(c: dict, H: int, V: int, Vd: int, where: str) -> dict[str, tuple[int, ...]]:
    r = c.get("markov_rank")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        fail(where, f"markov_rank must be a positive integer, got {r!r} (0 disables the head: not a DSpark drafter)")
    if c.get("markov_head_type", "vanilla") != "vanilla":
        fail(where, f"markov_head_type {c.get('markov_head_type')!r}: only 'vanilla' is written and checked here")
    for key in ("enable_confidence_head", "confidence_head_with_markov"):
        if not isinstance(c.get(key), bool):
            fail(where, f"{key} must be true or false, got {c.get(key)!r} (write it: defaults differ by engine)")
    exp = {"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (Vd, r)}
    if c["enable_confidence_head"]:
        exp.update({"confidence_head.proj.weight": (1, H + (r if c["confidence_head_with_markov"] else 0)),
                    "confidence_head.proj.bias": (1,)})
    return exp
