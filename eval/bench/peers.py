"""HF peers (T = 0): plain greedy ``generate``, prompt lookup with our n-gram settings and assisted generation
with our draft model, run on the raw target, and their summaries against our AR.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from eval.bench.setup import BenchSettings, Method
from eval.bench.stats import stats_of, tps_of
from eval.decode.result import device_time
from models import registry
from models.core.target import FrozenTarget


def hf_generate(target: FrozenTarget, ids: Tensor, s: BenchSettings, eos: int | None,
                 extra: Mapping[str, Any]) -> tuple[list[int], float]:
    """One greedy HF ``generate`` on the raw target (``extra``: prompt lookup / assistant settings)."""
    from transformers import GenerationConfig

    cfg = target.model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos if eos is not None else 0)
    # eos None means "never stop": an empty list, because transformers fills an unset eos_token_id from the
    # model's generation_config.json (SmolLM2's <|im_end|>) and would stop there while our methods go on
    gc = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False,
                          eos_token_id=eos if eos is not None else [], pad_token_id=pad,
                          **{k: v for k, v in extra.items() if k != "assistant_model"})
    device = ids.device
    t = device_time(device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                assistant_model=extra.get("assistant_model"))
    dt = device_time(device) - t
    return out[0, ids.shape[1]:].tolist(), dt


def peer_runs(methods: Sequence[Method]) -> list[tuple[str, dict]]:
    """HF peers: plain greedy generate, prompt lookup with our n-gram settings, assisted generation with our
    draft model (HF's own num_assistant_tokens schedule: what a user of generate() gets)."""
    peers = [("hf_greedy", {})]
    for name, (spec, p) in registry.proposers().items():  # each method's HF twin (ProposerSpec.hf_peer)
        if p.hf_peer is None:
            continue
        m = next((m for m in methods if m.kind == name), None)
        if m is not None:  # with the settings and model under test
            peers.append(p.hf_peer(m.options, m.model))
        elif spec.source == "none":  # a model-free twin runs even when its method is not benchmarked
            peers.append(p.hf_peer(p.defaults, None))
    return peers


def peer_summaries(single: dict, s: BenchSettings) -> dict:
    reps = range(s.repetitions)
    out = {}
    base = single["baseline"]  # our AR: the peers' tokens and speed are compared with it
    ar0 = single["tokens0"][base]
    for name, extra in single["peers"]:
        key = (name, 0.0)
        out[name] = {
            "temperature": 0.0,
            "settings": {k: (v if k != "assistant_model" else getattr(v.config, "_name_or_path", "") or "draft_model")
                         for k, v in extra.items()},
            "tokens_per_s": stats_of([tps_of(single, key, r) for r in reps]),
            "speedup_vs_ar": stats_of([tps_of(single, key, r) / tps_of(single, (base, 0.0), r) for r in reps]),
            "matches_ar": all(a == b for rep, toks in enumerate(single["tokens0"][name])
                              for a, b in zip(ar0[rep], toks)),
        }
    return out
