"""The export formats, by name: one explicit table (the export-side twin of models/registry.py).

Each row says which method's drafters it holds, how to build it (config + tensors), check it (expected tensor
shapes from its config.json), load it back into draftsmith's module, and recognise it on disk. A method's
``SPEC.export_formats`` names its rows; a new format is its functions in a family module + one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .common import MEDUSA_WEIGHTS, WEIGHTS, ExportError
from .dflash import (
    build_dflash_speculators,
    build_dflash_zlab,
    build_dspark_speculators,
    build_dspark_zlab,
    check_dflash,
    load_dflash,
)
from .eagle3 import build_eagle3_native, build_eagle3_speculators, check_eagle3, load_eagle3
from .medusa import build_medusa_fasterdecoding, build_medusa_vllm, check_medusa, load_medusa
from .mtp import build_mtp_deepseek, build_mtp_sglang_nextn, check_mtp, load_mtp
from .peagle import build_peagle_speculators, check_peagle, load_peagle


@dataclass(frozen=True)
class ExportFormat:
    """``build(drafter, target, target_name, k, meta) → Bundle``; ``check(cfg, tensors, sidecar, target, where)
    → (expected shapes, target dims)``; ``load(cfg, state_dict, target) → module``; ``detect(cfg, dir)`` → bool
    (tried in table order, so a more specific format comes first)."""

    name: str
    cli: str
    method: str
    served_by: str
    build: Callable
    check: Callable
    load: Callable
    detect: Callable[[dict, Path], bool]
    weights_file: str = WEIGHTS


def _arch(cfg: dict) -> list[str]:
    return list(cfg.get("architectures") or [])


EXPORT_FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat("eagle3_native", "eagle3", "eagle3", "SGLang (EAGLE3), vLLM (eagle3)",
                 build_eagle3_native, partial(check_eagle3, "eagle3_native"), partial(load_eagle3, "eagle3_native"),
                 lambda cfg, _p: "LlamaForCausalLMEagle3" in _arch(cfg)),
    ExportFormat("eagle3_speculators", "eagle3-speculators", "eagle3", "vLLM (speculators format)",
                 build_eagle3_speculators, partial(check_eagle3, "eagle3_speculators"),
                 partial(load_eagle3, "eagle3_speculators"),
                 lambda cfg, _p: "Eagle3Speculator" in _arch(cfg) or cfg.get("speculators_model_type") == "eagle3"),
    ExportFormat("medusa_fasterdecoding", "medusa", "medusa", "FasterDecoding/Medusa, TensorRT-LLM",
                 build_medusa_fasterdecoding, partial(check_medusa, "medusa_fasterdecoding"),
                 partial(load_medusa, "medusa_fasterdecoding"),
                 lambda cfg, p: (p / MEDUSA_WEIGHTS).exists() or "medusa_num_heads" in cfg, MEDUSA_WEIGHTS),
    ExportFormat("medusa_vllm", "medusa-vllm", "medusa", "vLLM (medusa)",
                 build_medusa_vllm, partial(check_medusa, "medusa_vllm"), partial(load_medusa, "medusa_vllm"),
                 lambda cfg, _p: cfg.get("model_type") == "medusa"),
    ExportFormat("mtp_sglang_nextn", "mtp-nextn", "mtp", "SGLang (NEXTN) for DeepSeek-V3 targets",
                 build_mtp_sglang_nextn, partial(check_mtp, "mtp_sglang_nextn"),
                 partial(load_mtp, "mtp_sglang_nextn"),
                 lambda cfg, _p: "DeepseekV3ForCausalLMNextN" in _arch(cfg)),
    ExportFormat("mtp_deepseek", "mtp", "mtp", "vLLM (mtp) for DeepSeek-V3 targets",
                 build_mtp_deepseek, partial(check_mtp, "mtp_deepseek"), partial(load_mtp, "mtp_deepseek"),
                 lambda cfg, _p: bool(cfg.get("num_nextn_predict_layers"))),
    ExportFormat("dflash_speculators", "dflash-speculators", "dflash", "vLLM (dflash, speculators format)",
                 build_dflash_speculators, partial(check_dflash, "dflash_speculators"),
                 partial(load_dflash, "dflash_speculators"),
                 lambda cfg, _p: "DFlashSpeculator" in _arch(cfg) or cfg.get("speculators_model_type") == "dflash"),
    ExportFormat("dflash_zlab", "dflash", "dflash", "SGLang (DFLASH), z-lab layout",
                 build_dflash_zlab, partial(check_dflash, "dflash_zlab"), partial(load_dflash, "dflash_zlab"),
                 lambda cfg, _p: "DFlashDraftModel" in _arch(cfg)),
    # DSpark = a DFlash drafter with block_head=markov, sample_from_anchor=true (the same method)
    ExportFormat("dspark_speculators", "dspark-speculators", "dflash", "vLLM (dspark, speculators format)",
                 build_dspark_speculators, partial(check_dflash, "dspark_speculators"),
                 partial(load_dflash, "dspark_speculators"),
                 lambda cfg, _p: "DSparkSpeculator" in _arch(cfg) or cfg.get("speculators_model_type") == "dspark"),
    ExportFormat("dspark_zlab", "dspark", "dflash", "SGLang (DSPARK), z-lab / SpecForge layout",
                 build_dspark_zlab, partial(check_dflash, "dspark_zlab"), partial(load_dflash, "dspark_zlab"),
                 lambda cfg, _p: "DSparkDraftModel" in _arch(cfg)),
    ExportFormat("peagle_speculators", "peagle-speculators", "peagle", "vLLM (eagle3 + parallel_drafting)",
                 build_peagle_speculators, lambda cfg, t, side, target, where: check_peagle(cfg, t, side, target,
                                                                                             where),
                 lambda cfg, sd, target: load_peagle(cfg, sd, target),
                 lambda cfg, _p: "PEagleSpeculator" in _arch(cfg) or cfg.get("speculators_model_type") == "peagle"),
)}
# Snapshots of the shipped rows (the CLI's choices, docs). The export API reads EXPORT_FORMATS itself, through
# export_format / detect_format, so a row added to the table later (a new method's exporter, a test) works too.
FORMATS = tuple(EXPORT_FORMATS)
CLI_FORMATS = {f.cli: f.name for f in EXPORT_FORMATS.values()}  # CLI spelling → format
METHOD_OF = {f.name: f.method for f in EXPORT_FORMATS.values()}


def export_format(fmt: str) -> ExportFormat:
    """A format by name or CLI spelling; an unknown one is a one-line error listing the known ones."""
    cli = {f.cli: f.name for f in EXPORT_FORMATS.values()}
    fmt = cli.get(fmt, fmt)
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {tuple(EXPORT_FORMATS)} (CLI: {sorted(cli)})")
    return EXPORT_FORMATS[fmt]


def detect_format(path: str | Path, cfg: dict) -> ExportFormat:
    path = Path(path)
    for f in EXPORT_FORMATS.values():
        if f.detect(cfg, path):
            return f
    raise ExportError(f"{path}: config.json matches no export format (architectures {_arch(cfg)}, "
                      f"model_type {cfg.get('model_type')!r}); expected one of {tuple(EXPORT_FORMATS)}")
