"""The export formats, by name: the rows every method declares (``SPEC.export_formats``, its ``export.py``),
collected in registry order. A method's formats are its own: adding one touches only the method's package.
"""

from __future__ import annotations

from pathlib import Path

from models import registry
from models.core.spec import ExportFormat
from models.export.shared.common import ExportError, architectures


def export_formats() -> dict[str, ExportFormat]:
    """Every format of every registered method, by name (read at call time: a method registered later counts)."""
    out: dict[str, ExportFormat] = {}
    for spec in registry.METHODS.values():
        for f in spec.export_formats:
            if f.name in out:
                raise ValueError(f"export format {f.name!r} is declared by both {out[f.name].method} and {spec.name}")
            out[f.name] = f
    return out


def cli_formats() -> dict[str, str]:
    """CLI spelling → format name."""
    return {f.cli: f.name for f in export_formats().values()}


def export_format(fmt: str) -> ExportFormat:
    """A format by name or CLI spelling; an unknown one is a one-line error listing the known ones."""
    table, cli = export_formats(), cli_formats()
    fmt = cli.get(fmt, fmt)
    if fmt not in table:
        raise ExportError(f"unknown export format {fmt!r}; use one of {tuple(table)} (CLI: {sorted(cli)})")
    return table[fmt]


def detect_format(path: str | Path, cfg: dict) -> ExportFormat:
    path = Path(path)
    table = export_formats()
    for f in table.values():
        if f.detect(cfg, path):
            return f
    raise ExportError(f"{path}: config.json matches no export format (architectures {architectures(cfg)}, "
                      f"model_type {cfg.get('model_type')!r}); expected one of {tuple(table)}")
