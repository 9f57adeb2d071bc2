"""EAGLE-3 exports, checked: the validator each of export.py's formats runs on a written (or a user's) config +
tensors before loading or serving — headers, aux-layer ids, shapes and vocabulary. Conventions: see export.py and the
package docstring.
"""

from __future__ import annotations

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
from models.export.shared.identity import (
    STAMP_KEY,
    check_vocab_against_target,
    model_type_of,
    stamp_of,
    warn_sglang_family,
)

EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # EAGLE-3.1 flags (speculators 0.9.0), defaults False


def _check_aux_ids(ids: Any, what: str, L: int | None, lo_shift: int, where: str) -> list[int]:
    """ids in an engine convention; lo_shift = how far that convention sits below ours (vLLM 0, SGLang 1)."""
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in ids):
        fail(where, f"{what} must list 3 integer layer ids, got {ids!r} (absent ids make engines fall back to "
                     "their default layers silently)")
    if len(set(ids)) != 3:
        fail(where, f"{what} {ids} repeats a layer")
    if L is not None:
        lo, hi = 1 - lo_shift, L - 1 - lo_shift
        bad = [i for i in ids if not lo <= i <= hi]
        if bad:
            fail(where, f"{what} {ids}: {bad} out of range for a {L}-layer target (capturable {lo}..{hi} in this "
                         "convention; an id at the top is off by one: it names the output of the last layer or "
                         "beyond, which the engine never captures)")
    elif any(i < 1 - lo_shift for i in ids):
        fail(where, f"{what} {ids} has an id below {1 - lo_shift}")
    return ids


def check_eagle3(fmt: str, cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None,
                  where: str) -> tuple[dict, dict]:
    """An ``eagle3_native`` / ``eagle3_speculators`` export's config and tensors, in four steps (each fails with the
    fix): the format's own header fields, the tensor shapes the layer config implies, the aux layer ids of both
    engines, the draft vocabulary and embedding. Returns (expected tensor shapes, target facts)."""
    native = fmt == "eagle3_native"
    layer = _check_native_header(cfg, where) if native else _check_speculators_header(cfg, where)
    if not native:
        _check_speculative_tokens(cfg, side, where)
    exp, (V, Vd, Ht) = _expected_shapes(native, cfg, layer, t, where)
    st = stamp_of(cfg)
    _check_layer_ids(native, cfg, side, target, st, where)
    _check_vocabulary(native, t, st, target, V, Vd, where)
    name = (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") if not native else None
    return exp, {"hidden_size": Ht, "vocab_size": V, "name": name,
                 "rope_theta": layer.get("rope_theta")}


def _check_native_header(cfg: dict, where: str) -> dict:
    """The native format's fields SGLang would misread; returns the layer config (the top level here)."""
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        fail(where, f"architectures must be ['LlamaForCausalLMEagle3'], got {cfg.get('architectures')}")
    if cfg.get("norm_before_residual"):
        fail(where, "norm_before_residual=true in the native format: SGLang's llama_eagle3.py ignores it "
                     "(residual = g) while vLLM honours it, so the two engines would compute different drafts")
    if cfg.get("attention_bias"):
        fail(where, "attention_bias=true in the native format: SGLang's EAGLE-3 qkv_proj has no bias")
    on = [f for f in EAGLE31_FLAGS if cfg.get(f)]
    if on:
        fail(where, f"{'/'.join(on)}=true in the native format: SGLang's llama_eagle3.py ignores the EAGLE-3.1 "
                     "flags, so it would compute another draft; use the speculators format")
    return cfg


def _check_speculators_header(cfg: dict, where: str) -> dict:
    """The speculators format's required fields (vLLM's reader assumes defaults where they are absent); returns
    its ``transformer_layer_config``."""
    if cfg.get("speculators_model_type") != "eagle3":
        fail(where, f"speculators_model_type must be 'eagle3', got {cfg.get('speculators_model_type')!r}")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        fail(where, "config.json needs a transformer_layer_config object")
    if not isinstance(cfg.get("norm_before_residual"), bool):
        fail(where, "norm_before_residual must be written explicitly (vLLM's speculators reader assumes true "
                     "when absent, EAGLE-3's original is false)")
    missing = [f for f in EAGLE31_FLAGS if not isinstance(cfg.get(f), bool)]
    if missing:
        fail(where, f"EAGLE-3.1 flags {missing} must be written explicitly as true/false")
    if cfg.get("norm_before_fc") and cfg.get("fc_norm"):
        fail(where, "norm_before_fc and fc_norm are both true; speculators refuses the pair (mutually exclusive)")
    sc = cfg.get("speculators_config") or {}
    pm = sc.get("proposal_methods") or [{}]
    if sc.get("algorithm") != "eagle3" or "speculative_tokens" not in pm[0]:
        fail(where, "speculators_config needs algorithm 'eagle3' and proposal_methods[0].speculative_tokens")
    if not (sc.get("verifier") or {}).get("name_or_path"):
        fail(where, "speculators_config.verifier.name_or_path is required (vLLM's base.py validation)")
    return layer


def _check_speculative_tokens(cfg: dict, side: dict | None, where: str) -> None:
    """vLLM serves proposal_methods[0].speculative_tokens as K: a positive integer, and (with a sidecar) the K
    draftsmith.json records, the one the README and serving snippets name."""
    k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        fail(where, f"proposal_methods[0].speculative_tokens={k!r}: vLLM drafts that many tokens a round, it must "
                     "be an integer >= 1")
    want = (side or {}).get("num_speculative_tokens")
    if want is not None and k != want:
        fail(where, f"proposal_methods[0].speculative_tokens={k} but draftsmith.json says num_speculative_tokens="
                     f"{want}; export again (--results sets K)")


def _expected_shapes(native: bool, cfg: dict, layer: dict, t: Tensors, where: str
                     ) -> tuple[dict, tuple[int, int, int]]:
    """The one-Llama-layer config's checks, and the shape of every tensor it implies; fc.weight is checked here
    (its error names the 3-state fusion). Returns (name → shape, (target vocab V, draft vocab Vd, target H))."""
    if layer.get("model_type", "llama") != "llama":
        fail(where, f"the draft layer must be model_type 'llama', got {layer.get('model_type')!r}")
    if require(layer, "num_hidden_layers", where) != 1:
        fail(where, f"num_hidden_layers must be 1 (one EAGLE-3 layer), got {layer.get('num_hidden_layers')}")
    if layer.get("tie_word_embeddings", False) is not False:
        fail(where, "tie_word_embeddings must be false (SGLang would use the embedding as the draft lm_head)")
    H = require(layer, "hidden_size", where)
    I_ = require(layer, "intermediate_size", where)
    nh = require(layer, "num_attention_heads", where)
    nkv = layer.get("num_key_value_heads") or nh
    hd = layer.get("head_dim") or H // nh
    V = require(layer, "vocab_size", where)
    Vd = require(cfg, "draft_vocab_size", where)
    Ht = cfg.get("target_hidden_size") or H
    bias = bool(layer.get("attention_bias", False))
    pre = "midlayer." if native else "layers.0."
    exp = {"fc.weight": (H, 3 * Ht), f"{pre}self_attn.q_proj.weight": (nh * hd, 2 * H),
           f"{pre}self_attn.k_proj.weight": (nkv * hd, 2 * H), f"{pre}self_attn.v_proj.weight": (nkv * hd, 2 * H),
           f"{pre}self_attn.o_proj.weight": (H, nh * hd), f"{pre}mlp.gate_proj.weight": (I_, H),
           f"{pre}mlp.up_proj.weight": (I_, H), f"{pre}mlp.down_proj.weight": (H, I_),
           f"{pre}hidden_norm.weight": (H,), f"{pre}input_layernorm.weight": (H,),
           f"{pre}post_attention_layernorm.weight": (H,), "norm.weight": (H,), "lm_head.weight": (Vd, H),
           "d2t": (Vd,), "t2d": (V,)}
    if not native:
        exp["embed_tokens.weight"] = (V, H)  # see build_eagle3_speculators: speculators needs it in the file
        if cfg.get("norm_before_fc"):
            exp["input_norm.weight"] = (3 * Ht,)  # speculators Eagle3DraftModel.input_norm
        if cfg.get("fc_norm"):
            exp.update({f"fc_norm.{i}.weight": (Ht,) for i in range(3)})  # speculators Eagle3DraftModel.fc_norm
    if bias:
        exp.update({f"{pre}self_attn.q_proj.bias": (nh * hd,), f"{pre}self_attn.k_proj.bias": (nkv * hd,),
                    f"{pre}self_attn.v_proj.bias": (nkv * hd,), f"{pre}self_attn.o_proj.bias": (H,)})
    if "fc.weight" in t.shapes and tuple(t.shapes["fc.weight"]) != exp["fc.weight"]:
        fail(where, f"fc.weight has shape {list(t.shapes['fc.weight'])}, expected {list(exp['fc.weight'])} "
                     f"[hidden_size, 3 x target_hidden_size]: it must fuse exactly 3 target states of size {Ht}")
    return exp, (V, Vd, Ht)


def _check_layer_ids(native: bool, cfg: dict, side: dict | None, target: TargetInfo | None, st: dict,
                     where: str) -> None:
    """vLLM's top-level ids (and SGLang's, native only) against each other, the target, the stamp fc.weight was
    exported with and the sidecar; the sidecar's training flags against config.json."""
    L = target_num_layers(target, side) or st.get("num_hidden_layers")
    top = _check_aux_ids(cfg.get("eagle_aux_hidden_state_layer_ids"),
                         "top-level eagle_aux_hidden_state_layer_ids (vLLM: input of decoder layer i)", L, 0, where)
    if top != sorted(top):
        # vLLM sorts the capture layers and SGLang captures in layer order: fc's blocks are fed ascending ids.
        fail(where, f"eagle_aux_hidden_state_layer_ids {top} are not ascending: both engines fuse the states in "
                     "ascending layer order, so fc.weight would read them permuted; re-export with draftsmith "
                     "(it sorts the ids and permutes fc.weight's column blocks)")
    if native:
        sg = _check_aux_ids((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
                            "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: output of decoder layer i)",
                            L, 1, where)
        if sg != [i - 1 for i in top]:
            fail(where, f"eagle_config ids {sg} (SGLang, output of layer i) must be the top-level ids {top} "
                         f"(vLLM, input of layer i) minus 1, i.e. {[i - 1 for i in top]}; one of them is off by one")
        warn_sglang_family(sg, top, model_type_of(target, st), where)
    if st.get("layer_ids") is not None and list(st["layer_ids"]) != top:
        # ids shifted consistently in every field still disagree with the ids recorded with the weights
        fail(where, f"eagle_aux_hidden_state_layer_ids {top} differ from the ids fc.weight was exported with "
                     f"({STAMP_KEY}.layer_ids {st['layer_ids']}): converted to another convention twice?")
    if side is not None and side.get("layer_ids") is not None and list(side["layer_ids"]) != top:
        fail(where, f"draftsmith.json layer ids {side['layer_ids']} (HF output_hidden_states index) differ from "
                     f"the vLLM ids {top}, which use the same convention")
    if side is not None:
        for flag in ("norm_before_residual", *EAGLE31_FLAGS):
            was = (side.get("draft") or {}).get(flag)
            if was is not None and bool(was) != bool(cfg.get(flag, False)):
                fail(where, f"{flag}={cfg.get(flag)} in config.json but the drafter was trained with {was}")


def _check_vocabulary(native: bool, t: Tensors, st: dict, target: TargetInfo | None, V: int, Vd: int,
                      where: str) -> None:
    """d2t/t2d (dtypes, sizes, a valid mapping, the target's vocabulary), lm_head's rows, and (speculators) that
    the embedded embedding is this target's."""
    # the vocabulary mapping (SpecForge #534: misaligned after fine-tuning, no error at load time)
    for name, dt in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name in t.dtypes and t.dtypes[name] != dt:
            fail(where, f"{name} must be {str(dt).removeprefix('torch.')}, got {str(t.dtypes[name])}")
    if "d2t" in t.shapes and "t2d" in t.shapes:
        if t.shapes["d2t"] != (Vd,) or t.shapes["t2d"] != (V,):
            fail(where, f"d2t {list(t.shapes['d2t'])} / t2d {list(t.shapes['t2d'])} must be [draft_vocab_size="
                         f"{Vd}] / [vocab_size={V}]")
        if target is not None and target.vocab_size and t.shapes["t2d"][0] != int(target.vocab_size):
            fail(where, f"d2t/t2d were built for a vocabulary of {t.shapes['t2d'][0]} tokens, the target has "
                         f"{target.vocab_size}: rebuild the draft vocabulary for this target and retrain")
        try:
            check_mapping(t.get("d2t"), t.get("t2d"))
        except ValueError as e:
            fail(where, f"d2t/t2d rejected: {e}")
        check_vocab_against_target(t.get("d2t"), st, target, where)
    if "lm_head.weight" in t.shapes and t.shapes["lm_head.weight"][0] != Vd:
        fail(where, f"lm_head.weight has {t.shapes['lm_head.weight'][0]} rows but d2t/draft_vocab_size say {Vd}")
    if not native and "embed_tokens.weight" in t.shapes and target is not None and target.frozen is not None:
        emb = t.get("embed_tokens.weight")
        ref = target.frozen.embed.weight.detach()
        if tuple(emb.shape) == tuple(ref.shape) and not torch.equal(emb, ref.to(emb.dtype)):
            fail(where, "exported for another target: embed_tokens.weight is not this target's embedding "
                         "(speculators runs the draft on the file's copy)")
