"""The entry points: ``export`` (build, validate in memory, write atomically, re-validate) and ``load_export``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from models import registry
from models.core.checkpoint import out_of_space_as_error
from models.core.target import FrozenTarget
from models.export.shared.common import (
    CONFIG,
    DTYPE_NAMES,
    README,
    SIDECAR,
    Bundle,
    ExportError,
    Tensors,
    engine_target_name,
    load_json,
    target_info,
)
from models.export.shared.identity import STAMP_KEY

from .formats import export_format, export_formats
from .readme import render_readme
from .serving import SERVING_KEY, serving_manifest
from .validate import check_export, validate


# ============================================================================================ writing
def export(drafter: nn.Module, fmt: str, out: str | Path, target: FrozenTarget, *, target_name: str | None = None,
           num_speculative_tokens: int | None = None, meta: dict | None = None, dtype: torch.dtype | None = None,
           overwrite: bool = False, serve_name: str | None = None, measured: dict | None = None) -> Path:
    """Write ``drafter`` (trained for ``target``) to ``out`` in ``fmt`` (one of FORMATS or a CLI name).

    ``target_name``: how engines should find the target (default: the target config's name_or_path).
    ``num_speculative_tokens``: K for the engine configs and serving snippets (e.g. an eval results JSON's
    recommended one); default: the method's ``default_num_speculative_tokens`` (models/core/spec.py).
    ``dtype``: cast float weights (default: keep the trained dtype; d2t/t2d are never cast).
    ``serve_name``: the target as the engine-read fields (speculators ``verifier.name_or_path``, Medusa's
    ``base_model_name_or_path``) and the README's serve commands name it (default: ``engine_target_name`` of the
    target name: a hub id, never an absolute path of the training machine).
    ``measured``: the engine configuration that served this method fastest (common.engine_best), for the README.
    The export is validated in memory first, written atomically, then validated again from disk.
    """
    spec = export_format(fmt)
    fmt = spec.name
    method = drafter.config_dict().get("method")
    if method != spec.method:
        raise ExportError(f"format {fmt} is for {spec.method} drafters, this one is {method}")
    if num_speculative_tokens is not None and (not isinstance(num_speculative_tokens, int)
                                               or num_speculative_tokens < 1):
        raise ExportError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
    name = target_name or getattr(target.model.config, "_name_or_path", "") or "UNKNOWN-TARGET"
    n, default = num_speculative_tokens, registry.method(spec.method).default_num_speculative_tokens
    if n is None and default is not None:  # no eval results: the method's own default
        n = default(drafter)
    bundle = spec.build(drafter, target, name, n, meta)
    bundle.sidecar["k_from_results"] = num_speculative_tokens is not None
    if measured:
        bundle.sidecar["measured_best"] = measured
    _set_serve_name(bundle, serve_name or engine_target_name(name))
    bundle.sidecar["serve_name_from_user"] = serve_name is not None  # a path set on purpose is not warned about
    bundle.sidecar[SERVING_KEY] = serving_manifest(target, meta)  # target revision, chat template, thinking mode
    if isinstance(bundle.config.get(STAMP_KEY), dict):  # config.json travels where draftsmith.json may not
        bundle.config[STAMP_KEY][SERVING_KEY] = bundle.sidecar[SERVING_KEY]
    if dtype is not None:
        bundle.tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in bundle.tensors.items()}
        _set_dtype(bundle, dtype)
    info = target_info(target)
    check_export(bundle.fmt, bundle.config, Tensors.of(bundle.tensors), bundle.sidecar, info, f"export to {out}")
    path = _write(bundle, Path(out), overwrite)
    try:
        validate(path, fmt, target)
    except ExportError as e:  # passed in memory, failed from disk: do not leave a broken export behind
        shutil.rmtree(path, ignore_errors=True)
        raise ExportError(f"written export failed re-validation and was removed: {e}") from None
    return path


def _set_serve_name(bundle: Bundle, serve: str) -> None:
    bundle.sidecar["serve_name"] = serve
    verifier = (bundle.config.get("speculators_config") or {}).get("verifier")
    if isinstance(verifier, dict):
        verifier["name_or_path"] = serve
    if "base_model_name_or_path" in bundle.config:
        bundle.config["base_model_name_or_path"] = serve


def _set_dtype(bundle: Bundle, dtype: torch.dtype) -> None:
    name = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    bundle.config["torch_dtype"] = name


def _write(bundle: Bundle, out: Path, overwrite: bool) -> Path:
    """Atomic: write a fresh temporary directory beside OUT, then swap it in (a crash leaves the old directory or
    none, never half of one). The temporary name is new (mkdtemp): an existing ``OUT.tmp`` is never touched."""
    out = Path(out)
    check_not_inside_run(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; pass overwrite=True (CLI: --force) or another --out")
    if out.exists():
        _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out_of_space_as_error(out, "free space, or export to a larger disk"):
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        try:
            tensors = {k: v.detach().cpu().contiguous() for k, v in bundle.tensors.items()}
            save_file(tensors, str(tmp / bundle.weights_file), metadata={"format": "pt"})
            (tmp / CONFIG).write_text(json.dumps(bundle.config, indent=2, sort_keys=True) + "\n")
            (tmp / SIDECAR).write_text(json.dumps(bundle.sidecar, indent=2, sort_keys=True) + "\n")
            (tmp / README).write_text(render_readme(bundle.fmt, bundle.config, bundle.sidecar))
            _make_readable(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # ours: a half export must not stay (or fill the disk)
            raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def check_not_inside_run(out: Path) -> None:
    """Refuse an --out inside a drafter checkpoint (e.g. a run's final/) or a run's checkpoints/: training replaces
    those directories whole, and would delete the export with them."""
    for d in [out, *out.absolute().parents]:
        is_ckpt = (d / CONFIG).is_file() and (d / "model.safetensors").is_file() and _is_drafter_config(d / CONFIG)
        is_run_part = d.name in ("final", "final.tmp", "checkpoints") and (d.parent / "checkpoints").is_dir()
        if d != out and (is_ckpt or is_run_part):
            raise ExportError(f"--out {out} is inside {d}, which training rewrites (and would delete the export "
                              "with); export next to the run instead, e.g. OUTPUT_DIR/export")
        if d == out and is_run_part:
            raise ExportError(f"--out {out} is a training run's {d.name}/ directory; choose another --out")


def _is_drafter_config(path: Path) -> bool:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "method" in meta and "layer_ids" in meta


def _make_readable(d: Path) -> None:
    """0644 files, 0755 directory: safetensors writes a temp file and renames it (mode 0600) and the umask may be
    strict, yet the export is usually served by another user (as files from save_pretrained are)."""
    for f in d.iterdir():
        f.chmod(0o644)
    d.chmod(0o755)


def _check_replaceable(out: Path) -> None:
    """Overwriting replaces only a previous export: its marker (draftsmith.json) and nothing but export files.
    Anything else (a run directory, a checkpoint, a home directory) is refused, never deleted."""
    if not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory; choose another --out")
    entries = list(out.iterdir())
    if not entries:
        return
    ours = {CONFIG, SIDECAR, README, *(f.weights_file for f in export_formats().values())}
    foreign = sorted(p.name for p in entries if p.name not in ours or not p.is_file())
    if not (out / SIDECAR).is_file() or foreign:
        what = f"it holds {foreign[:4]}" if foreign else f"it has no {SIDECAR} marker"
        raise ExportError(f"refusing to replace {out}: it is not a previous export ({what}); choose an empty or "
                          "new --out")


# ============================================================================================ loading back
def load_export(path: str | Path, target: FrozenTarget, fmt: str | None = None) -> nn.Module:
    """Rebuild draftsmith's own module (Eagle3Drafter, MedusaHeads, MTPDrafter) from an export directory.

    Uses only what engines read (config.json + weights) plus the target, so a successful round trip shows the
    export is self-sufficient. The directory is validated against ``target`` first.
    """
    path = Path(path)
    spec = export_format(validate(path, fmt, target))
    cfg = load_json(path / CONFIG)
    t = Tensors.read(path / spec.weights_file)
    return spec.load(cfg, {k: t.get(k) for k in t.shapes}, target)
