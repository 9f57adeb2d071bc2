"""DFlash exports: the speculators format (vLLM ``method: dflash``) and the z-lab format (SGLang ``DFLASH``).

Facts (shared/design/dflash.md §4, read against vllm-project/speculators ``models/dflash/config.py``,
``convert/dflash/converter.py``; vLLM ``transformers_utils/configs/speculators/algos.py`` ``update_dflash``,
``model_executor/models/qwen3_dflash.py``; SGLang ``srt/speculative/dflash_utils.py``, ``srt/models/dflash.py``):

- Both carry the same body: ``fc.weight [H, F·H]``, ``hidden_norm.weight``, ``norm.weight`` and Qwen3 layers
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``.{q,k}_norm.weight``, ``.mlp.{gate,up,down}_proj.weight``,
  ``.{input,post_attention}_layernorm.weight``.
- Layer ids: ours (HF ``output_hidden_states`` index) = vLLM / speculators ``aux_hidden_state_layer_ids`` (capture
  "entering layer k") = z-lab ``dflash_config.target_layer_ids`` + 1 ("output of layer k"). vLLM's update_dflash
  derives ``target_layer_ids = aux − 1``; SGLang requires target_layer_ids in [0, L_t) (vLLM PR #40727: an
  off-by-one here cost 3-5 % acceptance silently).
- Block size: vLLM ``num_speculative_tokens`` = B − 1 (speculators ``speculative_tokens``); SGLang's
  ``--speculative-num-draft-tokens`` = B (anchor included).
- speculators stores ``embed_tokens.weight`` and ``lm_head.weight [Vd, H]`` (frozen copies of the verifier's)
  and d2t/t2d when the draft vocabulary is reduced; z-lab stores neither embedding nor head (SGLang uses the
  target's whole head), so a reduced-vocabulary drafter cannot be written there without changing its drafts.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from models.target import FrozenTarget
from models.vocab import check_mapping

from .common import (
    DTYPE_NAMES,
    Bundle,
    ExportError,
    TargetInfo,
    Tensors,
    engine_target_name,
    fail,
    make_sidecar,
    require,
    target_num_layers,
)


# ============================================================================================ build
def _layer_config(d: nn.Module, target: FrozenTarget) -> dict:
    """The Qwen3Config fields of the draft layers (both formats; vLLM builds Qwen3 DFlash layers from them)."""
    tc = target.model.config
    rope = dict(d.rope_parameters)
    return {
        "model_type": "qwen3", "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads, "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim, "num_hidden_layers": d.cfg.num_layers, "rms_norm_eps": d.rms_norm_eps,
        "hidden_act": "silu", "attention_bias": False, "vocab_size": d.vocab_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 2048)),
        "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_parameters": rope,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        # every draft layer is full (bidirectional in-block) attention, as z-lab's drafts
        "layer_types": ["full_attention"] * d.cfg.num_layers, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
    }


def _body(d: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in d.state_dict().items():
        if k in ("embed_tokens", "lm_head", "d2t", "t2d"):
            continue
        out[k] = v.detach().clone()
    return out


def _check_ids_servable(d: nn.Module, target: FrozenTarget) -> list[int]:
    L = target.num_layers
    bad = [k for k in d.layer_ids if not 1 <= k <= L - 1]
    if bad:  # id 0 is the embedding (no layer output), id L our post-norm state (vLLM's L is pre-norm)
        raise ExportError(f"DFlash layer ids {bad} cannot be served: engines capture the outputs of decoder layers "
                          f"0..{L - 2} of this {L}-layer target (our ids 1..{L - 1}); retrain with other layer_ids")
    return list(d.layer_ids)


def build_dflash_speculators(d: nn.Module, target: FrozenTarget, name: str, k: int | None,
                              meta: dict | None) -> Bundle:
    ids = _check_ids_servable(d, target)
    B = d.block_size
    k = k or B - 1
    if k > B - 1:
        raise ExportError(f"num_speculative_tokens={k} exceeds block_size-1={B - 1}: slots past the block were never "
                          "trained")
    layer = _layer_config(d, target)
    layer.pop("torch_dtype")
    cfg = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": d.draft_vocab_size, "target_hidden_size": d.hidden_size,
        "block_size": B,
        # speculators / vLLM capture convention = ours; vLLM's update_dflash requires it (and mask_token_id)
        "aux_hidden_state_layer_ids": ids,
        "mask_token_id": int(d.cfg.mask_token_id),
        # vLLM 0.32 (transformers_utils/configs/speculators/algos.py update_dflash) turns this key into
        # dflash_config.causal = not value for EVERY draft layer (qwen3_dflash.py), sliding or not: false would
        # serve our bidirectional in-block attention as causal. True (or absent) gives causal=False.
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,  # DFlash: slot 0 is the anchor, B-1 speculative tokens (DSpark: true)
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": engine_target_name(name),
                         "architectures": list(getattr(target.model.config, "architectures", None) or [])},
        },
        "torch_dtype": DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
    }
    tensors = _body(d)
    # frozen copies of the verifier's, as speculators' own save_pretrained writes them
    tensors["embed_tokens.weight"] = d.embed_tokens.detach().clone()
    tensors["lm_head.weight"] = d.lm_head.detach().clone()
    if d.draft_vocab_size < d.vocab_size:
        tensors["d2t"], tensors["t2d"] = d.d2t.clone(), d.t2d.clone()
    side = make_sidecar("dflash_speculators", d, target, name, k, meta)
    return Bundle("dflash_speculators", cfg, tensors, side)


def build_dflash_zlab(d: nn.Module, target: FrozenTarget, name: str, k: int | None, meta: dict | None) -> Bundle:
    ids = _check_ids_servable(d, target)
    if d.draft_vocab_size < d.vocab_size:
        raise ExportError(f"the z-lab/SGLang DFlash format has no draft vocabulary (SGLang drafts over the target's "
                          f"whole lm_head) but this drafter uses {d.draft_vocab_size} of {d.vocab_size} ids; export "
                          "--format dflash-speculators (vLLM) or train with draft.config.draft_vocab_size=null")
    B = d.block_size
    cfg = {
        **_layer_config(d, target),
        "architectures": ["DFlashDraftModel"],
        "num_target_layers": target.num_layers,
        "block_size": B,
        # z-lab convention: output of decoder layer k = our id - 1; SGLang requires [0, num_target_layers)
        "dflash_config": {"mask_token_id": int(d.cfg.mask_token_id), "target_layer_ids": [i - 1 for i in ids]},
    }
    side = make_sidecar("dflash_zlab", d, target, name, k or B - 1, meta)
    return Bundle("dflash_zlab", cfg, _body(d), side)


# ============================================================================================ check
def _int_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def check_dflash(fmt: str, cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None,
                  where: str) -> tuple[dict, dict]:
    spec = fmt == "dflash_speculators"
    if spec:
        if cfg.get("speculators_model_type") != "dflash":
            fail(where, f"speculators_model_type must be 'dflash', got {cfg.get('speculators_model_type')!r}")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            fail(where, "config.json needs a transformer_layer_config object")
        ids = cfg.get("aux_hidden_state_layer_ids")
        mask_id = cfg.get("mask_token_id")
        sc = cfg.get("speculators_config") or {}
        pm = (sc.get("proposal_methods") or [{}])[0]
        if sc.get("algorithm") != "dflash" or not isinstance(pm.get("speculative_tokens"), int):
            fail(where, "speculators_config needs algorithm 'dflash' and proposal_methods[0].speculative_tokens")
        if not (sc.get("verifier") or {}).get("name_or_path"):
            fail(where, "speculators_config.verifier.name_or_path is required (vLLM's base.py validation)")
        if cfg.get("sliding_window_non_causal") is False:
            fail(where, "sliding_window_non_causal=false: vLLM serves every draft layer with causal in-block "
                         "attention then, but DFlash drafters attend bidirectionally inside the block (write true "
                         "or leave it out)")
        if cfg.get("sample_from_anchor") not in (False, None):
            fail(where, "sample_from_anchor must be false for DFlash (slot 0 is the anchor); true is DSpark's layout")
        shift = 0
    else:
        if cfg.get("architectures") != ["DFlashDraftModel"]:
            fail(where, f"architectures must be ['DFlashDraftModel'], got {cfg.get('architectures')}")
        layer = cfg
        dc = cfg.get("dflash_config") or {}
        ids, mask_id, pm, shift = dc.get("target_layer_ids"), dc.get("mask_token_id"), {}, 1
    B = require(cfg, "block_size", where)
    if B < 2:
        fail(where, f"block_size={B}: a block needs the anchor and at least one drafted slot")
    if spec and not 1 <= pm["speculative_tokens"] <= B - 1:
        fail(where, f"speculative_tokens={pm['speculative_tokens']} disagrees with block_size={B}: vLLM verifies "
                     f"1..B-1 = 1..{B - 1} drafted slots (slots past the block were never trained)")
    if spec and pm["speculative_tokens"] < B - 1:
        # vLLM 0.32 v1/spec_decode/dflash.py queries 1 + num_speculative_tokens slots, not the trained block: with
        # bidirectional in-block attention fewer mask slots change every draft (draftsmith runs the whole block)
        warnings.warn(f"{where}: speculative_tokens={pm['speculative_tokens']} < block_size-1={B - 1}: vLLM then "
                      f"builds a block of {pm['speculative_tokens'] + 1} slots instead of the trained {B}, so its "
                      "drafts differ from draftsmith's; serve num_speculative_tokens = block_size - 1", UserWarning,
                      stacklevel=2)
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
    what = "aux_hidden_state_layer_ids (vLLM capture: input of layer k)" if spec else \
        "dflash_config.target_layer_ids (z-lab: output of layer k)"
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
    if not isinstance(mask_id, int) or isinstance(mask_id, bool) or not 0 <= mask_id < V:
        fail(where, f"mask_token_id {mask_id!r} is not a row of the target's {V}-row embedding")
    if side is not None and (side.get("draft") or {}).get("mask_token_id") not in (None, mask_id):
        fail(where, f"mask_token_id {mask_id} differs from the one the drafter was trained with "
                     f"({side['draft']['mask_token_id']})")
    F_ = len(ids)
    if "fc.weight" in t.shapes and tuple(t.shapes["fc.weight"]) != (H, F_ * H):
        fail(where, f"fc.weight has shape {list(t.shapes['fc.weight'])}, expected {[H, F_ * H]} for {F_} fused "
                     f"target states of size {H}")
    exp: dict[str, tuple[int, ...]] = {"fc.weight": (H, F_ * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(Ld):
        p = f"layers.{i}."
        exp.update({p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                    p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I_, H), p + "mlp.up_proj.weight": (I_, H),
                    p + "mlp.down_proj.weight": (H, I_), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
    if spec:
        exp.update({"embed_tokens.weight": (V, H), "lm_head.weight": (Vd, H)})
        if Vd < V:
            exp.update({"d2t": (Vd,), "t2d": (V,)})
            for name, dt in (("d2t", torch.int64), ("t2d", torch.bool)):
                if name in t.dtypes and t.dtypes[name] != dt:
                    fail(where, f"{name} must be {str(dt).removeprefix('torch.')}, got {t.dtypes[name]}")
            if "d2t" in t.shapes and "t2d" in t.shapes and t.shapes["d2t"] == (Vd,) and t.shapes["t2d"] == (V,):
                try:
                    check_mapping(t.get("d2t"), t.get("t2d"))
                except ValueError as e:
                    fail(where, f"d2t/t2d rejected: {e}")
    name = (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") if spec else None
    return exp, {"hidden_size": H, "vocab_size": V, "name": name, "rope_theta": layer.get("rope_theta")}


# ============================================================================================ load back
def load_dflash(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    from models.dflash import DFlashConfig, DFlashDrafter

    spec = fmt == "dflash_speculators"
    layer = cfg["transformer_layer_config"] if spec else cfg
    ids = list(cfg["aux_hidden_state_layer_ids"]) if spec else [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    mask_id = cfg["mask_token_id"] if spec else cfg["dflash_config"]["mask_token_id"]
    V = layer["vocab_size"]
    vd = cfg.get("draft_vocab_size") or V
    dc = DFlashConfig(layer_ids=ids, num_layers=layer["num_hidden_layers"], block_size=cfg["block_size"],
                      mask_token_id=mask_id, draft_vocab_size=None if vd == V else vd,
                      intermediate_size=layer["intermediate_size"])
    tc = target.model.config
    head = target.model.get_output_embeddings().weight
    d = DFlashDrafter(dc, tc, target.embed.weight, head, sd.get("d2t"), sd.get("t2d"))
    for key, mine in (("num_attention_heads", d.num_attention_heads), ("num_key_value_heads", d.num_key_value_heads),
                      ("head_dim", d.head_dim), ("hidden_size", d.hidden_size)):
        if layer.get(key, mine) != mine:
            raise ExportError(f"export {key}={layer.get(key)} cannot be rebuilt on this target "
                              f"(drafter derives {mine})")
    state = {k: v for k, v in sd.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    state["embed_tokens"], state["lm_head"] = d.embed_tokens, d.lm_head
    if "d2t" not in state:
        state["d2t"], state["t2d"] = d.d2t, d.t2d
    d.load_state_dict(state, strict=True)
    return d.to(sd["fc.weight"].dtype).eval()
