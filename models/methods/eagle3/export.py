"""EAGLE-3: build and load back the ``eagle3_native`` (SGLang + vLLM) and ``eagle3_speculators`` (vLLM) formats
(check.py checks them). Aux-layer-id conventions: see the package docstring.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn

from models.core.spec import ExportFormat
from models.core.target import FrozenTarget
from models.export.shared.common import (
    DTYPE_NAMES,
    Bundle,
    ExportError,
    architectures,
    engine_target_name,
    make_sidecar,
)
from models.export.shared.identity import (
    SGLANG_PLUS1_IF_FIRST_IS_1,
    STAMP_KEY,
    sglang_reads,
    stamp_of,
    target_stamp,
    vocab_hash,
)
from models.export.shared.snippets import SGLANG_CHECKED, Serve, sglang_chain_section, vllm_section
from models.methods.eagle3.check import EAGLE31_FLAGS, check_eagle3
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.net import Eagle3Drafter


# ============================================================================================ build
def _eagle3_decoder_fields(d: nn.Module, target: FrozenTarget) -> dict:
    """Decoder shape fields of the one-layer Llama config both engines build the EAGLE-3 layer from."""
    tc = target.model.config
    rope = copy.deepcopy(d.rope_parameters)
    rope_type = rope.get("rope_type", "default")
    # rope_scaling: what vLLM/SGLang's Llama attention reads (null = plain RoPE); rope_parameters: transformers 5.
    scaling = None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads, "num_key_value_heads": d.num_key_value_heads,
        # head_dim written explicitly: both engines' LlamaAttention fall back to hidden/heads when absent.
        "head_dim": d.head_dim, "rms_norm_eps": d.rms_norm_eps, "hidden_act": d.hidden_act,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 2048)),
        "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling, "rope_parameters": rope,
        "attention_bias": bool(d.attention_bias), "mlp_bias": False,
        # Target vocab: vLLM scatters draft logits into a vocab_size-wide row (llama_eagle3.py compute_logits).
        "vocab_size": d.vocab_size, "num_hidden_layers": 1, "model_type": "llama",
        # tie_word_embeddings must be false: SGLang's LlamaForCausalLMEagle3 would otherwise make lm_head the
        # embedding (sglang/srt/models/llama_eagle3.py __init__).
        "tie_word_embeddings": False, "torch_dtype": DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
    }


def _engine_aux_ids(d: nn.Module, target: FrozenTarget) -> tuple[list[int], list[int]]:
    """(vLLM ids, SGLang ids) for the drafter's layer ids, in ASCENDING order; refuse ids no engine can capture.

    Both engines fuse the three captured states in ascending layer order whatever order the config lists them in
    (vLLM sorts the capture layers; SGLang appends them as the layer loop reaches them), so the ids are written
    sorted and ``fc.weight``'s column blocks are permuted to match (``_engine_order``).
    """
    L = target.num_layers
    ours = list(d.layer_ids)
    bad = [k for k in ours if not 1 <= k <= L - 1]
    if bad:
        # Both engines capture inside the decoder-layer loop: id L (after the final norm) is never reached, and
        # vLLM's capture at layer 0 adds a residual that is still None there (llama.py LlamaModel.forward).
        raise ExportError(f"EAGLE-3 layer ids {bad} cannot be served: engines capture the input of decoder layers "
                          f"1..{L - 1} of this {L}-layer target (our ids 1..{L - 1}); retrain with other layer_ids")
    ours = sorted(ours)
    return ours, [k - 1 for k in ours]


def _engine_order(d: nn.Module) -> list[int]:
    """perm such that engine block j (ascending ids) is the drafter's block perm[j] (its layer_ids order)."""
    ids = list(d.layer_ids)
    return sorted(range(len(ids)), key=lambda j: ids[j])


def _permute_blocks(w: torch.Tensor, perm: list[int], dim: int) -> torch.Tensor:
    """Reorder the len(perm) equal blocks of ``w`` along ``dim``: block j of the result = block perm[j]."""
    blocks = w.chunk(len(perm), dim=dim)
    return torch.cat([blocks[p] for p in perm], dim=dim)


def _eagle3_tensors(d: nn.Module, prefix: str, with_embedding: bool = False) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the export names, in engine (ascending layer id) order."""
    out = {}
    for k, v in d.state_dict().items():
        if k == "embed_tokens.weight" and not with_embedding:
            continue  # frozen copy of the target's; both engines share the target's embedding when absent
        out[prefix + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k] = v.detach().clone()
    perm = _engine_order(d)
    if perm != sorted(perm):
        # fc reads cat(h_{id0}, h_{id1}, h_{id2}) in the drafter's order; engines feed it ascending ids.
        out["fc.weight"] = _permute_blocks(out["fc.weight"], perm, dim=1)
        if "input_norm.weight" in out:  # norm_before_fc: one RMSNorm over the same 3H concatenation
            out["input_norm.weight"] = _permute_blocks(out["input_norm.weight"], perm, dim=0)
        if "fc_norm.0.weight" in out:  # fc_norm: one RMSNorm per state, so the modules move with their blocks
            moved = [out[f"fc_norm.{p}.weight"] for p in perm]
            out.update({f"fc_norm.{j}.weight": w for j, w in enumerate(moved)})
    return out


def _engine_sidecar(side: dict, ids: list[int], d: nn.Module) -> dict:
    """The sidecar describes the exported (engine-order) drafter; the trained order is kept for the record."""
    side["trained_layer_ids"] = list(d.layer_ids)
    side["layer_ids"] = list(ids)
    side["draft"]["layer_ids"] = list(ids)
    return side


def build_eagle3_native(d: nn.Module, target: FrozenTarget, name: str,
                        num_speculative_tokens: int, meta: dict | None) -> Bundle:
    if d.cfg.norm_before_residual:
        # SGLang's LlamaDecoderLayer (llama_eagle3.py) always uses residual = g; only vLLM reads the flag.
        raise ExportError("norm_before_residual=True cannot be expressed in the native EAGLE-3 format (SGLang's "
                          "llama_eagle3.py ignores it and would use residual = g); export --format "
                          "eagle3-speculators for vLLM instead")
    on = [f for f in EAGLE31_FLAGS if getattr(d.cfg, f)]
    if on:
        # SGLang's llama_eagle3.py has no input_norm / fc_norm modules and feeds the next step the raw output.
        raise ExportError(f"{'/'.join(on)}=True (EAGLE-3.1) cannot be expressed in the native EAGLE-3 format "
                          "(SGLang's llama_eagle3.py ignores it); export --format eagle3-speculators instead")
    if d.attention_bias:
        # SGLang builds qkv_proj with bias=False and skips unknown tensors silently (llama_eagle3.py load_weights).
        raise ExportError("attention_bias=True cannot be loaded by SGLang's native EAGLE-3 layer (qkv bias is "
                          "fixed to False there); export --format eagle3-speculators for vLLM instead")
    vllm_ids, sglang_ids = _engine_aux_ids(d, target)
    cfg = {
        # vLLM keeps an architecture ending in "Eagle3" (vllm/transformers_utils/configs/eagle.py) and maps it to
        # llama_eagle3.Eagle3LlamaForCausalLM; SGLang's EntryClass is LlamaForCausalLMEagle3.
        "architectures": ["LlamaForCausalLMEagle3"],
        **_eagle3_decoder_fields(d, target),
        "draft_vocab_size": d.draft_vocab_size,  # lm_head rows: both engines (llama_eagle3.py)
        "target_hidden_size": d.target_hidden_size,  # fc in = 3 * this (vLLM + SGLang llama_eagle3.py)
        # vLLM reads getattr(config, "norm_before_residual", False) (vllm llama_eagle3.py); explicit anyway, and
        # the EAGLE-3.1 flags too (all false: refused above when set).
        "norm_before_residual": False, **{f: False for f in EAGLE31_FLAGS},
        # vLLM: vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config reads this top-level list
        # first and uses it unchanged as "capture before layer idx" (= our ids).
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        # SGLang: model_runner.py reads eagle_config["eagle_aux_hidden_state_layer_ids"] and llama.py
        # set_eagle3_layers_to_capture adds 1 ("output of layer i" = our id - 1).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
        STAMP_KEY: target_stamp(target, layer_ids=vllm_ids, draft_vocab=vocab_hash(d.d2t)),
    }
    tensors = _eagle3_tensors(d, "midlayer.")
    side = _engine_sidecar(make_sidecar("eagle3_native", d, target, name, num_speculative_tokens, meta), vllm_ids, d)
    return Bundle("eagle3_native", cfg, tensors, side)


def build_eagle3_speculators(d: nn.Module, target: FrozenTarget, name: str,
                             num_speculative_tokens: int, meta: dict | None) -> Bundle:
    vllm_ids, _ = _engine_aux_ids(d, target)
    layer = _eagle3_decoder_fields(d, target)
    layer.pop("torch_dtype")
    cfg = {
        # vllm-project/speculators src/speculators/models/eagle3/config.py Eagle3SpeculatorConfig
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        # vLLM builds the draft's PretrainedConfig from this dict (vllm/transformers_utils/configs/speculators/
        # base.py extract_transformers_pre_trained_config); model_type llama → Eagle3LlamaForCausalLM (algos.py).
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            # vLLM takes num_speculative_tokens from proposal_methods[0].speculative_tokens (base.py).
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": engine_target_name(name),
                         "architectures": list(getattr(target.model.config, "architectures", None) or [])},
        },
        "draft_vocab_size": d.draft_vocab_size,  # algos.py update_eagle3
        "target_hidden_size": d.target_hidden_size,  # algos.py update_eagle3
        # algos.py update_eagle3: config_dict.get("norm_before_residual", True) — absent means TRUE there, while
        # our default (and EAGLE-3's) is residual = g: always written, matching the trained drafter.
        "norm_before_residual": bool(d.cfg.norm_before_residual),
        # EAGLE-3.1 flags, read by speculators 0.9.0 (models/eagle3/config.py): every one written explicitly.
        **{f: bool(getattr(d.cfg, f)) for f in EAGLE31_FLAGS},
        # algos.py copies it to the vLLM config unchanged → same convention as the native top-level list.
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        "torch_dtype": DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
        STAMP_KEY: target_stamp(target, layer_ids=vllm_ids, draft_vocab=vocab_hash(d.d2t)),
    }
    # vLLM's llama_eagle3.py load_weights maps "midlayer." to "layers.0."; speculators checkpoints use the latter.
    # embed_tokens.weight is written here (not in the native format): speculators' own save_pretrained always
    # writes it, and when it is absent speculators 0.9.0 under transformers 5 keeps the embedding it initialised
    # (its verifier-copy fallback never fires) — the draft then runs on a wrong embedding without a word. vLLM
    # drops it when it equals the target's (llama_eagle3.py load_weights), SGLang always takes the target's.
    tensors = _eagle3_tensors(d, "layers.0.", with_embedding=True)
    side = _engine_sidecar(make_sidecar("eagle3_speculators", d, target, name, num_speculative_tokens, meta),
                           vllm_ids, d)
    return Bundle("eagle3_speculators", cfg, tensors, side)


# ============================================================================================ load back
def load_eagle3(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    layer = cfg if fmt == "eagle3_native" else cfg["transformer_layer_config"]
    tc = target.model.config
    # only pass overrides that differ from the target, so Eagle3Drafter derives head_dim as it did in training
    over = {k: (layer[k] if layer.get(k) != getattr(tc, k, None) else None)
            for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")}
    ec = Eagle3Config(layer_ids=list(cfg["eagle_aux_hidden_state_layer_ids"]), draft_vocab_size=cfg["draft_vocab_size"],
                      norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                      **{f: bool(cfg.get(f, False)) for f in EAGLE31_FLAGS}, head_dim=layer.get("head_dim"), **over)
    d = Eagle3Drafter(ec, tc, target.embed.weight.detach().clone(), sd["d2t"], sd["t2d"])
    if d.head_dim != layer.get("head_dim", d.head_dim):
        raise ExportError(f"export head_dim {layer.get('head_dim')} cannot be rebuilt on this target "
                          f"(drafter derives {d.head_dim})")
    pre = "midlayer." if fmt == "eagle3_native" else "layers.0."
    state = {("midlayer." + k.removeprefix(pre)) if k.startswith(pre) else k: v for k, v in sd.items()}
    state["embed_tokens.weight"] = d.embed_tokens.weight
    d.load_state_dict(state, strict=True)
    return d.to(sd["fc.weight"].dtype).eval()  # Module.to(dtype) leaves the int/bool d2t/t2d alone


# ============================================================================================ README
def readme_eagle3(fmt: str, cfg: dict, side: dict, s: Serve) -> list[str]:
    """The layer ids in the three conventions, the EAGLE-3.1 caveat, SGLang's per-family +1 rule (native) and the
    serve commands: vLLM for both formats, SGLang for the native one."""
    native, ours = fmt == "eagle3_native", side["layer_ids"]
    lines = ["## Aux hidden-state layer ids (same tensors, three conventions)", "",
             f"- draftsmith (index into HF `output_hidden_states`): {ours}",
             f"- vLLM top-level `eagle_aux_hidden_state_layer_ids` (capture before decoder layer i): {ours}",
             f"- SGLang `eagle_config.eagle_aux_hidden_state_layer_ids` (output of decoder layer i): "
             f"{[i - 1 for i in ours]}" + ("" if native else " (not written: vLLM only)"), ""]
    on = [f for f in EAGLE31_FLAGS if cfg.get(f)]
    if on:
        lines += [f"EAGLE-3.1 flags {on} are set: speculators 0.9.0 reads them (tested); draftsmith has not "
                  "checked which vLLM release honours them, so compare served acceptance with `python -m eval`.", ""]
    if native:
        lines += [_sglang_rule(cfg, ours), ""]
    lines += vllm_section(s, s.speculative_config("eagle3"))
    return lines + (sglang_chain_section(s, "EAGLE3") if native else [])


def _sglang_rule(cfg: dict, ours: list[int]) -> str:
    """Whether SGLang adds 1 to the ids it reads for this target's family, and so captures the right layers."""
    mt = stamp_of(cfg).get("model_type")
    if mt not in SGLANG_PLUS1_IF_FIRST_IS_1:
        return (f"For this `{mt or 'llama'}` target {SGLANG_CHECKED} adds 1 to every SGLang id "
                "(llama.py `set_eagle3_layers_to_capture`), giving back the draftsmith ids above.")
    got = sglang_reads([i - 1 for i in ours], mt)
    rule = f"For this `{mt}` target {SGLANG_CHECKED} adds 1 to the SGLang ids only when the first one is 1 (PR #25454)"
    return rule + (": here it does, so it captures the right layers." if got == ours else
                   f": here it does not, so SGLang would capture {got} instead of {ours}. Serve with vLLM, "
                   "or retrain with layer ids starting at 2 (the default).")


# the engine formats this method's drafters export to (SPEC.export_formats; detect() is tried in this order)
FORMATS = (
    ExportFormat("eagle3_native", "eagle3", "eagle3", "SGLang (EAGLE3), vLLM (eagle3)",
                 build_eagle3_native, partial(check_eagle3, "eagle3_native"), partial(load_eagle3, "eagle3_native"),
                 lambda cfg, _p: "LlamaForCausalLMEagle3" in architectures(cfg),
                 readme=partial(readme_eagle3, "eagle3_native"), vllm_method="eagle3",
                 llamacpp="draft-eagle3"),
    ExportFormat("eagle3_speculators", "eagle3-speculators", "eagle3", "vLLM (speculators format)",
                 build_eagle3_speculators, partial(check_eagle3, "eagle3_speculators"),
                 partial(load_eagle3, "eagle3_speculators"),
                 lambda cfg, _p: "Eagle3Speculator" in architectures(cfg)
                                 or cfg.get("speculators_model_type") == "eagle3",
                 readme=partial(readme_eagle3, "eagle3_speculators"), vllm_method="eagle3",
                 llamacpp="draft-eagle3"),
)
