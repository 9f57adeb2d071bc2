"""GGUF for llama.cpp: a drafter written in the HF layout llama.cpp's converter reads, then converted by llama.cpp's
own ``convert_hf_to_gguf.py`` (the sources scripts/build_llama_cpp.sh unpacks; models/export/convert_gguf.py wraps it).

Which layout: the first of the method's format rows that names a llama.cpp ``--spec-type`` (``ExportFormat.llamacpp``)
and builds for this drafter. EAGLE-3 → ``eagle3`` (LlamaForCausalLMEagle3); DFlash → the z-lab layout (llama.cpp's
DFlash converter has no draft vocabulary, so a reduced-vocabulary drafter is refused with the row's own reason);
DSpark → ``dspark-speculators`` (its converter maps d2t and the aux ids itself). Methods llama.cpp does not draft
for a Llama target (Medusa, MTP on a target without nextn layers, P-EAGLE) have no such row and are refused.

    OUT/hf/         the export in that layout, validated like any export (``--check OUT/hf``)
    OUT/draft.gguf  what llama.cpp loads (``-md``)
    OUT/gguf.json   what was converted: source format, --spec-type, K, llama.cpp version, sha256, serving mode
    OUT/README.md   the llama.cpp commands

Written atomically (a temporary directory beside OUT, swapped in); ``overwrite`` replaces only a previous GGUF
export (its gguf.json marker).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from torch import nn

from models import registry
from models.core.checkpoint import file_sha256
from models.core.target import resolve_name
from models.export.shared.common import SIDECAR, ExportError, load_json, measured_sentence

from .api import check_not_inside_run, export
from .formats import export_format

REPO = Path(__file__).resolve().parents[2]
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp we build and convert with
# run by its file path: it puts llama.cpp's own gguf-py first on the path before anything imports gguf
CONVERTER = Path(__file__).resolve().parent / "convert_gguf.py"
MARKER, DRAFT = "gguf.json", "draft.gguf"


# The draft's GGUF types llama.cpp's converter writes and its CPU backend runs. The default is what measured
# fastest: in llama-server on SmolLM2 (bench/engines/llamacpp_server_smollm2_q4_1_40x3, AVX2 EPYC, 2 threads) the
# EAGLE-3 draft's own forward took 42 % less time a round as q8_0 than as f32 (1.34 vs 2.30 ms at K=1; 3.9 vs
# 7.0 ms at K=3) at the same acceptance (tokens per round 1.44 / 1.63 / 1.70 either way); an export with --results
# takes the type of the fastest measured row instead.
OUTTYPES = ("f32", "bf16", "f16", "q8_0")
DEFAULT_OUTTYPE = "q8_0"


def llamacpp_dir() -> Path:
    """The llama.cpp source tree (``DRAFTSMITH_LLAMA_CPP_DIR``, default .engines/llama.cpp-<version>)."""
    default = REPO / ".engines" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    return Path(os.environ.get("DRAFTSMITH_LLAMA_CPP_DIR") or default)


def llamacpp_rows(method: str) -> list:
    """The method's formats llama.cpp converts, in the method's order."""
    return [f for f in registry.method(method).export_formats if f.llamacpp]


def convert(src: str | Path, outfile: str | Path, target_dir: str | Path | None = None, outtype: str = "f32",
            timeout: float = 3600) -> Path:
    """``convert_hf_to_gguf.py SRC --outfile OUTFILE [--target-model-dir T]`` with this interpreter; the file
    appears only when the converter succeeded (written beside it, then renamed)."""
    src, outfile = Path(src), Path(outfile)
    if not (llamacpp_dir() / "convert_hf_to_gguf.py").exists():
        raise ExportError(f"no llama.cpp sources at {llamacpp_dir()} (its convert_hf_to_gguf.py converts to GGUF); "
                          "run scripts/build_llama_cpp.sh or set DRAFTSMITH_LLAMA_CPP_DIR")
    outfile.parent.mkdir(parents=True, exist_ok=True)
    tmp = outfile.with_name(f".{outfile.name}.{os.getpid()}.tmp")
    cmd = [sys.executable, str(CONVERTER), str(src), "--outfile", str(tmp), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "LLAMA_CPP_DIR": str(llamacpp_dir())}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"rc {proc.returncode}"]
        raise ExportError(f"llama.cpp's converter refused {src}: {tail[0]}")
    os.replace(tmp, outfile)
    return outfile


def target_directory(name: str) -> Path:
    """A local HF directory of the target (config + tokenizer): the converter reads the draft's tokenizer there."""
    path = Path(resolve_name(name))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: no local copy
        raise ExportError(f"llama.cpp's converter reads the target's tokenizer from a local directory, and {name!r} "
                          "is none (nor in the HF cache); pass --target DIR") from None




def require_rows(method: str) -> list:
    """The method's llama.cpp rows, or the refusal (the tracked gaps: Medusa, MTP on a Llama target, P-EAGLE)."""
    rows = llamacpp_rows(method)
    if not rows:
        raise ExportError(f"llama.cpp has no {method} draft layout: its --spec-types are draft-eagle3, draft-dflash, "
                          "draft-dspark and draft-mtp, and draft-mtp runs nextn layers inside the target's own graph "
                          "(DeepSeek, GLM, Qwen3.5, ...), which its Llama graph has none of; use a vLLM or SGLang "
                          "format")
    return rows


def _build_hf(drafter: nn.Module, out: Path, target, **kw):
    """The first llama.cpp row that builds for this drafter; each refusal says why (the row's own error)."""
    rows = require_rows(drafter.config_dict().get("method"))
    reasons = []
    for row in rows:
        try:
            return row, export(drafter, row.name, out, target, **kw)
        except ExportError as e:
            reasons.append(f"{row.cli}: {e}")
    raise ExportError("no llama.cpp layout takes this drafter; " + " | ".join(reasons))


def export_gguf(drafter: nn.Module, out: str | Path, target, *, target_name: str, overwrite: bool = False,
                outtype: str | None = None, **kw) -> Path:
    """Write OUT/{hf/, draft.gguf, gguf.json, README.md} (module docstring). ``kw``: models.export.export's
    num_speculative_tokens, meta, dtype, serve_name, measured. ``outtype``: the draft's GGUF type (one of
    OUTTYPES), else the one that served fastest (``measured["draft_type"]``), else DEFAULT_OUTTYPE."""
    out = Path(out)
    outtype = outtype or (kw.get("measured") or {}).get("draft_type") or DEFAULT_OUTTYPE
    if outtype not in OUTTYPES:
        raise ExportError(f"draft GGUF type {outtype!r}: one of {', '.join(OUTTYPES)}")
    # checked on OUT itself: the layout is built inside a temporary directory beside OUT, where the same check
    # would refuse once per layout, naming that temporary path
    check_not_inside_run(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"{out} exists and is not empty; pass overwrite=True (CLI: --force) or another --out")
        if not (out / MARKER).is_file():
            raise ExportError(f"refusing to replace {out}: it is not a previous GGUF export (no {MARKER})")
    tdir = target_directory(target_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        row, hf = _build_hf(drafter, tmp / "hf", target, target_name=target_name, **kw)
        gguf = convert(hf, tmp / DRAFT, tdir, outtype)
        side = json.loads((hf / "draftsmith.json").read_text())
        manifest = {"source_format": row.name, "spec_type": row.llamacpp,
                    "num_speculative_tokens": side.get("num_speculative_tokens"),
                    "outtype": outtype, "llama_cpp_python_sources": LLAMA_CPP_PYTHON_VERSION,
                    "draft_sha256": file_sha256(gguf), "serve_name": side.get("serve_name"),
                    "serving": side.get("serving"), "measured_best": side.get("measured_best")}
        (tmp / MARKER).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(readme(manifest))
        for p in (tmp, *tmp.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def check_gguf(path: str | Path) -> dict:
    """A GGUF export's manifest, after checking draft.gguf is the file that was converted (sha256)."""
    path = Path(path)
    m = read_marker(path / MARKER)
    if not (path / DRAFT).is_file():
        raise ExportError(f"{path}: {DRAFT} is missing")
    have = file_sha256(path / DRAFT)
    if have != m.get("draft_sha256"):
        raise ExportError(f"{path}/{DRAFT} is not the file this export converted (sha256 differs: {have}, "
                          f"{path / MARKER} says draft_sha256 {m.get('draft_sha256')}); export again with --force")
    check_gguf_file(path / DRAFT)  # the sha only proves the marker and file agree: both may be rewritten together
    return m


def check_gguf_file(f: Path) -> None:
    """``f`` parses as GGUF and every tensor's data lies inside it: a cut copy (a full disk, a killed transfer)
    whose marker was refreshed would otherwise pass until llama.cpp fails to load it."""
    fix = "export again with --force"
    try:  # optional dependency ([real]); only a GGUF export needs it
        from gguf import GGUFReader
    except ImportError:
        raise ExportError(f"reading {f} needs the gguf package: pip install -e '.[real]'") from None
    try:
        reader = GGUFReader(f)
    except Exception as e:  # noqa: BLE001 - any parse failure is a damaged file: name it, with the reader's reason
        raise ExportError(f"{f} does not parse as GGUF: truncated or damaged ({type(e).__name__}: {e}); {fix}") \
            from None
    size = f.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ExportError(f"{f} is truncated: tensor {t.name} needs bytes up to {end}, the file has {size}; {fix}")


def check_manifest(path: str | Path, fmt: str) -> dict:
    """``check_gguf``, then what gguf.json claims recomputed from ``hf/`` (which holds the ``fmt`` layout): an edited
    manifest would otherwise hand llama.cpp another --spec-type or a K of 0 while --check called it valid."""
    path = Path(path)
    m, marker = check_gguf(path), path / MARKER
    row = export_format(fmt)
    if not row.llamacpp:
        raise ExportError(f"{path}/hf holds the {fmt} layout, which llama.cpp has no --spec-type for; export again "
                          "with --format gguf --force")
    for key, want in (("source_format", row.name), ("spec_type", row.llamacpp)):
        if m.get(key) != want:
            raise ExportError(f"{marker} says {key} {m.get(key)!r}, but hf/ holds the {fmt} layout, whose {key} is "
                              f"{want!r}; export again with --force")
    n = m.get("num_speculative_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ExportError(f"{marker} says num_speculative_tokens {n!r}, but llama.cpp's --spec-draft-n-max needs an "
                          "integer >= 1; export again with --force (--results sets K)")
    side = load_json(path / "hf" / SIDECAR) if (path / "hf" / SIDECAR).is_file() else {}
    for key in ("num_speculative_tokens", "serve_name", "serving"):  # copied from hf/draftsmith.json at export
        if key in side and m.get(key) != side[key]:
            raise ExportError(f"{marker} says {key} {json.dumps(m.get(key))}, but hf/{SIDECAR} says "
                              f"{json.dumps(side[key])}; export again with --force")
    return m


def read_marker(marker: Path) -> dict:
    """An export's gguf.json; damaged (a kill while copying it, an edit) is one line naming it."""
    fix = "export again with --force to rewrite it"
    try:
        m = json.loads(marker.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ExportError(f"{marker} is not UTF-8 text; {fix}") from None
    except json.JSONDecodeError as e:
        what = "empty" if not e.doc.strip() else f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        raise ExportError(f"{marker} is {what}; {fix}") from None
    if not isinstance(m, dict) or "draft_sha256" not in m:
        raise ExportError(f"{marker} holds no draft_sha256 (an object with the converted file's sha256); {fix}")
    return m


def serve_args(manifest: dict, target_gguf: str = "target.gguf", draft: str = DRAFT) -> list[str]:
    """llama.cpp's arguments for this draft: the same ones the engine tier runs (eval/engines/llamacpp.py)."""
    return ["-m", target_gguf, "-md", draft, "--spec-type", manifest["spec_type"],
            "--spec-draft-n-max", str(manifest["num_speculative_tokens"])]


def readme(m: dict) -> str:
    args = " ".join(serve_args(m))
    target = m.get("serve_name") or "TARGET_DIR"
    return "\n".join([
        f"# llama.cpp draft ({m['spec_type']}, from the {m['source_format']} layout)", "",
        f"`{DRAFT}` is `hf/` converted by llama.cpp's own `convert_hf_to_gguf.py` (llama-cpp-python "
        f"{m['llama_cpp_python_sources']} sources, {m['outtype']}; sha256 in `{MARKER}`). Serve it beside the target "
        "it was trained for, converted by the same converter:", "",
        "```bash",
        f"python -m models.export.convert_gguf {target} --outfile target.gguf --outtype f32   # once (with draftsmith)",
        f"llama-speculative-simple {args} --temp 0 -p \"...\" -n 128",
        f"llama-server {args}",
        "```", "",
        f"`--spec-draft-n-max {m['num_speculative_tokens']}` is the recommended K. The draft reads the target's "
        "hidden states, so the target GGUF must be the model it was trained against (a quantized target changes "
        "them; acceptance drops, output stays the target's).", "", *_measured(m.get("measured_best"))])


def _measured(b: dict | None) -> list[str]:
    """What the engine benchmark measured best for this drafter: the target type and K to serve it with."""
    return [f"Measured best (`{b['results']}`): {measured_sentence(b)}.", ""] if b else []
