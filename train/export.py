"""Export a trained drafter checkpoint for a serving engine, or check an export directory.

    python -m train.export CHECKPOINT --format FORMAT --out DIR [--target NAME_OR_PATH] [--results eval.json] \\
        [--dtype bfloat16] [--force]
    python -m train.export CHECKPOINT --format gguf --out DIR   # llama.cpp: DIR/draft.gguf (models/export/llamacpp.py)
    python -m train.export CHECKPOINT --format gguf --out DIR --results bench/engines/q4_1/results.json \
        --results bench/engines/bf16/results.json    # K (and target type) that served fastest in the engine
    python -m train.export --check DIR [--target NAME_OR_PATH]
    python -m train.export CHECKPOINT --format FORMAT --out DIR --trust-remote-code  # a target with its own code

CHECKPOINT is a directory written by train/ (e.g. OUTPUT_DIR/final); FORMAT is one its method declares (``--help``
lists them all: eagle3, eagle3-speculators, medusa, mtp, dflash, ...). The target defaults to the one recorded in
the checkpoint (``tiny-code`` for the embedded target); the checkpoint is refused if it was trained for another
target. The export is validated before it is written and again from disk; ``--check`` runs the same validator
on any directory (exit status 2 and a one-line reason when it is not a valid export).
Both read only the target's config, tokenizer, embedding and lm_head (models/core/target_view.py), never its decoder
weights.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from models.core.checkpoint import NoSpaceError
from models.core.target import EMBEDDED_NAME, check_target_path, parse_dtype, resolve_name, ships_own_code
from models.core.target_view import TargetView
from models.export import llamacpp
from models.export.api import export
from models.export.formats import cli_formats
from models.export.shared.common import (
    ExportError,
    engine_best,
    is_engine_results,
    measured_sentence,
    num_speculative_tokens_from_results,
)
from models.export.validate import validate

GGUF = "gguf"


def _default_target(meta: dict) -> str:
    name = (meta.get("target") or {}).get("name_or_path") or ""
    if not name:
        raise ExportError("the checkpoint records no target name_or_path; pass --target")
    # the embedded target is recorded by its resolved directory; give it back its alias
    return EMBEDDED_NAME if Path(name).resolve() == Path(resolve_name(EMBEDDED_NAME)).resolve() else name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", help="drafter checkpoint directory (config.json + model.safetensors)")
    p.add_argument("--format", choices=sorted([*cli_formats(), GGUF]),
                   help="export format (gguf: llama.cpp, the method's llama.cpp layout converted by its converter)")
    p.add_argument("--out", help="output directory")
    p.add_argument("--target", help="target name or path (default: the checkpoint's / the export's)")
    p.add_argument("--results", action="append", default=[],
                   help="eval's results.json (its recommended_num_speculative_tokens), or one or more engine "
                        "benchmark results (python -m eval.engines.bench; repeat the flag: one per target type): "
                        "the K, and the target type, that served this method fastest")
    p.add_argument("--dtype", help="cast float weights (float32, bfloat16, float16); default: as trained")
    p.add_argument("--gguf-type", choices=llamacpp.OUTTYPES,
                   help="--format gguf: the draft's GGUF type; default the type of the fastest row in engine "
                        f"--results, else {llamacpp.DEFAULT_OUTTYPE} (what served fastest here: bench/engines)")
    p.add_argument("--serve-name", help="the target as engines should name it (speculators verifier.name_or_path, "
                   "the README's serve commands); default: its hub id, the embedded target's models/tiny_code, "
                   "else the target directory's name, never a path of this machine")
    p.add_argument("--force", action="store_true", help="replace a previous export in --out (nothing else)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the target's own model code (auto_map in its config.json), as training's "
                        "target.trust_remote_code=true did; off by default: that code runs on this machine")
    p.add_argument("--check", metavar="DIR", help="validate an export directory instead of exporting")
    p.add_argument("--thinking", choices=["on", "off"], help="with --check: the thinking mode it will be served in "
                   "(refused if the drafter was trained in the other one)")
    p.add_argument("--chat-template", help="with --check: the serving chat template (a file or the template; "
                   "default: the target tokenizer's); another than the trained one is warned about")
    return p


def _load_target(name: str, trust_remote_code: bool) -> TargetView:
    """The target's view; one that ships its own code is refused unless the user passed the flag, naming it (never
    turned on from the checkpoint: running a repository's code is the user's call each time)."""
    try:
        if not trust_remote_code and ships_own_code(check_target_path(name)):
            raise ValueError("custom code")  # before transformers logs about code it will not run
        return TargetView.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as e:
        if trust_remote_code or not ("trust_remote_code" in str(e) or "custom code" in str(e)):
            raise
        raise ExportError(f"target {name!r} ships its own model code (auto_map in its config.json), which is not "
                          "run by default; pass --trust-remote-code if you trust that code (training ran it with "
                          "target.trust_remote_code=true)") from None


def _check(args: argparse.Namespace) -> str:
    if (Path(args.check) / llamacpp.MARKER).is_file():  # a GGUF export: its draft.gguf, then the layout it came from
        llamacpp.check_gguf(args.check)
        fmt, inner = _check_dir(argparse.Namespace(**{**vars(args), "check": str(Path(args.check) / "hf")}))
        m = llamacpp.check_manifest(args.check, fmt)  # gguf.json's claims recomputed from that layout
        return (f"{args.check}: valid GGUF export ({m['spec_type']}, num_speculative_tokens="
                f"{m['num_speculative_tokens']}, draft.gguf sha256 matches); {inner}")
    return _check_dir(args)[1]


def _check_dir(args: argparse.Namespace) -> tuple[str, str]:
    if not Path(args.check).exists():
        raise ExportError(f"--check {args.check}: no such file or directory")
    if not Path(args.check).is_dir():
        raise ExportError(f"--check {args.check}: not a directory (an export is a directory)")
    target = None
    if args.target:
        target = _load_target(args.target, args.trust_remote_code)
    from data.chat_spans import resolve_template

    think = None if args.thinking is None else args.thinking == "on"
    tmpl = resolve_template(args.chat_template) if args.chat_template else None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fmt = validate(args.check, None, target, enable_thinking=think, chat_template=tmpl)
    for w in seen:
        print(f"warning: {w.message}", file=sys.stderr)
    against = f" against {args.target}" if args.target else " (self-consistency only; pass --target to compare)"
    return fmt, f"{args.check}: valid {fmt} export{against}"


def _check_out_not_source(out: Path, ckpt: Path) -> None:
    """--out must not be the checkpoint being exported or a directory above it (--force would delete it)."""
    o, c = out.resolve(), ckpt.resolve()
    if o == c or o in c.parents:
        raise ExportError(f"--out {out} contains the checkpoint being exported ({ckpt}); choose another --out")


def _k_from_results(paths: list[str], method: str | None) -> tuple[int | None, dict | None]:
    """K from ``--results``: eval's recommendation (one file), or the fastest served row of ``method`` across engine
    benchmark results, with that row (engine, target type, speedup) for the export's README."""
    if not paths:
        return None, None
    if len(paths) == 1 and not is_engine_results(paths[0]):
        return num_speculative_tokens_from_results(paths[0]), None
    best = engine_best(paths, str(method))
    return best["num_speculative_tokens"], best


def _measured_line(m: dict | None) -> str:
    return f" (best measured: {measured_sentence(m)})" if m else ""


def _export(args: argparse.Namespace) -> str:
    from models.core.checkpoint import read_meta
    from models.registry import load_drafter

    if not (args.checkpoint and args.format and args.out):
        raise ExportError("exporting needs CHECKPOINT, --format and --out (or use --check DIR)")
    try:  # up front: a bad --dtype must not cost the target load (or print a traceback after it)
        dtype = parse_dtype(args.dtype) if args.dtype else None
    except ValueError as e:
        raise ExportError(f"--dtype {args.dtype}: {e}") from None
    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        raise ExportError(f"checkpoint {ckpt} does not exist; pass OUTPUT_DIR/final of a training run")
    if not (ckpt / "config.json").exists():
        raise ExportError(f"{ckpt} is not a drafter checkpoint (no config.json); pass OUTPUT_DIR/final")
    _check_out_not_source(Path(args.out), ckpt)
    try:
        meta = read_meta(ckpt)
    except ValueError as e:
        raise ExportError(str(e)) from None
    # a bad file fails before any model loading
    num_speculative_tokens, measured = _k_from_results(args.results, meta.get("method"))
    name = args.target or _default_target(meta)
    target = _load_target(name, args.trust_remote_code)
    try:
        drafter, meta = load_drafter(ckpt, target)  # refuses a checkpoint trained for another target
    except ValueError as e:
        raise ExportError(str(e)) from None
    if args.format == GGUF:
        out = llamacpp.export_gguf(drafter, args.out, target, target_name=name, outtype=args.gguf_type,
                                   num_speculative_tokens=num_speculative_tokens, meta=meta, dtype=dtype,
                                   overwrite=args.force, serve_name=args.serve_name, measured=measured)
        m = llamacpp.check_gguf(out)
        size = (out / llamacpp.DRAFT).stat().st_size / 2**20
        return (f"exported {meta['method']} checkpoint {ckpt} -> {out}/{llamacpp.DRAFT} ({size:.1f} MiB, "
                f"{m['outtype']}, llama.cpp "
                f"--spec-type {m['spec_type']}, num_speculative_tokens={m['num_speculative_tokens']}) via "
                f"{m['source_format']} in {out}/hf" + _measured_line(measured))
    out = export(drafter, args.format, args.out, target, target_name=name,
                 num_speculative_tokens=num_speculative_tokens, meta=meta, dtype=dtype, overwrite=args.force,
                 serve_name=args.serve_name, measured=measured)
    fmt = cli_formats()[args.format]
    n_files = sum(1 for _ in out.iterdir())
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    return (f"exported {meta['method']} checkpoint {ckpt} -> {out} as {fmt} ({n_files} files, {size:.1f} MiB), "
            f"validated against {name}"
            + (f", num_speculative_tokens={num_speculative_tokens} from {', '.join(args.results)}"
               if num_speculative_tokens else "") + _measured_line(measured))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        line = _check(args) if args.check else _export(args)
    except (ExportError, ValueError, FileNotFoundError, NoSpaceError) as e:
        print(f"error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
