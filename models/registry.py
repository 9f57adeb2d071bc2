"""The draft methods, by name: one explicit table (no decorators, no plugin discovery).

Adding a method = its package ``models/methods/<name>/`` exporting ``SPEC`` (models/core/spec.py) +
``conf/draft/<name>.yaml`` + one line here (tests/test_new_method.py proves it with a test-only one).
train/ (build, after-training step), eval/ (proposers, options, tree sizing) and train/export read methods
only through this module.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import Any

from torch import nn

from models.core.checkpoint import WEIGHTS, load_trainable_state, read_meta
from models.core.spec import MethodSpec, ProposerSpec
from models.core.target import FrozenTarget
from models.methods import ar, dflash, draft_model, eagle3, medusa, mtp, ngram, peagle

# the order is eval's default method order (conf/eval.yaml ``methods``): the AR baseline, the model-free and
# separate-model methods, then the trained drafters
METHODS: dict[str, MethodSpec] = {
    "ar": ar.SPEC,
    "ngram": ngram.SPEC,
    "draft_model": draft_model.SPEC,
    "eagle3": eagle3.SPEC,
    "medusa": medusa.SPEC,
    "mtp": mtp.SPEC,
    "dflash": dflash.SPEC,
    "peagle": peagle.SPEC,
}
if os.environ.get("DRAFTSMITH_TOY_METHOD") == "1":  # test-only: tests/test_new_method.py's fifth method
    METHODS["toy"] = importlib.import_module("models.methods.toy").SPEC


def method(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ValueError(f"unknown draft method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]


def trainable_methods() -> list[str]:
    return [n for n, s in METHODS.items() if s.source == "checkpoint"]


def proposers() -> dict[str, tuple[MethodSpec, ProposerSpec]]:
    """Every decode-time method eval can run, by its eval name (``eagle3``, ``eagle3_tree``, ``ngram``, …)."""
    return {p.name: (s, p) for s in METHODS.values() for p in s.proposers}


def proposer(name: str) -> tuple[MethodSpec, ProposerSpec]:
    table = proposers()
    if name not in table:
        raise ValueError(f"unknown method {name!r}; use any of {list(table)}")
    return table[name]


def baseline() -> ProposerSpec:
    """The proposer every method is measured and checked against (``ProposerSpec.baseline``: AR)."""
    found = [p for _, p in proposers().values() if p.baseline]
    if len(found) != 1:
        raise ValueError(f"the registry needs exactly one baseline proposer, has {[p.name for p in found]}")
    return found[0]


def variants() -> dict[str, dict[str, Any]]:
    """Every proposer's declared variants, in registry order: {name: {"method": proposer name, option: value}}."""
    return {v: {"method": p.name, **dict(o)} for _, p in proposers().values() for v, o in p.variants.items()}


def config_from_dict(spec: MethodSpec, d: dict) -> Any:
    """A method's config dataclass from a checkpoint's stored dict (fields it does not declare are ignored)."""
    d = {**spec.checkpoint_defaults, **d}
    return spec.config(**{f.name: d[f.name] for f in dataclasses.fields(spec.config) if f.name in d})


def build_drafter(method_name: str, cfg: Any, target: FrozenTarget, train_rows: list[dict]) -> nn.Module:
    spec = method(method_name)
    if spec.source != "checkpoint":
        raise ValueError(f"{method_name} has nothing to train (it drafts without a trained drafter); "
                         f"trainable: {trainable_methods()}")
    if not isinstance(cfg, spec.config):
        raise ValueError(f"draft.config is a {type(cfg).__name__}, {method_name} needs {spec.config.__name__}; "
                         f"use draft={method_name} (or a recipe that pins it)")
    if spec.check_config is not None:  # the checks train/checks.py ran on the yaml, for a config built in code
        spec.check_config(dataclasses.asdict(cfg), None)
    return spec.build(cfg, target, train_rows)


def check_same_target(meta: dict, target: FrozenTarget, path: Path) -> None:
    """Refuse a drafter trained for another target (shape or weights), naming what differs."""
    want, have = meta.get("target", {}), target.identity()
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "embed_fingerprint"):
        if want.get(key) != have.get(key) and not (key == "embed_fingerprint"
                                                   and want.get(key) == target.legacy_fingerprint()):
            raise ValueError(f"{path} was trained for another target ({key}: {want.get(key)} != {have.get(key)}; "
                             f"trained on {want.get('name_or_path')!r}); load it with that target")


def load_drafter(path: str | Path, target: FrozenTarget) -> tuple[nn.Module, dict]:
    """Rebuild a drafter from a checkpoint directory written by train/ (config.json + model.safetensors)."""
    path = Path(path)
    if not (path / WEIGHTS).exists():
        raise FileNotFoundError(f"{path} is not a drafter checkpoint (no {WEIGHTS}); pass OUTPUT_DIR/final")
    meta = read_meta(path)
    check_same_target(meta, target, path)
    try:
        spec = method(meta.get("method"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    module = spec.rebuild(config_from_dict(spec, meta["draft"]), target)
    load_trainable_state(module, path / WEIGHTS)
    return module.eval(), meta


def make_proposer_factory(name: str, drafter: Any, target: FrozenTarget, checkpoint: str | None = None,
                          options: dict | None = None) -> tuple[Any, dict]:
    """(make, options) for eval method ``name``: ``make(num_speculative_tokens=None)`` → a fresh proposer (a
    number overrides the chain's length). The method's ``prepare`` step runs now and one proposer is built, so bad
    options fail here."""
    _, p = proposer(name)
    o = p.options(options)
    if p.prepare is not None:
        o = p.prepare(drafter, checkpoint, o)
    make = factory(p, drafter, target, o)
    make(None)
    return make, o


def factory(p: ProposerSpec, drafter: Any, target: FrozenTarget, o: dict):
    def make(num_speculative_tokens: int | None = None):
        kw = {key: v for key, v in o.items() if key in p.defaults}
        if num_speculative_tokens is not None and p.chain:
            kw["num_speculative_tokens"] = num_speculative_tokens
        return p.make(drafter, target, **kw)
    return make


def load_proposer(path: str | Path, target: FrozenTarget, name: str | None = None, **options) -> Any:
    """A proposer from a trained drafter checkpoint (``load_drafter`` refuses one made for another target).
    ``name``: which of the method's proposers (default its first, e.g. the EAGLE-3 chain; ``eagle3_tree``)."""
    drafter, meta = load_drafter(path, target)
    spec = method(meta["method"])
    name = name or spec.proposers[0].name
    if name not in [p.name for p in spec.proposers]:
        raise ValueError(f"{path} is a {spec.name} drafter; its proposers are {[p.name for p in spec.proposers]}")
    make, _ = make_proposer_factory(name, drafter, target, str(path), options)
    return make(None)
