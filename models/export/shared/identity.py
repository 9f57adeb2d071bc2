"""The target's identity written into every exported ``config.json`` (key ``draftsmith_target``) and its checks.

``draftsmith.json`` says which target an export is for, but it is a separate file that gets lost when a
directory is copied to a model hub or a server (only config.json + weights travel). The stamp lives in the
config the engines parse anyway; they ignore unknown keys (transformers' PretrainedConfig keeps them as
attributes; speculators' pydantic config has ``extra="allow"``; vLLM's MedusaConfig renames only top-level keys
containing "num"). With it the validator identifies the target from the export alone: architecture, layer
count, hidden/vocab size and the embedding fingerprint — plus, for EAGLE-3, the aux-layer ids and a hash of the
draft vocabulary the drafter was exported with.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from models.export.shared.common import TargetInfo, fail

STAMP_KEY = "draftsmith_target"

# SGLang families whose set_eagle3_layers_to_capture adds 1 only when the first id is 1 (PR #25454,
# deepseek_v2.py / glm4_moe_lite.py); Llama (llama.py) and the others add 1 always.
SGLANG_PLUS1_IF_FIRST_IS_1 = ("deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite")


def sglang_reads(sg_ids: list[int], model_type: str | None) -> list[int]:
    """The capture ids (our convention) SGLang 0.5.23 derives from eagle_config ids for a target family."""
    if model_type in SGLANG_PLUS1_IF_FIRST_IS_1 and sg_ids and sg_ids[0] != 1:
        return list(sg_ids)
    return [i + 1 for i in sg_ids]


def vocab_hash(d2t: torch.Tensor) -> str:
    """Identifies a draft vocabulary (d2t fixes t2d: check_mapping refuses any other)."""
    return hashlib.sha256(d2t.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def target_stamp(target: Any, **extra: Any) -> dict:
    """The stamp for a FrozenTarget (architectures, model_type, layers, sizes, embedding fingerprint) + extra."""
    c = target.model.config
    return {"architectures": list(getattr(c, "architectures", None) or []),
            "model_type": getattr(c, "model_type", None), "num_hidden_layers": int(c.num_hidden_layers),
            "hidden_size": int(c.hidden_size),
            "vocab_size": int(c.vocab_size), "embed_fingerprint": target.fingerprint(), **extra}


def stamp_of(cfg: Mapping) -> dict:
    s = cfg.get(STAMP_KEY)
    return s if isinstance(s, dict) else {}


def check_stamp(cfg: Mapping, dims: Mapping, target: TargetInfo | None, where: str) -> bool:
    """Refuse an export whose stamp names another target or contradicts its own config/tensors.

    Returns True when the target's embedding itself was compared (the name may then differ in spelling only).
    """
    st = stamp_of(cfg)
    if not st:
        return False  # exported before the stamp existed: draftsmith.json and the names remain the evidence
    for key in ("hidden_size", "vocab_size"):
        if st.get(key) is not None and dims.get(key) is not None and int(st[key]) != int(dims[key]):
            fail(where, f"config.json {STAMP_KEY}.{key} is {st[key]} but the tensors/config say {dims[key]}")
    if target is None:
        return False
    tc = target.config
    get = tc.get if isinstance(tc, Mapping) else (lambda k, d=None: getattr(tc, k, d))
    have = {"num_hidden_layers": target.num_hidden_layers, "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size, "model_type": get("model_type", None),
            "architectures": list(get("architectures", None) or []) or None, "embed_fingerprint": target.fingerprint}
    for key, h in have.items():
        if st.get(key) not in (None, []) and h is not None and st[key] != h:
            fail(where, f"exported for another target: {key} {st[key]} != the target's {h} (config.json "
                         f"{STAMP_KEY})")
    return st.get("embed_fingerprint") is not None and target.fingerprint is not None


def model_type_of(target: TargetInfo | None, st: dict) -> str | None:
    tc = target.config if target is not None else None
    mt = (tc.get("model_type") if isinstance(tc, dict) else getattr(tc, "model_type", None)) if tc is not None else None
    return mt or st.get("model_type")


def warn_sglang_family(sg: list[int], top: list[int], model_type: str | None, where: str) -> None:
    """SGLang 0.5.23 reads eagle_config ids per target family (see models/methods/eagle3/check.py): warn when it would
    capture other layers than vLLM and the drafter (the file is right for vLLM, so this is not a refusal)."""
    got = sglang_reads(sg, model_type)
    if model_type in SGLANG_PLUS1_IF_FIRST_IS_1 and got != top:
        warnings.warn(f"{where}: SGLang 0.5.23 adds 1 to eagle_config ids for {model_type} targets only when the "
                      f"first id is 1, so it would capture layers {got} instead of {top}; serve with vLLM or retrain "
                      "with layer ids starting at 2 (the default)", UserWarning, stacklevel=2)


def check_vocab_against_target(d2t: torch.Tensor, st: dict, target: TargetInfo | None, where: str) -> None:
    """The draft vocabulary must be the one exported with lm_head's rows, and consist of ids the target's
    tokenizer can produce (a self-consistent mapping built for another vocabulary passes check_mapping)."""
    if st.get("draft_vocab") is not None and vocab_hash(d2t) != st["draft_vocab"]:
        fail(where, f"d2t/t2d are not the draft vocabulary lm_head.weight was exported with ({STAMP_KEY}."
                     "draft_vocab differs): a mapping from another vocabulary or data set; re-export the drafter")
    tok = getattr(target.frozen, "tokenizer", None) if target is not None and target.frozen is not None else None
    if tok is not None:
        n = len(tok)
        top = int((d2t + torch.arange(d2t.numel())).max())
        if top >= n:
            fail(where, f"d2t maps to target id {top}, beyond the target tokenizer's {n} tokens: the draft "
                         "vocabulary was built for another vocabulary")
