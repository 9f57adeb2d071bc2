"""What every format module shares: names of the files, the error type, tensor/target views, the bundle."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from models.core.target import EMBEDDED_NAME, FrozenTarget, resolve_name

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SIDECAR = "draftsmith.json"
README = "README.md"
LAYER_ID_CONVENTION = "hf_output_hidden_states_index"


class ExportError(ValueError):
    """A one-line reason why an export cannot be written or a directory is not a valid export."""


# ============================================================================================ small helpers
@dataclass
class Tensors:
    """Names, shapes and dtypes of an export's tensors; values fetched on demand (files are read lazily)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    get: Callable[[str], torch.Tensor]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        return cls({k: tuple(v.shape) for k, v in tensors.items()}, {k: v.dtype for k, v in tensors.items()},
                   lambda k: tensors[k])

    @classmethod
    def read(cls, path: Path) -> Tensors:
        shapes, dtypes = {}, {}
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                shapes[k] = tuple(sl.get_shape())
                dtypes[k] = _ST_DTYPES.get(sl.get_dtype(), torch.float32)

        def get(k: str) -> torch.Tensor:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(k)

        return cls(shapes, dtypes, get)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class TargetInfo:
    """What the validator knows about the target (from a FrozenTarget, a config or a plain dict)."""

    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    name: str | None = None
    fingerprint: str | None = None
    config: Any = None
    frozen: FrozenTarget | None = None


def target_info(t: Any) -> TargetInfo | None:
    if t is None:
        return None
    if isinstance(t, TargetInfo):
        return t
    if isinstance(t, FrozenTarget):
        c = t.model.config
        return TargetInfo(c.num_hidden_layers, c.hidden_size, c.vocab_size, getattr(c, "_name_or_path", None),
                       t.fingerprint(), c, t)
    get = t.get if isinstance(t, Mapping) else (lambda k, d=None: getattr(t, k, d))
    name = get("_name_or_path", None) or get("name_or_path", None)
    return TargetInfo(get("num_hidden_layers"), get("hidden_size"), get("vocab_size"), name, None, t)


def norm_name(name: str) -> str:
    """A target name comparable across spellings: `tiny-code` and local paths resolve to absolute paths."""
    r = resolve_name(str(name))
    p = Path(r)
    return str(p.resolve()) if p.exists() else r.rstrip("/")


EMBEDDED_SERVE_PATH = "models/tiny_code"  # the embedded target's directory, relative to a draftsmith checkout


def engine_target_name(name: str) -> str:
    """The target as the engines' fields and commands name it, never a path on the training machine (an export
    travels; `/home/me/ckpts/llama` means nothing on the server): a hub id unchanged; the embedded target by its
    directory in a draftsmith checkout; any other local directory by the hub id in its HF-cache path
    (``…/models--org--name/snapshots/…``) or else its directory name. ``export(serve_name=...)`` (CLI
    ``--serve-name``) sets another one."""
    name = str(name)
    p = Path(name).expanduser()
    if name == EMBEDDED_NAME or (p.exists() and p.resolve() == Path(resolve_name(EMBEDDED_NAME)).resolve()):
        return EMBEDDED_SERVE_PATH
    if p.is_absolute() or name.startswith((".", "~")) or p.exists():
        for part in reversed(p.parts):
            if part.startswith("models--") and len(part) > len("models--"):
                return part[len("models--"):].replace("--", "/", 1)
        return p.resolve().name or name
    return name


def is_machine_path(name: str) -> bool:
    """An absolute (or home-relative) path: what an export must not carry in an engine-read field."""
    return str(name).startswith(("/", "~")) or Path(str(name)).is_absolute()


EXPORT_FIX = ("restore or re-create it: export the checkpoint again (python -m train.export CHECKPOINT --format "
              "FORMAT --out DIR --force)")
RESULTS_FIX = "restore or re-create it: python -m eval writes results.json in its out_dir; or export without --results"


def load_json(path: Path, fix: str = EXPORT_FIX) -> dict:
    """A JSON object from ``path``; damaged (emptied, cut by a kill, not UTF-8, not an object) is one line naming the
    file, where the JSON stops (line, column and character offset) and ``fix``: what re-creates the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path.parent}: no {path.name}; not an export directory") from None
    except UnicodeDecodeError as e:
        bad = f"byte {e.object[e.start]:#04x} at offset {e.start}"
        raise ExportError(f"{path}: not UTF-8 text ({bad}); {fix}") from None
    except json.JSONDecodeError as e:
        empty = ", the file is empty" if not e.doc.strip() else ""
        raise ExportError(f"{path}: not valid JSON ({e}{empty}); {fix}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def _results(path: str | Path) -> dict:
    if not Path(path).is_file():  # load_json's "not an export directory" would blame the wrong file
        raise ExportError(f"--results {path}: no such file; pass the results.json that `python -m eval` (or `python "
                          "-m eval.engines.bench`) wrote in its out dir, or export without --results (the method's "
                          "default K)")
    return load_json(Path(path), RESULTS_FIX)


def num_speculative_tokens_from_results(path: str | Path) -> int:
    """``recommended_num_speculative_tokens`` from an eval results JSON (eval/ writes it)."""
    data = _results(path)
    n = data.get("recommended_num_speculative_tokens")
    if n == 0 and not isinstance(n, bool):
        raise ExportError(f"{path}: recommended_num_speculative_tokens is 0 — speculation measured slower than plain "
                          "decoding at batch 1 for this target; serve without a drafter, or export without --results "
                          f"(best K >= 1 was {data.get('best_positive_num_speculative_tokens')})")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ExportError(f"{path}: needs a positive integer 'recommended_num_speculative_tokens', got {n!r}")
    return n


def is_engine_results(path: str | Path) -> bool:
    """Whether ``path`` is an engine benchmark's results.json (``python -m eval.engines.bench``), not eval's."""
    data = _results(path)
    return "engine" in data and isinstance(data.get("methods"), dict)


def engine_best(paths: list[str | Path], method: str) -> dict:
    """The best configuration of ``method`` served at batch 1 across engine benchmark results (one file per
    engine and target type): engine, target type, K, tokens/s and speedup over that engine's own AR in the same
    file, and whether its tokens were the reference's (a quantized target diverges at near ties; the results say
    where). The K an export should carry for that engine, and the target type to serve it with."""
    rows = []
    for p in paths:
        data = _results(p)
        if "engine" not in data or not isinstance(data.get("methods"), dict):
            raise ExportError(f"--results {p}: not an engine benchmark's results.json (no 'engine'); pass eval's "
                              "results.json alone, or only `python -m eval.engines.bench` results")
        for name, r in data["methods"].items():
            speedup = (r.get("speedup_vs_engine_ar") or {}).get("1")
            k = r.get("num_speculative_tokens")
            if r.get("method") != method or not r.get("ok") or speedup is None or not isinstance(k, int):
                continue
            rows.append({"engine": data["engine"], "target": data.get("target"),
                         "target_type": data.get("target_type"), "num_speculative_tokens": k,
                         "speedup": round(float(speedup), 3), "tokens_per_s": round(r["tokens_per_s"]["1"], 1),
                         "lossless": bool(r.get("lossless")), "row": name, "results": str(p),
                         **({"draft_type": r["draft_type"]} if r.get("draft_type") else {})})
    if not rows:
        raise ExportError(f"--results: no served {method} row at batch 1 in {', '.join(map(str, paths))}; measure one "
                          f"with `python -m eval.engines.bench --checkpoint {method}=RUN/final` (files written before "
                          "rows named their method need a rerun)")
    # among rows that beat their engine's AR the most tokens/s (the target type a user should serve); else the
    # smallest loss against AR (the K to try, with a README that says it does not pay)
    return max(rows, key=lambda r: (r["speedup"] > 1, r["tokens_per_s"] if r["speedup"] > 1 else r["speedup"]))


def measured_sentence(m: Mapping[str, Any]) -> str:
    """engine_best's row in words, for the CLI line and both READMEs: where, at which K, how fast, and whether it
    pays."""
    tt = f" with the target as a {m['target_type']} GGUF" if m.get("target_type") else ""
    verdict = ("faster than plain decoding there" if m["speedup"] > 1 else
               "slower than plain decoding there: serve the target alone until a drafter measures faster")
    ties = "" if m.get("lossless", True) else " (its tokens left the engine's AR at near ties; the results list them)"
    return (f"{m['engine']}{tt} at K={m['num_speculative_tokens']}, {m['tokens_per_s']} tokens/s, "
            f"{m['speedup']:.2f}× the engine's own AR, {verdict}{ties}")


# ============================================================================================ the bundle
@dataclass
class Bundle:
    """Everything one export writes; validated as a whole before the first byte hits the disk."""

    fmt: str
    config: dict
    tensors: dict[str, torch.Tensor]
    sidecar: dict
    weights_file: str = WEIGHTS


def make_sidecar(fmt: str, drafter: nn.Module, target: FrozenTarget, target_name: str, num_speculative_tokens: int,
                 meta: dict | None) -> dict:
    return {"format": fmt, "method": drafter.config_dict().get("method"), "target_name": target_name,
            "target": target.identity(),
            "layer_ids": list(drafter.layer_ids), "layer_id_convention": LAYER_ID_CONVENTION,
            "draft": drafter.config_dict(), "num_speculative_tokens": num_speculative_tokens,
            "trained_step": (meta or {}).get("step")}


# ============================================================================================ check primitives
def fail(where: str, msg: str) -> None:
    raise ExportError(f"{where}: {msg}".replace("\n", " "))


def require(cfg: Mapping, key: str, where: str, kind: type | tuple = int) -> Any:
    v = cfg.get(key)
    if v is None or not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        fail(where, f"config.json needs {key} ({getattr(kind, '__name__', kind)}), got {v!r}")
    return v


def target_num_layers(target: TargetInfo | None, side: dict | None) -> int | None:
    if target is not None and target.num_hidden_layers:
        return int(target.num_hidden_layers)
    if side is not None:
        return (side.get("target") or {}).get("num_hidden_layers")
    return None


def architectures(cfg: Mapping) -> list[str]:
    """A config.json's ``architectures`` (an absent or null one is empty): what format detection reads."""
    return list(cfg.get("architectures") or [])
