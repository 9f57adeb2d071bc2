"""conf/eval.yaml's method rows, generated from the registry: the specs are their only source.

``register()`` stores the node ``eval_methods`` in Hydra's ConfigStore; conf/eval.yaml's defaults list pulls it in
(``python -m eval`` registers it before composing, from the registry as it is then):

    methods      every registered proposer followed by its variants, in registry order (AR, the baseline, first)
    checkpoints  {trained method: ``MethodSpec.eval_path()``} (runs/<name>/final unless the spec names another)
    draft_model  the separate draft model's default path (the source="model" method's ``MethodSpec.default_path``)
    options      {proposer: ``ProposerSpec.defaults``}
    variants     {name: {method: proposer, option: value}} (``ProposerSpec.variants``)

The keys exist in the composed config, so the command line overrides them like any other key
(``options.eagle3.num_speculative_tokens=4``, ``checkpoints.eagle3=runs/x/final``, ``methods=[ar,eagle3]``,
``draft_model=null``, ``+variants.fast={method: eagle3, num_speculative_tokens: 2}``). An option no spec declares is
a one-line error naming the known ones: ``python -m eval`` checks ``options.<method>.<option>`` overrides before
Hydra composes (eval/__main__.py), and a ``+``-added one fails in the harness.
"""

from __future__ import annotations

from typing import Any

NODE = "eval_methods"


def eval_defaults() -> dict[str, Any]:
    """The node's content, read from models/registry.py now (a method registered later is in the next call)."""
    from models import registry

    table = registry.proposers()
    variants = registry.variants()
    methods = [n for name, (_, p) in table.items() for n in (name, *p.variants)]
    out: dict[str, Any] = {
        "methods": methods,
        "checkpoints": {s.name: s.eval_path() for s in registry.METHODS.values() if s.source == "checkpoint"},
    }
    # a separate-model method's path is a top-level key named after it (``draft_model=...`` on the command line)
    out.update({s.name: s.eval_path() for s in registry.METHODS.values() if s.source == "model"})
    out["options"] = {name: dict(p.defaults) for name, (_, p) in table.items()}
    out["variants"] = variants
    return out


def register() -> None:
    """Store (or replace) the ``eval_methods`` node in Hydra's ConfigStore, for conf/eval.yaml to compose."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=NODE, node=eval_defaults())
