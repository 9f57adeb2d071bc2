"""Export trained drafters in the formats serving engines load, validate any such directory, load it back.

One writer per format (each writes a directory), one validator for all of them (run on the in-memory export
*before* anything is written, and available on any directory), one loader back into draftsmith's modules:

    format                  files                                        served by
    eagle3_native           config.json, model.safetensors               SGLang (EAGLE3), vLLM (eagle3)
    eagle3_speculators      config.json, model.safetensors               vLLM (speculators format)
    medusa_fasterdecoding   config.json, medusa_lm_head.safetensors      FasterDecoding/Medusa, TensorRT-LLM
    medusa_vllm             config.json, model.safetensors               vLLM (medusa)
    mtp_deepseek            config.json, model.safetensors               vLLM (mtp) for DeepSeek-V3 targets
    mtp_sglang_nextn        config.json, model.safetensors               SGLang (NEXTN) for DeepSeek-V3 targets

Every directory also gets ``README.md`` (serving snippets) and ``draftsmith.json`` (what we know and the engines
do not: method, our layer ids and their convention, the target's identity incl. its embedding fingerprint).

Aux-layer-id conventions (checked against the engines' loaders, see the comments at the fields):
- draftsmith: index into HF ``output_hidden_states`` (models/target.py): id k = residual stream entering layer k.
- vLLM top-level ``eagle_aux_hidden_state_layer_ids``: the SAME numbers. vLLM's Llama forward appends
  ``hidden_states + residual`` *before* running layer ``idx`` when ``idx`` is listed, and the runner passes the
  config's list through unchanged (vllm/model_executor/models/llama.py ``LlamaModel.forward``,
  vllm/v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``).
- SGLang ``eagle_config.eagle_aux_hidden_state_layer_ids``: "output of layer i" = our id - 1; SGLang adds 1
  (sglang/srt/models/llama.py ``set_eagle3_layers_to_capture``; read in model_executor/model_runner.py).
So the two fields hold different numbers for the same tensors; the validator checks top == sglang + 1.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.target import EMBEDDED_NAME, FrozenTarget, resolve_name
from models.vocab import check_mapping

FORMATS = ("eagle3_native", "eagle3_speculators", "medusa_fasterdecoding", "medusa_vllm", "mtp_deepseek",
           "mtp_sglang_nextn")
# CLI spelling → format
CLI_FORMATS = {"eagle3": "eagle3_native", "eagle3-speculators": "eagle3_speculators",
               "medusa": "medusa_fasterdecoding", "medusa-vllm": "medusa_vllm", "mtp": "mtp_deepseek",
               "mtp-nextn": "mtp_sglang_nextn"}
METHOD_OF = {"eagle3_native": "eagle3", "eagle3_speculators": "eagle3", "medusa_fasterdecoding": "medusa",
             "medusa_vllm": "medusa", "mtp_deepseek": "mtp", "mtp_sglang_nextn": "mtp"}
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
# FasterDecoding's trainer saves this name; TensorRT-LLM's loader looks for it after medusa_lm_head.pt
# (NVIDIA/TensorRT-LLM tensorrt_llm/models/medusa/weight.py ``load_medusa_hf``).
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
SIDECAR = "draftsmith.json"
README = "README.md"
LAYER_ID_CONVENTION = "hf_output_hidden_states_index"
DEFAULT_K = {"eagle3": 3}  # medusa: its number of heads; mtp: its number of modules
# The only model family whose HF-5 fused expert tensors we split back into the per-expert checkpoint layout:
# transformers' conversion_mapping.py maps deepseek_v3 to the qwen2_moe rule (experts.*.gate_proj/up_proj →
# MergeModulelist(dim=0) + Concatenate(dim=1) = experts.gate_up_proj; experts.*.down_proj → experts.down_proj).
_UNFUSE_OK = ("deepseek_v3",)


class ExportError(ValueError):
    """A one-line reason why an export cannot be written or a directory is not a valid export."""


# ============================================================================================ small helpers
@dataclass
class _Tensors:
    """Names, shapes and dtypes of an export's tensors; values fetched on demand (files are read lazily)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    get: Callable[[str], torch.Tensor]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> _Tensors:
        return cls({k: tuple(v.shape) for k, v in tensors.items()}, {k: v.dtype for k, v in tensors.items()},
                   lambda k: tensors[k])

    @classmethod
    def read(cls, path: Path) -> _Tensors:
        shapes, dtypes = {}, {}
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                shapes[k] = tuple(sl.get_shape())
                dtypes[k] = _ST_DTYPES.get(sl.get_dtype(), torch.float32)

        def get(k: str) -> torch.Tensor:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(k)

        return cls(shapes, dtypes, get)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class _Target:
    """What the validator knows about the target (from a FrozenTarget, a config or a plain dict)."""

    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    name: str | None = None
    fingerprint: str | None = None
    config: Any = None
    frozen: FrozenTarget | None = None


def _target_info(t: Any) -> _Target | None:
    if t is None:
        return None
    if isinstance(t, _Target):
        return t
    if isinstance(t, FrozenTarget):
        c = t.model.config
        return _Target(c.num_hidden_layers, c.hidden_size, c.vocab_size, getattr(c, "_name_or_path", None),
                       t.fingerprint(), c, t)
    get = t.get if isinstance(t, Mapping) else (lambda k, d=None: getattr(t, k, d))
    name = get("_name_or_path", None) or get("name_or_path", None)
    return _Target(get("num_hidden_layers"), get("hidden_size"), get("vocab_size"), name, None, t)


def _norm_name(name: str) -> str:
    """A target name comparable across spellings: `tiny-code` and local paths resolve to absolute paths."""
    r = resolve_name(str(name))
    p = Path(r)
    return str(p.resolve()) if p.exists() else r.rstrip("/")


def embed_fingerprint(weight: torch.Tensor) -> str:
    """Same sampling as FrozenTarget.fingerprint, for an embedding matrix found in an export."""
    w = weight.detach()
    sample = w.reshape(-1)[:: max(1, w.numel() // 65536)][:65536].float().cpu()
    return hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]


def _engine_target_name(name: str) -> str:
    # Engines cannot resolve draftsmith's alias for the embedded target; give them its directory.
    return resolve_name(name) if name == EMBEDDED_NAME else name


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path.parent}: no {path.name}; not an export directory") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def recommended_k_from_results(path: str | Path) -> int:
    """``recommended_num_speculative_tokens`` from an eval results JSON (eval/ writes it)."""
    data = _load_json(Path(path))
    k = data.get("recommended_num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ExportError(f"{path}: needs a positive integer 'recommended_num_speculative_tokens', got {k!r}")
    return k


# ============================================================================================ the bundle
@dataclass
class _Bundle:
    """Everything one export writes; validated as a whole before the first byte hits the disk."""

    fmt: str
    config: dict
    tensors: dict[str, torch.Tensor]
    sidecar: dict
    weights_file: str = WEIGHTS


def _write(bundle: _Bundle, out: Path, overwrite: bool) -> Path:
    """Atomic: write OUT.tmp, then swap it in (a crash leaves the old directory or none, never half of one)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; pass overwrite=True (CLI: --force) or another --out")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in bundle.tensors.items()}
    save_file(tensors, str(tmp / bundle.weights_file), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(bundle.config, indent=2, sort_keys=True) + "\n")
    (tmp / SIDECAR).write_text(json.dumps(bundle.sidecar, indent=2, sort_keys=True) + "\n")
    (tmp / README).write_text(_readme(bundle.fmt, bundle.config, bundle.sidecar))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _sidecar(fmt: str, drafter: nn.Module, target: FrozenTarget, target_name: str, k: int,
             meta: dict | None) -> dict:
    return {"format": fmt, "method": METHOD_OF[fmt], "target_name": target_name, "target": target.identity(),
            "layer_ids": list(drafter.layer_ids), "layer_id_convention": LAYER_ID_CONVENTION,
            "draft": drafter.config_dict(), "num_speculative_tokens": k,
            "trained_step": (meta or {}).get("step")}


def export(drafter: nn.Module, fmt: str, out: str | Path, target: FrozenTarget, *, target_name: str | None = None,
           recommended_k: int | None = None, meta: dict | None = None, dtype: torch.dtype | None = None,
           overwrite: bool = False) -> Path:
    """Write ``drafter`` (trained for ``target``) to ``out`` in ``fmt`` (one of FORMATS or a CLI name).

    ``target_name``: how engines should find the target (default: the target config's name_or_path).
    ``recommended_k``: num_speculative_tokens for the serving snippets (e.g. from an eval results JSON).
    ``dtype``: cast float weights (default: keep the trained dtype; d2t/t2d are never cast).
    The export is validated in memory first, written atomically, then validated again from disk.
    """
    fmt = CLI_FORMATS.get(fmt, fmt)
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {FORMATS} (CLI: {sorted(CLI_FORMATS)})")
    method = drafter.config_dict().get("method")
    if method != METHOD_OF[fmt]:
        raise ExportError(f"format {fmt} is for {METHOD_OF[fmt]} drafters, this one is {method}")
    if recommended_k is not None and (not isinstance(recommended_k, int) or recommended_k < 1):
        raise ExportError(f"recommended_k must be a positive integer, got {recommended_k!r}")
    name = target_name or getattr(target.model.config, "_name_or_path", "") or "UNKNOWN-TARGET"
    bundle = _BUILDERS[fmt](drafter, target, name, recommended_k, meta)
    bundle.sidecar["k_from_results"] = recommended_k is not None
    if dtype is not None:
        bundle.tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in bundle.tensors.items()}
        _set_dtype(bundle, dtype)
    info = _target_info(target)
    _check(bundle.fmt, bundle.config, _Tensors.of(bundle.tensors), bundle.sidecar, info, f"export to {out}")
    path = _write(bundle, Path(out), overwrite)
    try:
        validate(path, fmt, target)
    except ExportError as e:  # passed in memory, failed from disk: do not leave a broken export behind
        shutil.rmtree(path, ignore_errors=True)
        raise ExportError(f"written export failed re-validation and was removed: {e}") from None
    return path


def _set_dtype(bundle: _Bundle, dtype: torch.dtype) -> None:
    name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    bundle.config["torch_dtype"] = name


# ============================================================================================ EAGLE-3
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
        "tie_word_embeddings": False, "torch_dtype": _DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
    }


def _engine_aux_ids(d: nn.Module, target: FrozenTarget) -> tuple[list[int], list[int]]:
    """(vLLM ids, SGLang ids) for the drafter's layer ids; refuse ids no engine can capture."""
    L = target.num_layers
    ours = list(d.layer_ids)
    bad = [k for k in ours if not 1 <= k <= L - 1]
    if bad:
        # Both engines capture inside the decoder-layer loop: id L (after the final norm) is never reached, and
        # vLLM's capture at layer 0 adds a residual that is still None there (llama.py LlamaModel.forward).
        raise ExportError(f"EAGLE-3 layer ids {bad} cannot be served: engines capture the input of decoder layers "
                          f"1..{L - 1} of this {L}-layer target (our ids 1..{L - 1}); retrain with other layer_ids")
    return ours, [k - 1 for k in ours]


def _eagle3_tensors(d: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in d.state_dict().items():
        if k == "embed_tokens.weight":
            continue  # frozen copy of the target's; both engines share the target's embedding when absent
        out[prefix + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k] = v.detach().clone()
    return out


def _build_eagle3_native(d: nn.Module, target: FrozenTarget, name: str, k: int | None, meta: dict | None) -> _Bundle:
    if d.cfg.norm_before_residual:
        # SGLang's LlamaDecoderLayer (llama_eagle3.py) always uses residual = g; only vLLM reads the flag.
        raise ExportError("norm_before_residual=True cannot be expressed in the native EAGLE-3 format (SGLang's "
                          "llama_eagle3.py ignores it and would use residual = g); export --format "
                          "eagle3-speculators for vLLM instead")
    if d.attention_bias:
        # SGLang builds qkv_proj with bias=False and skips unknown tensors silently (llama_eagle3.py load_weights).
        raise ExportError("attention_bias=True cannot be loaded by SGLang's native EAGLE-3 layer (qkv bias is "
                          "fixed to False there); export --format eagle3-speculators for vLLM instead")
    vllm_ids, sglang_ids = _engine_aux_ids(d, target)
    k = k or DEFAULT_K["eagle3"]
    cfg = {
        # vLLM keeps an architecture ending in "Eagle3" (vllm/transformers_utils/configs/eagle.py) and maps it to
        # llama_eagle3.Eagle3LlamaForCausalLM; SGLang's EntryClass is LlamaForCausalLMEagle3.
        "architectures": ["LlamaForCausalLMEagle3"],
        **_eagle3_decoder_fields(d, target),
        "draft_vocab_size": d.draft_vocab_size,  # lm_head rows: both engines (llama_eagle3.py)
        "target_hidden_size": d.target_hidden_size,  # fc in = 3 * this (vLLM + SGLang llama_eagle3.py)
        # vLLM reads getattr(config, "norm_before_residual", False) (vllm llama_eagle3.py); explicit anyway.
        "norm_before_residual": False,
        # vLLM: vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config reads this top-level list
        # first and uses it unchanged as "capture before layer idx" (= our ids).
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        # SGLang: model_runner.py reads eagle_config["eagle_aux_hidden_state_layer_ids"] and llama.py
        # set_eagle3_layers_to_capture adds 1 ("output of layer i" = our id - 1).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
    }
    tensors = _eagle3_tensors(d, "midlayer.")
    side = _sidecar("eagle3_native", d, target, name, k, meta)
    return _Bundle("eagle3_native", cfg, tensors, side)


def _build_eagle3_speculators(d: nn.Module, target: FrozenTarget, name: str, k: int | None,
                              meta: dict | None) -> _Bundle:
    vllm_ids, _ = _engine_aux_ids(d, target)
    k = k or DEFAULT_K["eagle3"]
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
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": _engine_target_name(name),
                         "architectures": list(getattr(target.model.config, "architectures", None) or [])},
        },
        "draft_vocab_size": d.draft_vocab_size,  # algos.py update_eagle3
        "target_hidden_size": d.target_hidden_size,  # algos.py update_eagle3
        # algos.py update_eagle3: config_dict.get("norm_before_residual", True) — absent means TRUE there, while
        # our default (and EAGLE-3's) is residual = g: always written, matching the trained drafter.
        "norm_before_residual": bool(d.cfg.norm_before_residual),
        "norm_before_fc": False,  # newer algos.py: default False; we apply no norm before fc
        # algos.py copies it to the vLLM config unchanged → same convention as the native top-level list.
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        "torch_dtype": _DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
    }
    # vLLM's llama_eagle3.py load_weights maps "midlayer." to "layers.0."; speculators checkpoints use the latter.
    tensors = _eagle3_tensors(d, "layers.0.")
    side = _sidecar("eagle3_speculators", d, target, name, k, meta)
    return _Bundle("eagle3_speculators", cfg, tensors, side)


# ============================================================================================ Medusa
def _medusa_k(d: nn.Module, k: int | None) -> int:
    K = d.cfg.num_heads
    if k is not None and k > K:
        raise ExportError(f"recommended num_speculative_tokens={k} exceeds the drafter's {K} Medusa heads "
                          "(head k drafts token k+1; vLLM proposes at most num_heads)")
    return k or K


def _build_medusa_fasterdecoding(d: nn.Module, target: FrozenTarget, name: str, k: int | None,
                                 meta: dict | None) -> _Bundle:
    k = _medusa_k(d, k)
    cfg = {
        # FasterDecoding/Medusa medusa/model/medusa_model.py MedusaConfig: these three fields.
        "medusa_num_heads": d.cfg.num_heads, "medusa_num_layers": d.cfg.num_layers,
        "base_model_name_or_path": _engine_target_name(name),
        # not read by FasterDecoding; lets the validator check shapes without the target
        "hidden_size": d.hidden_size, "vocab_size": d.vocab_size,
        "torch_dtype": _DTYPE_NAMES.get(d._dtype(), "float32"),
    }
    # {h}.{l}.linear.{weight,bias} and {h}.{n}.weight: MedusaModel.medusa_head state dict (nn.Sequential of
    # ResBlocks + Linear) and TensorRT-LLM's load_medusa_hf (tensorrt_llm/models/medusa/weight.py).
    tensors = d.to_fasterdecoding_state_dict()
    side = _sidecar("medusa_fasterdecoding", d, target, name, k, meta)
    return _Bundle("medusa_fasterdecoding", cfg, tensors, side,
                   weights_file=MEDUSA_WEIGHTS)


def _build_medusa_vllm(d: nn.Module, target: FrozenTarget, name: str, k: int | None, meta: dict | None) -> _Bundle:
    k = _medusa_k(d, k)
    K, n = d.cfg.num_heads, d.cfg.num_layers
    shared = d.shared_lm_head is not None
    # vllm/transformers_utils/configs/medusa.py MedusaConfig. Its from_pretrained renames EVERY key containing
    # "num" and "heads" to num_heads (and "num"+"layers" to num_hidden_layers): write no other such key.
    cfg = {
        "model_type": "medusa", "architectures": ["MedusaModel"],
        "hidden_size": d.hidden_size, "vocab_size": d.vocab_size,
        "num_heads": K, "num_hidden_layers": n,
        "truncated_vocab_size": d.vocab_size,  # no token_map: full vocabulary per head
        # vllm/model_executor/models/medusa.py ResidualBlock: bias=getattr(config, "medusa_fc_bias", False), and
        # load_weights silently skips tensors it has no parameter for → our ResBlock biases need this True.
        "medusa_fc_bias": True,
        # medusa.py: original_lm_head → one lm_head for every head, loaded from "lm_heads.0.weight".
        "original_lm_head": shared,
        "torch_dtype": _DTYPE_NAMES.get(d._dtype(), "float32"),
    }
    fd = d.to_fasterdecoding_state_dict()
    tensors = {}
    for h in range(K):
        for j in range(n):
            tensors[f"blocks.{h}.layers.{j}.weight"] = fd[f"{h}.{j}.linear.weight"]
            tensors[f"blocks.{h}.layers.{j}.bias"] = fd[f"{h}.{j}.linear.bias"]
        if not shared or h == 0:
            tensors[f"lm_heads.{h}.weight"] = fd[f"{h}.{n}.weight"]
    side = _sidecar("medusa_vllm", d, target, name, k, meta)
    return _Bundle("medusa_vllm", cfg, tensors, side)


# ============================================================================================ MTP
_FUSED = re.compile(r"^(?P<pre>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<pre>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _unfuse_experts(sd: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
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


def _fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``_unfuse_experts``."""
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


def _target_config_dict(target: FrozenTarget) -> dict:
    """The target's own config.json when it is local (exactly what engines already parse), else to_dict()."""
    c = target.model.config
    p = Path(resolve_name(getattr(c, "_name_or_path", "") or "")) / CONFIG
    if p.is_file():
        return json.loads(p.read_text())
    return c.to_dict()


def _mtp_native(d: nn.Module, target: FrozenTarget) -> tuple[dict, str]:
    from models.mtp import to_native_state_dict

    tc = target.model.config
    over = {k: getattr(d.cfg, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")}
    differ = {k: v for k, v in over.items() if v is not None and v != getattr(tc, k, None)}
    if differ:
        # Engines build the MTP block from the target's config; a block of another shape has no config to say so.
        raise ExportError(f"MTP block overrides {differ} differ from the target's config; native MTP layouts "
                          "assume the target's block shape (retrain without the overrides)")
    mt = getattr(tc, "model_type", "")
    return _unfuse_experts(to_native_state_dict(d, include_shared=True), mt), mt


def _build_mtp_deepseek(d: nn.Module, target: FrozenTarget, name: str, k: int | None, meta: dict | None) -> _Bundle:
    sd, _ = _mtp_native(d, target)
    D = d.cfg.num_modules
    k = k or D
    # vllm/model_executor/models/deepseek_mtp.py: layers num_hidden_layers..+num_nextn_predict_layers-1, each with
    # enorm/hnorm/eh_proj/shared_head.{norm,head} and its own embed_tokens copy (only the first is loaded).
    cfg = {**_target_config_dict(target), "num_nextn_predict_layers": D,
           "torch_dtype": _DTYPE_NAMES.get(d._dtype(), "float32")}
    side = _sidecar("mtp_deepseek", d, target, name, k, meta)
    return _Bundle("mtp_deepseek", cfg, sd, side)


def _build_mtp_sglang_nextn(d: nn.Module, target: FrozenTarget, name: str, k: int | None,
                            meta: dict | None) -> _Bundle:
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
    k = k or 1
    # export_deepseek_nextn.py update_and_save_config: num_hidden_layers 1, DeepseekV3ForCausalLMNextN.
    cfg = {**_target_config_dict(target), "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"],
           "num_nextn_predict_layers": 1, "torch_dtype": _DTYPE_NAMES.get(d._dtype(), "float32")}
    side = _sidecar("mtp_sglang_nextn", d, target, name, k, meta)
    return _Bundle("mtp_sglang_nextn", cfg, tensors, side)


_BUILDERS: dict[str, Callable[..., _Bundle]] = {
    "eagle3_native": _build_eagle3_native, "eagle3_speculators": _build_eagle3_speculators,
    "medusa_fasterdecoding": _build_medusa_fasterdecoding, "medusa_vllm": _build_medusa_vllm,
    "mtp_deepseek": _build_mtp_deepseek, "mtp_sglang_nextn": _build_mtp_sglang_nextn,
}


# ============================================================================================ README
def _readme(fmt: str, cfg: dict, side: dict) -> str:
    k = side["num_speculative_tokens"]
    tname = _engine_target_name(side["target_name"])
    path = "/path/to/this/export"
    lines = [f"# draftsmith export: {fmt}", "",
             f"Drafter method `{side['method']}` for target `{side['target_name']}` "
             f"({side['target']['num_hidden_layers']} layers, hidden {side['target']['hidden_size']}, "
             f"vocab {side['target']['vocab_size']}). Check this directory any time with "
             f"`python -m train.export --check {path} --target {side['target_name']}`.", "",
             f"num_speculative_tokens below: {k}"
             + (" (from the eval results)." if side.get("k_from_results") else " (default; pass --results eval.json "
                "with `recommended_num_speculative_tokens` to use the measured best)."), ""]
    spec = {"model": path, "num_speculative_tokens": k, "draft_tensor_parallel_size": 1}
    sglang = None
    if fmt in ("eagle3_native", "eagle3_speculators"):
        spec = {"method": "eagle3", **spec}
        if fmt == "eagle3_native":
            sglang = "EAGLE3"
        ours = side["layer_ids"]
        lines += ["## Aux hidden-state layer ids (same tensors, three conventions)", "",
                  f"- draftsmith (index into HF `output_hidden_states`): {ours}",
                  f"- vLLM top-level `eagle_aux_hidden_state_layer_ids` (capture before decoder layer i): {ours}",
                  f"- SGLang `eagle_config.eagle_aux_hidden_state_layer_ids` (output of decoder layer i): "
                  f"{[i - 1 for i in ours]}" + ("" if fmt == "eagle3_native" else " (not written: vLLM only)"), ""]
        if fmt == "eagle3_native" and ours[0] != 2:
            lines += ["Note: SGLang versions carrying PR #25454 add 1 to these ids only when the first one is 1 "
                      "(the default layers); with other layer ids check the server log for the captured layers.", ""]
    elif fmt == "medusa_vllm":
        spec = {"method": "medusa", **spec}
    elif fmt == "medusa_fasterdecoding":
        spec = None
        lines += ["## FasterDecoding/Medusa", "", "```python",
                  "from medusa.model.medusa_model import MedusaModel",
                  f"model = MedusaModel.from_pretrained('{path}')  # base model: {tname}", "```", "",
                  "TensorRT-LLM (engine-build route): `python examples/medusa/convert_checkpoint.py --model_dir "
                  f"{tname} --medusa_model_dir {path} --num_medusa_heads {cfg['medusa_num_heads']} "
                  f"--num_medusa_layers {cfg['medusa_num_layers']} --output_dir ckpt --dtype float16` "
                  "(its weight.py reads medusa_lm_head.safetensors). For vLLM export --format medusa-vllm; "
                  "SGLang has no Medusa support.", ""]
    elif fmt == "mtp_deepseek":
        spec = {"method": "mtp", **spec}  # vllm/config/speculative.py: deepseek_mtp is an alias of mtp
        if cfg.get("model_type") == "deepseek_v3":
            lines += ["For SGLang export --format mtp-nextn (one module, layer renumbered to 0).", ""]
        else:
            spec = None
            lines += ["## No engine serves this block as-is", "",
                      f"The layout is DeepSeek-V3's (`model.layers.{{L+d}}.{{enorm,hnorm,eh_proj,shared_head.*,...}}`)"
                      f", but the block is the `{cfg.get('model_type')}` target's own decoder layer. vLLM's "
                      "deepseek_mtp.py and SGLang's deepseek_nextn.py build a DeepseekV2DecoderLayer (MLA + MoE), "
                      "so they cannot load it. An engine would need an MTP model class for this family: "
                      "enorm/hnorm RMSNorms, eh_proj Linear(2H→H) over cat(enorm(emb), hnorm(h)), the family's "
                      "decoder layer, shared_head.norm and the target's lm_head, fed the target's final (post-norm) "
                      "hidden state. draftsmith's eval and `models.export.load_export` run it today.", ""]
    elif fmt == "mtp_sglang_nextn":
        spec = None
        sglang = "NEXTN"
    if spec is not None:
        lines += ["## vLLM", "", "```bash", f"vllm serve {tname} \\",
                  f"  --speculative-config '{json.dumps(spec)}'", "```", ""]
    if sglang is not None:
        lines += ["## SGLang", "", "```bash", f"python -m sglang.launch_server --model-path {tname} \\",
                  f"  --speculative-algorithm {sglang} --speculative-draft-model-path {path} \\",
                  f"  --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
                  "```", "",
                  "(chain drafting; for tree drafting raise --speculative-eagle-topk and "
                  "--speculative-num-draft-tokens)", ""]
    return "\n".join(lines)


# ============================================================================================ validation
def detect_format(path: str | Path) -> str:
    """Which of FORMATS a directory holds (from its config.json and weight files)."""
    path = Path(path)
    cfg = _load_json(path / CONFIG)
    arch = list(cfg.get("architectures") or [])
    if "LlamaForCausalLMEagle3" in arch:
        return "eagle3_native"
    if "Eagle3Speculator" in arch or cfg.get("speculators_model_type") == "eagle3":
        return "eagle3_speculators"
    if (path / MEDUSA_WEIGHTS).exists() or "medusa_num_heads" in cfg:
        return "medusa_fasterdecoding"
    if cfg.get("model_type") == "medusa":
        return "medusa_vllm"
    if "DeepseekV3ForCausalLMNextN" in arch:
        return "mtp_sglang_nextn"
    if cfg.get("num_nextn_predict_layers"):
        return "mtp_deepseek"
    raise ExportError(f"{path}: config.json matches no export format (architectures {arch}, "
                      f"model_type {cfg.get('model_type')!r}); expected one of {FORMATS}")


def validate(path: str | Path, fmt: str | None = None, target_config: Any = None) -> str:
    """Check an export directory; raise ExportError with a one-line reason, else return its format.

    ``target_config``: a FrozenTarget (also checks the embedding fingerprint), a transformers config or a dict
    with num_hidden_layers/hidden_size/vocab_size(/_name_or_path) — or None for self-consistency only.
    """
    path = Path(path)
    fmt = CLI_FORMATS.get(fmt, fmt) if fmt else detect_format(path)
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {FORMATS}")
    cfg = _load_json(path / CONFIG)
    side = _load_json(path / SIDECAR) if (path / SIDECAR).exists() else None
    wfile = path / (MEDUSA_WEIGHTS if fmt == "medusa_fasterdecoding" else WEIGHTS)
    if not wfile.exists():
        raise ExportError(f"{path}: {fmt} export needs {wfile.name}, which is missing")
    try:
        tensors = _Tensors.read(wfile)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one reason to refuse
        raise ExportError(f"{wfile}: unreadable safetensors ({type(e).__name__}: {e})") from None
    _check(fmt, cfg, tensors, side, _target_info(target_config), str(path))
    return fmt


def _fail(where: str, msg: str) -> None:
    raise ExportError(f"{where}: {msg}".replace("\n", " "))


def _check(fmt: str, cfg: dict, t: _Tensors, side: dict | None, target: _Target | None, where: str) -> None:
    if side is not None:
        if side.get("format") not in (None, fmt):
            _fail(where, f"draftsmith.json says format {side.get('format')!r} but the files are {fmt}")
        if side.get("layer_id_convention") not in (None, LAYER_ID_CONVENTION):
            _fail(where, f"draftsmith.json layer ids use convention {side.get('layer_id_convention')!r}, "
                         f"expected {LAYER_ID_CONVENTION!r}")
    expected, tgt_dims = _CHECKERS[fmt](cfg, t, side, target, where)
    _check_same_target(fmt, cfg, t, side, target, tgt_dims, where)  # first: "another target" explains the rest
    _compare_tensors(expected, t, where, fmt)


def _compare_tensors(expected: dict[str, tuple[int, ...]], t: _Tensors, where: str, fmt: str) -> None:
    missing = [k for k in expected if k not in t.shapes]
    if missing:
        _fail(where, f"{fmt} export is missing {len(missing)} tensor(s), e.g. {missing[:4]}")
    extra = sorted(k for k in t.shapes if k not in expected)
    if extra:
        _fail(where, f"{fmt} export has {len(extra)} unexpected tensor(s), e.g. {extra[:4]} "
                     "(engines skip unknown names silently, so they must not be there)")
    for k, shape in expected.items():
        if tuple(t.shapes[k]) != tuple(shape):
            _fail(where, f"tensor {k} has shape {list(t.shapes[k])}, expected {list(shape)} from config.json")
    floats = {k: d for k, d in t.dtypes.items() if d.is_floating_point}
    if len(set(floats.values())) > 1:
        _fail(where, f"float tensors mix dtypes {sorted({str(d) for d in floats.values()})}")


def _req(cfg: Mapping, key: str, where: str, kind: type | tuple = int) -> Any:
    v = cfg.get(key)
    if v is None or not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        _fail(where, f"config.json needs {key} ({getattr(kind, '__name__', kind)}), got {v!r}")
    return v


def _num_layers(target: _Target | None, side: dict | None) -> int | None:
    if target is not None and target.num_hidden_layers:
        return int(target.num_hidden_layers)
    if side is not None:
        return (side.get("target") or {}).get("num_hidden_layers")
    return None


def _check_aux_ids(ids: Any, what: str, L: int | None, lo_shift: int, where: str) -> list[int]:
    """ids in an engine convention; lo_shift = how far that convention sits below ours (vLLM 0, SGLang 1)."""
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in ids):
        _fail(where, f"{what} must list 3 integer layer ids, got {ids!r} (absent ids make engines fall back to "
                     "their default layers silently)")
    if len(set(ids)) != 3:
        _fail(where, f"{what} {ids} repeats a layer")
    if L is not None:
        lo, hi = 1 - lo_shift, L - 1 - lo_shift
        bad = [i for i in ids if not lo <= i <= hi]
        if bad:
            _fail(where, f"{what} {ids}: {bad} out of range for a {L}-layer target (capturable {lo}..{hi} in this "
                         "convention; an id at the top is off by one: it names the output of the last layer or "
                         "beyond, which the engine never captures)")
    elif any(i < 1 - lo_shift for i in ids):
        _fail(where, f"{what} {ids} has an id below {1 - lo_shift}")
    return ids


def _check_eagle3(fmt: str, cfg: dict, t: _Tensors, side: dict | None, target: _Target | None,
                  where: str) -> tuple[dict, dict]:
    native = fmt == "eagle3_native"
    if native:
        if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
            _fail(where, f"architectures must be ['LlamaForCausalLMEagle3'], got {cfg.get('architectures')}")
        layer = cfg
        if cfg.get("norm_before_residual"):
            _fail(where, "norm_before_residual=true in the native format: SGLang's llama_eagle3.py ignores it "
                         "(residual = g) while vLLM honours it, so the two engines would compute different drafts")
        if cfg.get("attention_bias"):
            _fail(where, "attention_bias=true in the native format: SGLang's EAGLE-3 qkv_proj has no bias")
    else:
        if cfg.get("speculators_model_type") != "eagle3":
            _fail(where, f"speculators_model_type must be 'eagle3', got {cfg.get('speculators_model_type')!r}")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            _fail(where, "config.json needs a transformer_layer_config object")
        if not isinstance(cfg.get("norm_before_residual"), bool):
            _fail(where, "norm_before_residual must be written explicitly (vLLM's speculators reader assumes true "
                         "when absent, EAGLE-3's original is false)")
        sc = cfg.get("speculators_config") or {}
        pm = sc.get("proposal_methods") or [{}]
        if sc.get("algorithm") != "eagle3" or not isinstance(pm[0].get("speculative_tokens"), int):
            _fail(where, "speculators_config needs algorithm 'eagle3' and proposal_methods[0].speculative_tokens")
        if not (sc.get("verifier") or {}).get("name_or_path"):
            _fail(where, "speculators_config.verifier.name_or_path is required (vLLM's base.py validation)")
    if layer.get("model_type", "llama") != "llama":
        _fail(where, f"the draft layer must be model_type 'llama', got {layer.get('model_type')!r}")
    if _req(layer, "num_hidden_layers", where) != 1:
        _fail(where, f"num_hidden_layers must be 1 (one EAGLE-3 layer), got {layer.get('num_hidden_layers')}")
    if layer.get("tie_word_embeddings", False) is not False:
        _fail(where, "tie_word_embeddings must be false (SGLang would use the embedding as the draft lm_head)")
    H = _req(layer, "hidden_size", where)
    I_ = _req(layer, "intermediate_size", where)
    nh = _req(layer, "num_attention_heads", where)
    nkv = layer.get("num_key_value_heads") or nh
    hd = layer.get("head_dim") or H // nh
    V = _req(layer, "vocab_size", where)
    Vd = _req(cfg, "draft_vocab_size", where)
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
    if bias:
        exp.update({f"{pre}self_attn.q_proj.bias": (nh * hd,), f"{pre}self_attn.k_proj.bias": (nkv * hd,),
                    f"{pre}self_attn.v_proj.bias": (nkv * hd,), f"{pre}self_attn.o_proj.bias": (H,)})
    if "fc.weight" in t.shapes and tuple(t.shapes["fc.weight"]) != exp["fc.weight"]:
        _fail(where, f"fc.weight has shape {list(t.shapes['fc.weight'])}, expected {list(exp['fc.weight'])} "
                     f"[hidden_size, 3 x target_hidden_size]: it must fuse exactly 3 target states of size {Ht}")

    L = _num_layers(target, side)
    top = _check_aux_ids(cfg.get("eagle_aux_hidden_state_layer_ids"),
                         "top-level eagle_aux_hidden_state_layer_ids (vLLM: input of decoder layer i)", L, 0, where)
    if native:
        sg = _check_aux_ids((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
                            "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: output of decoder layer i)",
                            L, 1, where)
        if sg != [i - 1 for i in top]:
            _fail(where, f"eagle_config ids {sg} (SGLang, output of layer i) must be the top-level ids {top} "
                         f"(vLLM, input of layer i) minus 1, i.e. {[i - 1 for i in top]}; one of them is off by one")
    if side is not None and side.get("layer_ids") is not None and list(side["layer_ids"]) != top:
        _fail(where, f"draftsmith.json layer ids {side['layer_ids']} (HF output_hidden_states index) differ from "
                     f"the vLLM ids {top}, which use the same convention")
    if side is not None:
        nbr = (side.get("draft") or {}).get("norm_before_residual")
        if nbr is not None and bool(nbr) != bool(cfg.get("norm_before_residual", False)):
            _fail(where, f"norm_before_residual={cfg.get('norm_before_residual')} in config.json but the drafter "
                         f"was trained with {nbr}")

    # the vocabulary mapping (SpecForge #534: misaligned after fine-tuning, no error at load time)
    for name, dt in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name in t.dtypes and t.dtypes[name] != dt:
            _fail(where, f"{name} must be {str(dt).removeprefix('torch.')}, got {str(t.dtypes[name])}")
    if "d2t" in t.shapes and "t2d" in t.shapes:
        if t.shapes["d2t"] != (Vd,) or t.shapes["t2d"] != (V,):
            _fail(where, f"d2t {list(t.shapes['d2t'])} / t2d {list(t.shapes['t2d'])} must be [draft_vocab_size="
                         f"{Vd}] / [vocab_size={V}]")
        try:
            check_mapping(t.get("d2t"), t.get("t2d"))
        except ValueError as e:
            _fail(where, f"d2t/t2d rejected: {e}")
    if "lm_head.weight" in t.shapes and t.shapes["lm_head.weight"][0] != Vd:
        _fail(where, f"lm_head.weight has {t.shapes['lm_head.weight'][0]} rows but d2t/draft_vocab_size say {Vd}")
    name = (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") if not native else None
    return exp, {"hidden_size": Ht, "vocab_size": V, "name": name,
                 "rope_theta": layer.get("rope_theta")}


def _check_medusa(fmt: str, cfg: dict, t: _Tensors, side: dict | None, target: _Target | None,
                  where: str) -> tuple[dict, dict]:
    if fmt == "medusa_fasterdecoding":
        K = _req(cfg, "medusa_num_heads", where)
        n = _req(cfg, "medusa_num_layers", where)
        name = _req(cfg, "base_model_name_or_path", where, str)
        H = cfg.get("hidden_size") or (t.shapes.get("0.0.linear.weight") or t.shapes.get(f"0.{n}.weight")
                                       or (None, None))[-1]
        V = cfg.get("vocab_size") or (t.shapes.get(f"0.{n}.weight") or (None,))[0]
        if not H or not V:
            _fail(where, f"cannot tell hidden/vocab size: config.json has none and head 0 lacks 0.{n}.weight")
        exp = {}
        for h in range(K):
            for j in range(n):
                exp[f"{h}.{j}.linear.weight"], exp[f"{h}.{j}.linear.bias"] = (H, H), (H,)
            exp[f"{h}.{n}.weight"] = (V, H)
    else:
        if cfg.get("architectures") != ["MedusaModel"]:
            _fail(where, f"architectures must be ['MedusaModel'], got {cfg.get('architectures')}")
        clobber = [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)
                   and k not in ("num_heads", "num_hidden_layers")]
        if clobber:
            _fail(where, f"config keys {clobber} would overwrite num_heads/num_hidden_layers in vLLM's "
                         "MedusaConfig.from_pretrained (it renames every key with 'num' and 'heads'/'layers')")
        K, n = _req(cfg, "num_heads", where), _req(cfg, "num_hidden_layers", where)
        H, V = _req(cfg, "hidden_size", where), _req(cfg, "vocab_size", where)
        if cfg.get("truncated_vocab_size", V) != V:
            _fail(where, f"truncated_vocab_size={cfg.get('truncated_vocab_size')} needs a token_map; draftsmith "
                         f"heads score the full vocabulary ({V})")
        if n > 0 and cfg.get("medusa_fc_bias") is not True:
            _fail(where, "medusa_fc_bias must be true: vLLM otherwise builds bias-free ResidualBlocks and drops "
                         "the blocks' .bias tensors without a word")
        shared = bool(cfg.get("original_lm_head", False))
        exp = {}
        for h in range(K):
            for j in range(n):
                exp[f"blocks.{h}.layers.{j}.weight"], exp[f"blocks.{h}.layers.{j}.bias"] = (H, H), (H,)
            if not shared or h == 0:
                exp[f"lm_heads.{h}.weight"] = (V, H)
        name = None
    if K < 1 or n < 0:
        _fail(where, f"medusa needs >= 1 head and >= 0 layers, got {K} heads, {n} layers")
    return exp, {"hidden_size": H, "vocab_size": V, "name": name}


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


def _mtp_expected_layer(cfg: dict, layer_idx: int, target: _Target | None, where: str) -> dict[str, tuple]:
    """Native names/shapes of one MTP layer (own tensors + the family's decoder block), built on the meta device
    from the config, so a 671B target costs nothing."""
    from transformers import AutoConfig

    from models.mtp import MTPConfig, MTPModule, decoder_config

    if target is not None and target.frozen is not None and \
            getattr(target.frozen.model.config, "model_type", None) == cfg.get("model_type"):
        tcfg, cls = target.frozen.model.config, type(target.frozen.layers[0])
    else:
        try:
            tcfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
        except Exception as e:  # noqa: BLE001
            raise ExportError(f"{where}: config.json does not build a {cfg.get('model_type')!r} config ({e})") from None
        cls = _decoder_layer_class(cfg)
    dc = decoder_config(MTPConfig(num_modules=1), tcfg)
    with torch.device("meta"):
        module = MTPModule(dc, layer_idx, cls)
    sd = {k.removeprefix("block."): v for k, v in module.state_dict().items()}
    sd = _unfuse_experts(sd, getattr(tcfg, "model_type", cfg.get("model_type", "")))
    return {k: tuple(v.shape) for k, v in sd.items()}


def _check_mtp(fmt: str, cfg: dict, t: _Tensors, side: dict | None, target: _Target | None,
               where: str) -> tuple[dict, dict]:
    H, V = _req(cfg, "hidden_size", where), _req(cfg, "vocab_size", where)
    exp: dict[str, tuple] = {}
    if fmt == "mtp_deepseek":
        L, D = _req(cfg, "num_hidden_layers", where), _req(cfg, "num_nextn_predict_layers", where)
        if target is not None and target.num_hidden_layers and target.num_hidden_layers != L:
            _fail(where, f"config.json says the target has {L} layers (MTP layers {L}..{L + D - 1}) but the target "
                         f"has {target.num_hidden_layers}: the MTP layer indices would be off")
        present = sorted({int(m.group(1)) for k in t.shapes if (m := re.match(r"^model\.layers\.(\d+)\.", k))})
        if present and present != list(range(L, L + D)):
            _fail(where, f"MTP tensors sit at layers {present[:6]}, expected model.layers.{L}..{L + D - 1} "
                         f"(num_hidden_layers={L}, num_nextn_predict_layers={D}): off by one?")
        for d in range(D):
            for k, s in _mtp_expected_layer(cfg, L + d, target, where).items():
                exp[f"model.layers.{L + d}.{k}"] = s
            exp[f"model.layers.{L + d}.embed_tokens.weight"] = (V, H)
            exp[f"model.layers.{L + d}.shared_head.head.weight"] = (V, H)
    else:
        if cfg.get("architectures") != ["DeepseekV3ForCausalLMNextN"] or cfg.get("model_type") != "deepseek_v3":
            _fail(where, f"SGLang NextN needs architectures ['DeepseekV3ForCausalLMNextN'] and model_type "
                         f"deepseek_v3, got {cfg.get('architectures')} / {cfg.get('model_type')!r}")
        if cfg.get("num_hidden_layers") != 1 or cfg.get("num_nextn_predict_layers") != 1:
            _fail(where, "SGLang NextN needs num_hidden_layers == num_nextn_predict_layers == 1 "
                         "(deepseek_nextn.py load_weights asserts it)")
        # is_nextn=True makes SGLang's layer MoE: derive the block at an MoE index (>= first_k_dense_replace).
        moe_idx = int(cfg.get("first_k_dense_replace") or 0)
        for k, s in _mtp_expected_layer(cfg, moe_idx, target, where).items():
            exp[f"model.layers.0.{k}"] = s
    return exp, {"hidden_size": H, "vocab_size": V, "name": None, "model_type": cfg.get("model_type")}


_CHECKERS: dict[str, Callable[..., tuple[dict, dict]]] = {
    "eagle3_native": lambda *a: _check_eagle3("eagle3_native", *a),
    "eagle3_speculators": lambda *a: _check_eagle3("eagle3_speculators", *a),
    "medusa_fasterdecoding": lambda *a: _check_medusa("medusa_fasterdecoding", *a),
    "medusa_vllm": lambda *a: _check_medusa("medusa_vllm", *a),
    "mtp_deepseek": lambda *a: _check_mtp("mtp_deepseek", *a),
    "mtp_sglang_nextn": lambda *a: _check_mtp("mtp_sglang_nextn", *a),
}


def _check_same_target(fmt: str, cfg: dict, t: _Tensors, side: dict | None, target: _Target | None,
                       dims: dict, where: str) -> None:
    """Refuse an export made for another target: shape, name, then (with a FrozenTarget) the embedding itself."""
    if side is not None:
        st = side.get("target") or {}
        for key in ("hidden_size", "vocab_size"):
            if st.get(key) is not None and dims.get(key) is not None and st[key] != dims[key]:
                _fail(where, f"draftsmith.json says the target's {key} is {st[key]} but the tensors/config say "
                             f"{dims[key]}")
    if target is None:
        return
    for key in ("hidden_size", "vocab_size"):
        want, have = dims.get(key), getattr(target, key)
        if want is not None and have is not None and int(want) != int(have):
            _fail(where, f"exported for another target: {key} {want} != the target's {have}")
    tmt = (target.config.get("model_type") if isinstance(target.config, Mapping)
           else getattr(target.config, "model_type", None))
    if dims.get("model_type") and tmt and dims["model_type"] != tmt:
        _fail(where, f"exported for another target: model_type {dims['model_type']!r} != the target's {tmt!r}")
    rt = dims.get("rope_theta")
    trt = _rope_theta_of(target.config)
    if rt is not None and trt is not None and not math.isclose(float(rt), float(trt)):
        _fail(where, f"exported for another target: rope_theta {rt} != the target's {trt}")
    verified = False  # the target's weights themselves were compared: a differing name is then just a spelling
    if side is not None and target.fingerprint is not None:
        st = side.get("target") or {}
        for key in ("num_hidden_layers", "embed_fingerprint"):
            have = target.num_hidden_layers if key == "num_hidden_layers" else target.fingerprint
            if st.get(key) is not None and st.get(key) != have:
                _fail(where, f"exported for another target: {key} {st.get(key)} != the target's {have} "
                             f"(trained on {side.get('target_name')!r})")
        verified = st.get("embed_fingerprint") is not None
    if fmt == "mtp_deepseek" and target.fingerprint is not None:
        for k in t.shapes:
            if k.endswith("embed_tokens.weight"):
                if embed_fingerprint(t.get(k)) != target.fingerprint:
                    _fail(where, f"exported for another target: {k} is not this target's embedding")
                verified = True
    names = [n for n in (dims.get("name"), cfg.get("base_model_name_or_path"),
                         (side or {}).get("target_name")) if n]
    if not verified and target.name and names and _norm_name(names[0]) != _norm_name(target.name):
        _fail(where, f"exported for another target: verifier {names[0]!r} != the target {target.name!r}")


def _rope_theta_of(c: Any) -> float | None:
    if c is None:
        return None
    get = c.get if isinstance(c, Mapping) else (lambda k, d=None: getattr(c, k, d))
    rp = get("rope_parameters", None) or {}
    return (rp.get("rope_theta") if isinstance(rp, Mapping) else None) or get("rope_theta", None)


# ============================================================================================ loading back
def load_export(path: str | Path, target: FrozenTarget, fmt: str | None = None) -> nn.Module:
    """Rebuild draftsmith's own module (Eagle3Drafter, MedusaHeads, MTPDrafter) from an export directory.

    Uses only what engines read (config.json + weights) plus the target, so a successful round trip shows the
    export is self-sufficient. The directory is validated against ``target`` first.
    """
    path = Path(path)
    fmt = validate(path, fmt, target)
    cfg = _load_json(path / CONFIG)
    wfile = path / (MEDUSA_WEIGHTS if fmt == "medusa_fasterdecoding" else WEIGHTS)
    t = _Tensors.read(wfile)
    sd = {k: t.get(k) for k in t.shapes}
    if fmt.startswith("eagle3"):
        return _load_eagle3(fmt, cfg, sd, target)
    if fmt.startswith("medusa"):
        return _load_medusa(fmt, cfg, sd, target)
    return _load_mtp(fmt, cfg, sd, target)


def _load_eagle3(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    layer = cfg if fmt == "eagle3_native" else cfg["transformer_layer_config"]
    tc = target.model.config
    # only pass overrides that differ from the target, so Eagle3Drafter derives head_dim as it did in training
    over = {k: (layer[k] if layer.get(k) != getattr(tc, k, None) else None)
            for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")}
    ec = Eagle3Config(layer_ids=list(cfg["eagle_aux_hidden_state_layer_ids"]), draft_vocab_size=cfg["draft_vocab_size"],
                      norm_before_residual=bool(cfg.get("norm_before_residual", False)), **over)
    d = Eagle3Drafter(ec, tc, target.embed.weight.detach().clone(), sd["d2t"], sd["t2d"])
    if d.head_dim != layer.get("head_dim", d.head_dim):
        raise ExportError(f"export head_dim {layer.get('head_dim')} cannot be rebuilt on this target "
                          f"(drafter derives {d.head_dim})")
    pre = "midlayer." if fmt == "eagle3_native" else "layers.0."
    state = {("midlayer." + k.removeprefix(pre)) if k.startswith(pre) else k: v for k, v in sd.items()}
    state["embed_tokens.weight"] = d.embed_tokens.weight
    d.load_state_dict(state, strict=True)
    return d.to(sd["fc.weight"].dtype).eval()  # Module.to(dtype) leaves the int/bool d2t/t2d alone


def _load_medusa(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    from models.medusa import MedusaConfig, MedusaHeads

    lm = target.model.get_output_embeddings().weight.detach()
    if fmt == "medusa_fasterdecoding":
        K, n, shared = cfg["medusa_num_heads"], cfg["medusa_num_layers"], False
        state = {f"heads.{k}": v for k, v in sd.items()}
    else:
        K, n, shared = cfg["num_heads"], cfg["num_hidden_layers"], bool(cfg.get("original_lm_head", False))
        state = {}
        for h in range(K):
            for j in range(n):
                state[f"heads.{h}.{j}.linear.weight"] = sd[f"blocks.{h}.layers.{j}.weight"]
                state[f"heads.{h}.{j}.linear.bias"] = sd[f"blocks.{h}.layers.{j}.bias"]
            if not shared:
                state[f"heads.{h}.{n}.weight"] = sd[f"lm_heads.{h}.weight"]
        if shared and not torch.equal(sd["lm_heads.0.weight"].to(lm.dtype), lm):
            raise ExportError("original_lm_head export whose lm_heads.0.weight is not this target's lm_head")
    heads = MedusaHeads(MedusaConfig(num_heads=K, num_layers=n, share_lm_head=shared), target.model.config, lm)
    heads.load_state_dict(state, strict=True)
    return heads.to(next(v.dtype for v in sd.values() if v.is_floating_point())).eval()


def _load_mtp(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    from models.mtp import MTPConfig, MTPDrafter, init_from_native

    L = target.num_layers
    if fmt == "mtp_sglang_nextn":
        D = 1
        sd = {(f"model.layers.{L}." + k.removeprefix("model.layers.0.")): v for k, v in sd.items()}
    else:
        D = cfg["num_nextn_predict_layers"]
    drafter = MTPDrafter.from_target(MTPConfig(num_modules=D), target)
    if any(_FUSED.match(k) for k in drafter.state_dict()):
        sd = _fuse_experts(sd)
    dtype = next(v.dtype for v in sd.values() if v.is_floating_point())
    drafter.to(dtype)
    try:
        init_from_native(drafter, sd)
    except ValueError as e:
        raise ExportError(f"cannot load the MTP weights into this target's block: {e}") from None
    return drafter.eval()
