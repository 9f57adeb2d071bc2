"""One validator for every format: detect a directory's format, check its config, tensors and target.

It runs on the in-memory export before anything is written, and on any directory afterwards. The
format-specific checks live in the format modules; the shape comparison and the same-target check here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.export.shared.common import (
    CONFIG,
    LAYER_ID_CONVENTION,
    SIDECAR,
    ExportError,
    TargetInfo,
    Tensors,
    engine_target_name,
    fail,
    is_machine_path,
    load_json,
    norm_name,
    target_info,
)
from models.export.shared.identity import check_stamp

from .formats import detect_format as _detect
from .formats import export_format
from .serving import check_serving


def detect_format(path: str | Path) -> str:
    """Which of FORMATS a directory holds (from its config.json and weight files)."""
    return _detect(path, load_json(Path(path) / CONFIG)).name


def validate(path: str | Path, fmt: str | None = None, target_config: Any = None, *,
             enable_thinking: bool | None = None, chat_template: str | None = None) -> str:
    """Check an export directory; raise ExportError with a one-line reason, else return its format.

    ``target_config``: a FrozenTarget (also checks the embedding fingerprint), a transformers config or a dict
    with num_hidden_layers/hidden_size/vocab_size(/_name_or_path) — or None for self-consistency only.
    ``enable_thinking`` / ``chat_template``: the serving mode to check the export's manifest against (a thinking
    mode other than the trained one is refused, another template warned about; models/export/serving.py).
    """
    path = Path(path)
    cfg = load_json(path / CONFIG)
    spec = export_format(fmt) if fmt else _detect(path, cfg)
    fmt = spec.name
    side = load_json(path / SIDECAR) if (path / SIDECAR).exists() else None
    wfile = path / spec.weights_file
    if not wfile.exists():
        raise ExportError(f"{path}: {fmt} export needs {wfile.name}, which is missing")
    try:
        tensors = Tensors.read(wfile)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one reason to refuse
        raise ExportError(f"{wfile}: unreadable safetensors ({type(e).__name__}: {e})") from None
    _check_finite(tensors, wfile)
    info = target_info(target_config)
    check_export(fmt, cfg, tensors, side, info, str(path))
    # the serving mode (models/export/serving.py): target revision and head, thinking mode, chat template
    check_serving(cfg, side, info.frozen if info is not None else None, str(path), enable_thinking=enable_thinking,
                  chat_template=chat_template)
    return fmt


def _check_finite(t: Tensors, wfile: Path) -> None:
    """A diverged drafter (NaN/inf weights) is not a valid export, whatever its shapes say."""
    from models.core.checkpoint import check_finite

    try:
        check_finite({k: t.get(k) for k in t.shapes if t.dtypes[k].is_floating_point}, wfile)
    except ValueError as e:
        raise ExportError(str(e)) from None


def check_export(fmt: str, cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None, where: str) -> None:
    if side is not None:
        if side.get("format") not in (None, fmt):
            fail(where, f"draftsmith.json says format {side.get('format')!r} but the files are {fmt}")
        if side.get("layer_id_convention") not in (None, LAYER_ID_CONVENTION):
            fail(where, f"draftsmith.json layer ids use convention {side.get('layer_id_convention')!r}, "
                         f"expected {LAYER_ID_CONVENTION!r}")
    expected, tgt_dims = export_format(fmt).check(cfg, t, side, target, where)
    _check_same_target(fmt, cfg, t, side, target, tgt_dims, where)  # first: "another target" explains the rest
    for n in (tgt_dims.get("name"), cfg.get("base_model_name_or_path")):
        if n and is_machine_path(n) and not (side or {}).get("serve_name_from_user"):
            warnings.warn(f"{where}: the engine-read target name {n!r} is a path on the machine that exported it; "
                          "re-export (draftsmith now writes the target's id) or pass --serve-name", UserWarning,
                          stacklevel=2)
    _compare_tensors(expected, t, where, fmt)


def _compare_tensors(expected: dict[str, tuple[int, ...]], t: Tensors, where: str, fmt: str) -> None:
    missing = [k for k in expected if k not in t.shapes]
    if missing:
        fail(where, f"{fmt} export is missing {len(missing)} tensor(s), e.g. {missing[:4]}")
    extra = sorted(k for k in t.shapes if k not in expected)
    if extra:
        fail(where, f"{fmt} export has {len(extra)} unexpected tensor(s), e.g. {extra[:4]} "
                     "(engines skip unknown names silently, so they must not be there)")
    for k, shape in expected.items():
        if tuple(t.shapes[k]) != tuple(shape):
            fail(where, f"tensor {k} has shape {list(t.shapes[k])}, expected {list(shape)} from config.json")
    floats = {k: d for k, d in t.dtypes.items() if d.is_floating_point}
    if len(set(floats.values())) > 1:
        fail(where, f"float tensors mix dtypes {sorted({str(d) for d in floats.values()})}")


def _check_same_target(fmt: str, cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None,
                       dims: dict, where: str) -> None:
    """Refuse an export made for another target: shape, name, then (with a FrozenTarget) the embedding itself."""
    if side is not None:
        st = side.get("target") or {}
        for key in ("hidden_size", "vocab_size"):
            if st.get(key) is not None and dims.get(key) is not None and st[key] != dims[key]:
                fail(where, f"draftsmith.json says the target's {key} is {st[key]} but the tensors/config say "
                             f"{dims[key]}")
    if target is None:
        check_stamp(cfg, dims, None, where)  # the stamp must still agree with the export's own config
        return
    for key in ("hidden_size", "vocab_size"):
        want, have = dims.get(key), getattr(target, key)
        if want is not None and have is not None and int(want) != int(have):
            fail(where, f"exported for another target: {key} {want} != the target's {have}")
    tmt = (target.config.get("model_type") if isinstance(target.config, Mapping)
           else getattr(target.config, "model_type", None))
    if dims.get("model_type") and tmt and dims["model_type"] != tmt:
        fail(where, f"exported for another target: model_type {dims['model_type']!r} != the target's {tmt!r}")
    rt = dims.get("rope_theta")
    trt = _rope_theta_of(target.config)
    if rt is not None and trt is not None and not math.isclose(float(rt), float(trt)):
        fail(where, f"exported for another target: rope_theta {rt} != the target's {trt}")
    # the target's weights themselves were compared: a differing name is then just a spelling
    verified = check_stamp(cfg, dims, target, where)
    if side is not None and target.fingerprint is not None:
        st = side.get("target") or {}
        for key in ("num_hidden_layers", "embed_fingerprint"):
            have = target.num_hidden_layers if key == "num_hidden_layers" else target.fingerprint
            legacy = target.frozen.legacy_fingerprint() if key != "num_hidden_layers" and target.frozen else None
            if st.get(key) is not None and st.get(key) != have and st.get(key) != legacy:
                fail(where, f"exported for another target: {key} {st.get(key)} != the target's {have} "
                             f"(trained on {side.get('target_name')!r})")
        verified = verified or st.get("embed_fingerprint") is not None
    verify = export_format(fmt).verify_target  # a format carrying the target's own tensors compares them
    if verify is not None and target.fingerprint is not None:
        verified = verify(t, target, where) or verified
    names = [n for n in (dims.get("name"), cfg.get("base_model_name_or_path"),
                         (side or {}).get("target_name")) if n]
    if not verified and target.name and names and not _same_name(names[0], str(target.name)):
        fail(where, f"exported for another target: verifier {names[0]!r} != the target {target.name!r}")


def _same_name(a: str, b: str) -> bool:
    """One target under two spellings: the same resolved path, or the same portable name (exports write the target
    as engine_target_name gives it, e.g. the HF-cache id or the directory name, not the training machine's path)."""
    return norm_name(a) == norm_name(b) or engine_target_name(a) == engine_target_name(b)


def _rope_theta_of(c: Any) -> float | None:
    if c is None:
        return None
    get = c.get if isinstance(c, Mapping) else (lambda k, d=None: getattr(c, k, d))
    rp = get("rope_parameters", None) or {}
    return (rp.get("rope_theta") if isinstance(rp, Mapping) else None) or get("rope_theta", None)
