"""MTP weights in the DeepSeek-V3 checkpoint layout (``model.layers.{L+d}.…``): ours → native and back.

What a target's own MTP layers (config ``num_nextn_predict_layers``) load from, and what the mtp_deepseek /
mtp_sglang_nextn exports (export.py) write.
"""

from __future__ import annotations

import re

import torch

from models.methods.mtp.net import MTPDrafter

_OWN_PREFIXES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the target's, shipped per layer
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _native_to_ours(suffix: str) -> str:
    return suffix if suffix.startswith(_OWN_PREFIXES) else f"block.{suffix}"


def _ours_to_native(suffix: str) -> str:
    return suffix.removeprefix("block.")


def to_native_state_dict(drafter: MTPDrafter, include_shared: bool = True) -> dict[str, torch.Tensor]:
    """Our weights in the DeepSeek layout ``model.layers.{L+d}.…`` (with the per-layer copies of the
    shared embedding and head when ``include_shared``)."""
    L = drafter.num_target_layers
    out: dict[str, torch.Tensor] = {}
    for name, t in drafter.state_dict().items():
        if not name.startswith("mtp."):
            continue
        _, d, suffix = name.split(".", 2)
        out[f"model.layers.{L + int(d)}.{_ours_to_native(suffix)}"] = t.detach().clone()
    if include_shared:
        for d in range(drafter.cfg.num_modules):
            out[f"model.layers.{L + d}.embed_tokens.weight"] = drafter.embed_weight.detach().clone()
            out[f"model.layers.{L + d}.shared_head.head.weight"] = drafter.lm_head_weight.detach().clone()
    return out


def init_from_native(drafter: MTPDrafter, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a target's native MTP weights (config ``num_nextn_predict_layers``; DeepSeek layout
    ``model.layers.{L+d}.{enorm,hnorm,eh_proj,shared_head.norm,self_attn…,mlp…,*_layernorm}``).

    ``state_dict`` may be the whole checkpoint: keys outside ``model.layers.{j}`` with j ≥ L belong to the
    main model and are ignored. Every MTP key must map to a drafter weight of the same shape and every
    drafter weight must be provided; the per-layer copies of the embedding/lm_head must equal the target's
    (draftsmith shares the target's, frozen). Anything else raises a one-line ValueError.
    """
    L, D = drafter.num_target_layers, drafter.cfg.num_modules
    expected = {n: t for n, t in drafter.state_dict().items() if n.startswith("mtp.")}
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    shared = {"embed_tokens.weight": drafter.embed_weight, "shared_head.head.weight": drafter.lm_head_weight}
    for key, t in state_dict.items():
        m = _LAYER_KEY.match(key)
        if m is None or int(m.group(1)) < L:
            continue  # main-model weight
        d, suffix = int(m.group(1)) - L, m.group(2)
        if suffix in _SHARED:
            ref = shared[suffix]
            if tuple(t.shape) != tuple(ref.shape) or not torch.equal(t.to(ref.device, ref.dtype), ref):
                raise ValueError(f"native MTP {key} differs from the target's {suffix.split('.')[0]}; "
                                 "draftsmith shares the target's frozen weights")
            continue
        ours = f"mtp.{d}.{_native_to_ours(suffix)}"
        if d >= D or ours not in expected:
            unexpected.append(key)
        else:
            mapped[ours] = t
    missing = sorted(set(expected) - set(mapped))
    if unexpected:
        raise ValueError(f"native MTP weights have {len(unexpected)} unexpected keys for num_modules={D} "
                         f"after {L} target layers, e.g. {unexpected[:3]}")
    if missing:
        native = [f"model.layers.{L + int(n.split('.')[1])}.{_ours_to_native(n.split('.', 2)[2])}" for n in missing]
        raise ValueError(f"native MTP weights are missing {len(missing)} keys, e.g. {native[:3]}")
    bad = [f"{n} {tuple(t.shape)} vs {tuple(expected[n].shape)}" for n, t in mapped.items()
           if tuple(t.shape) != tuple(expected[n].shape)]
    if bad:
        raise ValueError(f"native MTP weight shapes differ from the drafter's: {bad[:3]}")
    drafter.load_state_dict(mapped, strict=True)
