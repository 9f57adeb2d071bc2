"""MTP: build, check and load back the ``mtp_deepseek`` (vLLM) and ``mtp_sglang_nextn`` (SGLang) formats,
including the split of HF-5 fused expert tensors into the per-expert checkpoint layout and back.
"""

from __future__ import annotations

import importlib
import json
import re
from functools import partial
from pathlib import Path

import torch
from torch import nn

from models.core.spec import ExportFormat
from models.core.target import FrozenTarget, embed_fingerprint, resolve_name
from models.export.shared.common import (
    CONFIG,
    DTYPE_NAMES,
    Bundle,
    ExportError,
    TargetInfo,
    Tensors,
    architectures,
    fail,
    make_sidecar,
    require,
)
from models.export.shared.identity import STAMP_KEY, stamp_of, target_stamp
from models.export.shared.snippets import Serve, sglang_chain_section, vllm_section
from models.methods.mtp.config import MTPConfig, decoder_config
from models.methods.mtp.native import init_from_native, to_native_state_dict
from models.methods.mtp.net import MTPDrafter, MTPModule

# The only model family whose HF-5 fused expert tensors we split back into the per-expert checkpoint layout:
# transformers' conversion_mapping.py maps deepseek_v3 to the qwen2_moe rule (experts.*.gate_proj/up_proj →
# MergeModulelist(dim=0) + Concatenate(dim=1) = experts.gate_up_proj; experts.*.down_proj → experts.down_proj).
_UNFUSE_OK = ("deepseek_v3",)


# ============================================================================================ expert layout
_FUSED = re.compile(r"^(?P<pre>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<pre>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def unfuse_experts(sd: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """HF-5 fused experts → the per-expert names of DeepSeek checkpoints (what SGLang/vLLM's
    ``make_expert_params_mapping`` expect: mlp.experts.{e}.{gate,up,down}_proj.weight)."""
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        m = _FUSED.match(k)
        if m is None:
            out[k] = t
            continue
        if model_type not in _UNFUSE_OK or t.dim() != 3:
            raise ExportError(f"{k}: fused expert tensor of model_type {model_type!r}; its per-expert checkpoint "
                              f"layout is only verified for {_UNFUSE_OK}")
        pre = m["pre"]
        if m["kind"] == "gate_up_proj":  # [E, 2I, H]: rows [:I] gate, [I:] up (DeepseekV3Experts.forward chunk)
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.gate_proj.weight"] = t[e, :i].clone()
                out[f"{pre}.{e}.up_proj.weight"] = t[e, i:].clone()
        else:  # [E, H, I]
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = t[e].clone()
    return out


def fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``unfuse_experts``."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        m = _PER_EXPERT.match(k)
        if m is None:
            out[k] = t
        else:
            groups.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
    for pre, g in groups.items():
        E = len(g.get("down_proj", {}))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if sorted(g.get(proj, {})) != list(range(E)):
                raise ExportError(f"{pre}: experts 0..{E - 1} need gate/up/down_proj each; "
                                  f"{proj} has {sorted(g.get(proj, {}))[:8]}")
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g["gate_proj"][e], g["up_proj"][e]], 0)
                                                  for e in range(E)])
        out[f"{pre}.down_proj"] = torch.stack([g["down_proj"][e] for e in range(E)])
    return out


# ============================================================================================ build
def _stamp(d: nn.Module, target: FrozenTarget) -> dict:
    # which hidden state depth >= 2 was trained on: vLLM/SGLang feed shared_head.norm(h) ("post_norm")
    return target_stamp(target, mtp_hidden_between_depths=d.cfg.hidden_between_depths)


def _target_config_dict(target: FrozenTarget) -> dict:
    """The target's own config.json when it is local (exactly what engines already parse), else to_dict()."""
    c = target.model.config
    p = Path(resolve_name(getattr(c, "_name_or_path", "") or "")) / CONFIG
    if p.is_file():
        return json.loads(p.read_text())
    return c.to_dict()


def _mtp_native(d: nn.Module, target: FrozenTarget) -> tuple[dict, str]:
    tc = target.model.config
    over = {k: getattr(d.cfg, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")}
    differ = {k: v for k, v in over.items() if v is not None and v != getattr(tc, k, None)}
    if differ:
        # Engines build the MTP block from the target's config; a block of another shape has no config to say so.
        raise ExportError(f"MTP block overrides {differ} differ from the target's config; native MTP layouts "
                          "assume the target's block shape (retrain without the overrides)")
    mt = getattr(tc, "model_type", "")
    return unfuse_experts(to_native_state_dict(d, include_shared=True), mt), mt


def build_mtp_deepseek(d: nn.Module, target: FrozenTarget, name: str,
                       num_speculative_tokens: int, meta: dict | None) -> Bundle:
    sd, _ = _mtp_native(d, target)
    D = d.cfg.num_modules
    # vllm/model_executor/models/deepseek_mtp.py: layers num_hidden_layers..+num_nextn_predict_layers-1, each with
    # enorm/hnorm/eh_proj/shared_head.{norm,head} and its own embed_tokens copy (only the first is loaded).
    cfg = {**_target_config_dict(target), "num_nextn_predict_layers": D,
           "torch_dtype": DTYPE_NAMES.get(d._dtype(), "float32"), STAMP_KEY: _stamp(d, target)}
    side = make_sidecar("mtp_deepseek", d, target, name, num_speculative_tokens, meta)
    return Bundle("mtp_deepseek", cfg, sd, side)


def build_mtp_sglang_nextn(d: nn.Module, target: FrozenTarget, name: str,
                           num_speculative_tokens: int, meta: dict | None) -> Bundle:
    tc = target.model.config
    mt = getattr(tc, "model_type", "")
    if mt != "deepseek_v3":
        # sglang/srt/models/deepseek_nextn.py builds a DeepseekV2DecoderLayer (MLA attention + MoE): a block of
        # another family (Llama q/k/v/o + SwiGLU) has no parameters to land in there.
        raise ExportError(f"the SGLang NextN format runs a DeepSeek-V3 block (DeepseekV2DecoderLayer, MLA + MoE); "
                          f"this drafter's block is the {mt or type(d.mtp[0].block).__name__} target's own, which "
                          "it cannot represent: use --format mtp (DeepSeek layout) and see its README")
    if d.cfg.num_modules != 1:
        # deepseek_nextn.py load_weights: assert num_nextn_predict_layers == 1
        raise ExportError(f"SGLang NextN loads exactly 1 MTP module, this drafter has {d.cfg.num_modules}; "
                          "use --format mtp or retrain with num_modules=1")
    if not any(".mlp.experts." in n for n, _ in d.mtp[0].block.named_parameters(prefix="x")):
        # deepseek_nextn.py constructs the layer with is_nextn=True, which is always an MoE layer
        raise ExportError("SGLang NextN always builds an MoE block; this drafter's block is dense "
                          "(first_k_dense_replace > num_hidden_layers?)")
    sd, _ = _mtp_native(d, target)
    L = target.num_layers
    # sglang scripts/export_deepseek_nextn.py: model.layers.{L} → model.layers.0, embed_tokens and
    # shared_head.head dropped (deepseek_nextn.py load_weights takes both from the target).
    src, dst = f"model.layers.{L}.", "model.layers.0."
    tensors = {dst + kk.removeprefix(src): v for kk, v in sd.items()
               if not kk.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    # export_deepseek_nextn.py update_and_save_config: num_hidden_layers 1, DeepseekV3ForCausalLMNextN.
    cfg = {**_target_config_dict(target), "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"],
           "num_nextn_predict_layers": 1, "torch_dtype": DTYPE_NAMES.get(d._dtype(), "float32"),
           STAMP_KEY: _stamp(d, target)}
    side = make_sidecar("mtp_sglang_nextn", d, target, name, num_speculative_tokens, meta)
    return Bundle("mtp_sglang_nextn", cfg, tensors, side)


# ============================================================================================ check
def _decoder_layer_class(cfg: dict) -> type[nn.Module]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = cfg.get("model_type")
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt)
    if arch is None:
        raise ExportError(f"model_type {mt!r} is not a transformers causal LM; cannot derive its decoder block")
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    cls = getattr(mod, arch.replace("ForCausalLM", "DecoderLayer"), None)
    if cls is None:
        raise ExportError(f"transformers has no {arch.replace('ForCausalLM', 'DecoderLayer')} for {mt!r}")
    return cls


def _mtp_expected_layer(cfg: dict, layer_idx: int, target: TargetInfo | None, where: str) -> dict[str, tuple]:
    """Native names/shapes of one MTP layer (own tensors + the family's decoder block), built on the meta device
    from the config, so a 671B target costs nothing."""
    from transformers import AutoConfig

    if target is not None and target.frozen is not None and \
            getattr(target.frozen.model.config, "model_type", None) == cfg.get("model_type"):
        tcfg, cls = target.frozen.model.config, type(target.frozen.layers[0])
    else:
        try:
            tcfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
        except Exception as e:  # noqa: BLE001
            raise ExportError(f"{where}: config.json does not build a {cfg.get('model_type')!r} config ({e})") from None
        cls = _decoder_layer_class(cfg)
    # layer_types families index their attention types by layer: extend them up to this MTP layer
    dc = decoder_config(MTPConfig(num_modules=max(1, layer_idx - int(tcfg.num_hidden_layers) + 1)), tcfg)
    with torch.device("meta"):
        module = MTPModule(dc, layer_idx, cls)
    sd = {k.removeprefix("block."): v for k, v in module.state_dict().items()}
    sd = unfuse_experts(sd, getattr(tcfg, "model_type", cfg.get("model_type", "")))
    return {k: tuple(v.shape) for k, v in sd.items()}


def check_mtp(fmt: str, cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None,
               where: str) -> tuple[dict, dict]:
    H, V = require(cfg, "hidden_size", where), require(cfg, "vocab_size", where)
    exp: dict[str, tuple] = {}
    if fmt == "mtp_deepseek":
        L, D = require(cfg, "num_hidden_layers", where), require(cfg, "num_nextn_predict_layers", where)
        if target is not None and target.num_hidden_layers and target.num_hidden_layers != L:
            fail(where, f"config.json says the target has {L} layers (MTP layers {L}..{L + D - 1}) but the target "
                         f"has {target.num_hidden_layers}: the MTP layer indices would be off")
        present = sorted({int(m.group(1)) for k in t.shapes if (m := re.match(r"^model\.layers\.(\d+)\.", k))})
        if present and present != list(range(L, L + D)):
            fail(where, f"MTP tensors sit at layers {present[:6]}, expected model.layers.{L}..{L + D - 1} "
                         f"(num_hidden_layers={L}, num_nextn_predict_layers={D}): off by one?")
        for d in range(D):
            for k, s in _mtp_expected_layer(cfg, L + d, target, where).items():
                exp[f"model.layers.{L + d}.{k}"] = s
            exp[f"model.layers.{L + d}.embed_tokens.weight"] = (V, H)
            exp[f"model.layers.{L + d}.shared_head.head.weight"] = (V, H)
    else:
        if cfg.get("architectures") != ["DeepseekV3ForCausalLMNextN"] or cfg.get("model_type") != "deepseek_v3":
            fail(where, f"SGLang NextN needs architectures ['DeepseekV3ForCausalLMNextN'] and model_type "
                         f"deepseek_v3, got {cfg.get('architectures')} / {cfg.get('model_type')!r}")
        if cfg.get("num_hidden_layers") != 1 or cfg.get("num_nextn_predict_layers") != 1:
            fail(where, "SGLang NextN needs num_hidden_layers == num_nextn_predict_layers == 1 "
                         "(deepseek_nextn.py load_weights asserts it)")
        # is_nextn=True makes SGLang's layer MoE: derive the block at an MoE index (>= first_k_dense_replace).
        moe_idx = int(cfg.get("first_k_dense_replace") or 0)
        for k, s in _mtp_expected_layer(cfg, moe_idx, target, where).items():
            exp[f"model.layers.0.{k}"] = s
    return exp, {"hidden_size": H, "vocab_size": V, "name": None, "model_type": cfg.get("model_type")}


# ============================================================================================ load back
def load_mtp(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    L = target.num_layers
    if fmt == "mtp_sglang_nextn":
        D = 1
        sd = {(f"model.layers.{L}." + k.removeprefix("model.layers.0.")): v for k, v in sd.items()}
    else:
        D = cfg["num_nextn_predict_layers"]
    drafter = MTPDrafter.from_target(MTPConfig(num_modules=D), target)
    if any(_FUSED.match(k) for k in drafter.state_dict()):
        sd = fuse_experts(sd)
    dtype = next(v.dtype for v in sd.values() if v.is_floating_point())
    drafter.to(dtype)
    try:
        init_from_native(drafter, sd)
    except ValueError as e:
        raise ExportError(f"cannot load the MTP weights into this target's block: {e}") from None
    return drafter.eval()


def verify_embeddings(t: Tensors, target: TargetInfo, where: str) -> bool:
    """The DeepSeek layout carries the target's embedding (one copy per MTP layer): it must be this target's."""
    verified = False
    for k in t.shapes:
        if k.endswith("embed_tokens.weight"):
            if embed_fingerprint(t.get(k)) != target.fingerprint:
                fail(where, f"exported for another target: {k} is not this target's embedding")
            verified = True
    return verified


# ============================================================================================ README
def _between_note(cfg: dict) -> list[str]:
    between = stamp_of(cfg).get("mtp_hidden_between_depths")
    return [f"Depth >= 2 (and a module reused past its depth) was trained on the `{between}` hidden state of the "
            "previous depth; vLLM and SGLang feed the post-norm one (shared_head.norm)"
            + ("." if between == "post_norm" else ", so served acceptance at depth >= 2 differs from eval's."), ""]


def readme_mtp_deepseek(cfg: dict, side: dict, s: Serve) -> list[str]:
    """vLLM serves the layout for a DeepSeek-V3 target (deepseek_mtp is an alias of its mtp method,
    vllm/config/speculative.py); for another family's block no engine does, and the README says why."""
    if cfg.get("model_type") == "deepseek_v3":
        return [*_between_note(cfg), "For SGLang export --format mtp-nextn (one module, layer renumbered to 0).", "",
                *vllm_section(s, s.speculative_config("mtp"))]
    return [*_between_note(cfg), "## No engine serves this block as-is", "",
            f"The layout is DeepSeek-V3's (`model.layers.{{L+d}}.{{enorm,hnorm,eh_proj,shared_head.*,...}}`)"
            f", but the block is the `{cfg.get('model_type')}` target's own decoder layer. vLLM's "
            "deepseek_mtp.py and SGLang's deepseek_nextn.py build a DeepseekV2DecoderLayer (MLA + MoE), "
            "so they cannot load it. An engine would need an MTP model class for this family: "
            "enorm/hnorm RMSNorms, eh_proj Linear(2H→H) over cat(enorm(emb), hnorm(h)), the family's "
            "decoder layer, shared_head.norm and the target's lm_head, fed the target's final (post-norm) "
            "hidden state. draftsmith's eval and `models.export.load_export` run it today.", ""]


def readme_mtp_sglang_nextn(cfg: dict, side: dict, s: Serve) -> list[str]:
    return [*_between_note(cfg), *sglang_chain_section(s, "NEXTN")]


# the engine formats this method's drafters export to (SPEC.export_formats; detect() is tried in this order)
FORMATS = (
    ExportFormat("mtp_sglang_nextn", "mtp-nextn", "mtp", "SGLang (NEXTN) for DeepSeek-V3 targets",
                 build_mtp_sglang_nextn, partial(check_mtp, "mtp_sglang_nextn"),
                 partial(load_mtp, "mtp_sglang_nextn"),
                 lambda cfg, _p: "DeepseekV3ForCausalLMNextN" in architectures(cfg), readme=readme_mtp_sglang_nextn),
    ExportFormat("mtp_deepseek", "mtp", "mtp", "vLLM (mtp) for DeepSeek-V3 targets",
                 build_mtp_deepseek, partial(check_mtp, "mtp_deepseek"), partial(load_mtp, "mtp_deepseek"),
                 lambda cfg, _p: bool(cfg.get("num_nextn_predict_layers")), readme=readme_mtp_deepseek,
                 verify_target=verify_embeddings, vllm_method="mtp"),
)
