"""Medusa: build, check and load back the ``medusa_fasterdecoding`` (FasterDecoding, TensorRT-LLM) and
``medusa_vllm`` formats.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from models.core.spec import ExportFormat
from models.core.target import FrozenTarget
from models.export.shared.common import (
    DTYPE_NAMES,
    Bundle,
    ExportError,
    TargetInfo,
    Tensors,
    engine_target_name,
    fail,
    make_sidecar,
    require,
)
from models.export.shared.identity import STAMP_KEY, target_stamp
from models.export.shared.snippets import Serve, vllm_serve
from models.methods.medusa.config import MedusaConfig
from models.methods.medusa.net import MedusaHeads

# FasterDecoding's trainer saves this name; TensorRT-LLM's loader looks for it after medusa_lm_head.pt
# (NVIDIA/TensorRT-LLM tensorrt_llm/models/medusa/weight.py ``load_medusa_hf``).
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"


# ============================================================================================ build
def _check_heads(d: nn.Module, num_speculative_tokens: int) -> int:
    K = d.cfg.num_heads
    if num_speculative_tokens > K:
        raise ExportError(f"recommended num_speculative_tokens={num_speculative_tokens} exceeds the drafter's {K} "
                          "Medusa heads (head k drafts token k+1; vLLM proposes at most num_heads)")
    return num_speculative_tokens


def build_medusa_fasterdecoding(d: nn.Module, target: FrozenTarget, name: str, num_speculative_tokens: int,
                                 meta: dict | None) -> Bundle:
    num_speculative_tokens = _check_heads(d, num_speculative_tokens)
    cfg = {
        # FasterDecoding/Medusa medusa/model/medusa_model.py MedusaConfig: these three fields.
        "medusa_num_heads": d.cfg.num_heads, "medusa_num_layers": d.cfg.num_layers,
        "base_model_name_or_path": engine_target_name(name),
        # not read by FasterDecoding; lets the validator check shapes without the target
        "hidden_size": d.hidden_size, "vocab_size": d.vocab_size,
        "torch_dtype": DTYPE_NAMES.get(d._dtype(), "float32"),
        STAMP_KEY: target_stamp(target),  # identity.py: which target, from the export alone
    }
    # {h}.{l}.linear.{weight,bias} and {h}.{n}.weight: MedusaModel.medusa_head state dict (nn.Sequential of
    # ResBlocks + Linear) and TensorRT-LLM's load_medusa_hf (tensorrt_llm/models/medusa/weight.py).
    tensors = d.to_fasterdecoding_state_dict()
    side = make_sidecar("medusa_fasterdecoding", d, target, name, num_speculative_tokens, meta)
    return Bundle("medusa_fasterdecoding", cfg, tensors, side,
                   weights_file=MEDUSA_WEIGHTS)


def build_medusa_vllm(d: nn.Module, target: FrozenTarget, name: str,
                      num_speculative_tokens: int, meta: dict | None) -> Bundle:
    num_speculative_tokens = _check_heads(d, num_speculative_tokens)
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
        "torch_dtype": DTYPE_NAMES.get(d._dtype(), "float32"),
        STAMP_KEY: target_stamp(target),  # nested: the "num"+"heads" renaming only touches top-level keys
    }
    fd = d.to_fasterdecoding_state_dict()
    tensors = {}
    for h in range(K):
        for j in range(n):
            tensors[f"blocks.{h}.layers.{j}.weight"] = fd[f"{h}.{j}.linear.weight"]
            tensors[f"blocks.{h}.layers.{j}.bias"] = fd[f"{h}.{j}.linear.bias"]
        if not shared or h == 0:
            tensors[f"lm_heads.{h}.weight"] = fd[f"{h}.{n}.weight"]
    side = make_sidecar("medusa_vllm", d, target, name, num_speculative_tokens, meta)
    return Bundle("medusa_vllm", cfg, tensors, side)


# ============================================================================================ check
def check_medusa(fmt: str, cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None,
                  where: str) -> tuple[dict, dict]:
    if fmt == "medusa_fasterdecoding":
        K = require(cfg, "medusa_num_heads", where)
        n = require(cfg, "medusa_num_layers", where)
        name = require(cfg, "base_model_name_or_path", where, str)
        H = cfg.get("hidden_size") or (t.shapes.get("0.0.linear.weight") or t.shapes.get(f"0.{n}.weight")
                                       or (None, None))[-1]
        V = cfg.get("vocab_size") or (t.shapes.get(f"0.{n}.weight") or (None,))[0]
        if not H or not V:
            fail(where, f"cannot tell hidden/vocab size: config.json has none and head 0 lacks 0.{n}.weight")
        exp = {}
        for h in range(K):
            for j in range(n):
                exp[f"{h}.{j}.linear.weight"], exp[f"{h}.{j}.linear.bias"] = (H, H), (H,)
            exp[f"{h}.{n}.weight"] = (V, H)
    else:
        if cfg.get("architectures") != ["MedusaModel"]:
            fail(where, f"architectures must be ['MedusaModel'], got {cfg.get('architectures')}")
        clobber = [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)
                   and k not in ("num_heads", "num_hidden_layers")]
        if clobber:
            fail(where, f"config keys {clobber} would overwrite num_heads/num_hidden_layers in vLLM's "
                         "MedusaConfig.from_pretrained (it renames every key with 'num' and 'heads'/'layers')")
        K, n = require(cfg, "num_heads", where), require(cfg, "num_hidden_layers", where)
        H, V = require(cfg, "hidden_size", where), require(cfg, "vocab_size", where)
        if cfg.get("truncated_vocab_size", V) != V:
            fail(where, f"truncated_vocab_size={cfg.get('truncated_vocab_size')} needs a token_map; draftsmith "
                         f"heads score the full vocabulary ({V})")
        if n > 0 and cfg.get("medusa_fc_bias") is not True:
            fail(where, "medusa_fc_bias must be true: vLLM otherwise builds bias-free ResidualBlocks and drops "
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
        fail(where, f"medusa needs >= 1 head and >= 0 layers, got {K} heads, {n} layers")
    return exp, {"hidden_size": H, "vocab_size": V, "name": name}


# ============================================================================================ load back
def load_medusa(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
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


# ============================================================================================ README
def readme_medusa_vllm(cfg: dict, side: dict, s: Serve) -> list[str]:
    """vLLM 0.33.0 removed Medusa: the command pins the last release that loads it."""
    return ["## vLLM 0.32 and older only", "",
            "vLLM 0.33.0 removed Medusa (no method, model or config); this `MedusaModel` layout maps onto "
            "vLLM 0.32.0's loader (checked). On current vLLM serve an EAGLE-3 or MTP drafter instead; "
            "TensorRT-LLM reads the FasterDecoding layout (`--format medusa`).", "",
            "```bash", "pip install 'vllm<=0.32.0'", *vllm_serve(s, s.speculative_config("medusa")), "```", ""]


def readme_medusa_fasterdecoding(cfg: dict, side: dict, s: Serve) -> list[str]:
    """FasterDecoding's own loader and TensorRT-LLM's engine-build route (no vLLM command: see medusa_vllm)."""
    return ["## FasterDecoding/Medusa", "", "```python",
            "from medusa.model.medusa_model import MedusaModel",
            f"model = MedusaModel.from_pretrained('{s.path}')  # base model: {s.target}", "```", "",
            "TensorRT-LLM (engine-build route): `python examples/medusa/convert_checkpoint.py --model_dir "
            f"{s.target} --medusa_model_dir {s.path} --num_medusa_heads {cfg['medusa_num_heads']} "
            f"--num_medusa_layers {cfg['medusa_num_layers']} --output_dir ckpt --dtype float16` "
            "(its weight.py reads medusa_lm_head.safetensors; TensorRT-LLM version not checked by "
            "draftsmith). vLLM 0.33.0 removed Medusa: `--format medusa-vllm` is for vLLM <= 0.32; on "
            "current vLLM use EAGLE-3 or MTP. SGLang has no Medusa support.", ""]


# the engine formats this method's drafters export to (SPEC.export_formats; detect() is tried in this order)
FORMATS = (
    ExportFormat("medusa_fasterdecoding", "medusa", "medusa", "FasterDecoding/Medusa, TensorRT-LLM",
                 build_medusa_fasterdecoding, partial(check_medusa, "medusa_fasterdecoding"),
                 partial(load_medusa, "medusa_fasterdecoding"),
                 lambda cfg, p: (p / MEDUSA_WEIGHTS).exists() or "medusa_num_heads" in cfg, MEDUSA_WEIGHTS,
                 readme=readme_medusa_fasterdecoding),
    ExportFormat("medusa_vllm", "medusa-vllm", "medusa", "vLLM (medusa)",
                 build_medusa_vllm, partial(check_medusa, "medusa_vllm"), partial(load_medusa, "medusa_vllm"),
                 lambda cfg, _p: cfg.get("model_type") == "medusa", readme=readme_medusa_vllm,
                 vllm_method="medusa"),
)
