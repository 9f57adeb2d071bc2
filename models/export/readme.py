"""The README.md written into every export: a format-independent frame, then the format's own sections.

The frame names the target, the check command and num_speculative_tokens; what comes after it (engine commands,
layer-id conventions, notes) is the format row's ``readme`` (models/core/spec.py ``ExportFormat``, declared in its
method's ``export.py``; shared pieces in models/export/shared/snippets.py). A format without one gets the frame only.
"""

from __future__ import annotations

from models.core.target import EMBEDDED_NAME
from models.export.shared.common import EMBEDDED_SERVE_PATH, engine_target_name, measured_sentence
from models.export.shared.snippets import Serve

from .formats import export_format

PATH = "/path/to/this/export"  # the export directory as the snippets name it


def render_readme(fmt: str, cfg: dict, side: dict) -> str:
    tname = side.get("serve_name") or engine_target_name(side["target_name"])
    serve = Serve(PATH, tname, side["num_speculative_tokens"])
    row = export_format(fmt)
    return "\n".join(_frame(row.name, side, serve) + (row.readme(cfg, side, serve) if row.readme else []))


def _frame(fmt: str, side: dict, s: Serve) -> list[str]:
    cname = side["target_name"] if side["target_name"] == EMBEDDED_NAME else s.target  # draftsmith resolves its alias
    t = side["target"]
    return [f"# draftsmith export: {fmt}", "",
            f"Drafter method `{side['method']}` for target `{cname}` "
            f"({t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}). Check this "
            f"directory any time with `python -m train.export --check {s.path} --target {cname}`.", "",
            f"`{s.target}` below names the target (as in this export's engine-read fields"
            + (": its directory in a draftsmith checkout" if s.target == EMBEDDED_SERVE_PATH else "")
            + "); serve from wherever the target lives on the serving machine, or re-export with "
            "`--serve-name`.", "",
            f"num_speculative_tokens below: {s.num_speculative_tokens}" + _k_origin(side), ""]


def _k_origin(side: dict) -> str:
    m = side.get("measured_best")
    if m:
        return f" (the best measured: {measured_sentence(m)}; `{m['results']}`)."
    if side.get("k_from_results"):
        return " (from the eval results)."
    return (" (default; pass --results eval.json with `recommended_num_speculative_tokens`, or engine benchmark "
            "results, to use the measured best).")
