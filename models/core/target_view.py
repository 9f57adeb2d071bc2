"""A weights-light view of a target for export and ``--check``: its config, tokenizer, embedding and lm_head only.

Exporting a drafter, or validating an export, needs the target's config (shapes, family, RoPE), its decoder-layer
and rotary classes (MTP's block), its tokenizer (the draft vocabulary's ids) and two matrices: the embedding
(fingerprint, EAGLE-3/MTP/DFlash's shared embedding) and lm_head (Medusa, MTP, DFlash). Loading the whole model
for that costs hundreds of GB for a 70B target. ``TargetView`` is a ``FrozenTarget`` whose decoder is built on
the ``meta`` device from the config (no memory, no weights read) and whose embedding / lm_head are the only
tensors read, with safetensors partial reads from the (possibly sharded) checkpoint files. Everything the
exporters, the registry's rebuild and the validator read from a FrozenTarget is therefore there and identical
(same config, same fingerprint, same weights in the same dtype); running it is not (``forward`` refuses).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from models.core.target import FrozenTarget, check_finite_weights, check_target_path, parse_dtype

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class TargetView(FrozenTarget):
    """A FrozenTarget with only its embedding and lm_head in memory (the decoder lives on the meta device)."""

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False,
                        device: str = "cpu") -> TargetView:
        path = check_target_path(name_or_path)
        dt = parse_dtype("float32" if dtype == "auto" else dtype)  # shapes and rows only: no step to time
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dt, trust_remote_code=trust_remote_code)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is None or head is None:
            raise TypeError(f"{type(model).__name__} has no input/output embedding to read")
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        tied = head.weight is embed.weight  # transformers ties them when the config says so
        keys = [f"{names[id(embed)]}.weight"] + ([] if tied else [f"{names[id(head)]}.weight"])
        got = read_tensors(path, keys)
        check_finite_weights(got.items(), name_or_path, path)
        w = nn.Parameter(got[keys[0]].to(device=device, dtype=dt), requires_grad=False)
        embed.weight = w
        head.weight = w if tied else nn.Parameter(got[keys[1]].to(device=device, dtype=dt), requires_grad=False)
        return cls(model, tok)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a TargetView holds only the target's embedding and lm_head (for export/--check); "
                           "load FrozenTarget.from_pretrained to run the target")


def read_tensors(path: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """``keys`` from a model's safetensors (one file or an index of shards), reading only those tensors.

    A key the module names differently from the file (a family whose checkpoint prefixes differ) is found by its
    unique suffix (e.g. ``embed_tokens.weight``)."""
    index = _cached(path, INDEX)
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
    else:
        single = _cached(path, SINGLE)
        if single is None:
            raise FileNotFoundError(f"target {path}: neither {SINGLE} nor {INDEX} found (safetensors weights needed)")
        with safe_open(single, framework="pt") as f:
            weight_map = {k: SINGLE for k in f.keys()}
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        stored = _stored_name(key, weight_map, path)
        file = _cached(path, weight_map[stored])
        if file is None:
            raise FileNotFoundError(f"target {path}: shard {weight_map[stored]} (holding {stored}) is missing")
        with safe_open(file, framework="pt") as f:
            out[key] = f.get_tensor(stored)
    return out


def _stored_name(key: str, weight_map: dict[str, str], path: str) -> str:
    if key in weight_map:
        return key
    tail = ".".join(key.split(".")[-2:])
    hits = [k for k in weight_map if k == tail or k.endswith("." + tail)]
    if len(hits) != 1:
        raise KeyError(f"target {path}: the checkpoint has no tensor {key!r} "
                       f"({'several match ' + str(hits[:4]) if hits else 'none ends in ' + repr(tail)})")
    return hits[0]


def _cached(path: str, filename: str) -> str | None:
    """A file of a local model directory or of a hub repo (downloaded alone, not the whole repo); None if absent."""
    p = Path(path).expanduser()
    if p.is_dir():
        f = p / filename
        return str(f) if f.is_file() else None
    from transformers.utils import cached_file

    return cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
