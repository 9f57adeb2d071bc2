"""The regeneration cache: a file of target-regenerated text named by a hash of everything its content depends on
(``regen_cache_path``), and its shipped, compressed form (``pack_cache_file`` / ``sync_with_shipped``) that a fresh
machine unpacks instead of regenerating."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# The sampler behind regenerated text (models/core/generate.py): part of the cache key, since its random draws
# differ from transformers' generate()
GENERATOR = "draftsmith.generate/1"
# continuous batching (models/core/refill.py): each reply sampled (inverse CDF) with a seed of its own, whatever
# its batch
REFILL_GENERATOR = "draftsmith.refill/2"


def regen_cache_path(cfg, model, tok, kind: str, inputs, temperature: float | None = None,
                     refill: bool = False) -> Path:
    """The cache file for regenerated data (``cfg``: a data.sources.DataConfig), named by a hash of everything the
    output depends on: the target (shape + embedding fingerprint), the tokenizer, the inputs, the sampling settings
    and the length cap. A change to any of them is a different file (regenerated), never a reuse of another target's
    outputs."""
    import torch

    from data.regen_vllm import generator_name
    from models.core.target import FrozenTarget

    ident = {k: v for k, v in FrozenTarget(model, tok).identity().items() if k != "name_or_path"}
    vocab = sorted(tok.get_vocab().items())
    key = {"kind": kind, "target": ident,
           "tokenizer": {"size": len(tok), "vocab": _sha(vocab), "template": getattr(tok, "chat_template", None)},
           "inputs": _sha(inputs),
           "temperature": float(cfg.regen_temperature if temperature is None else temperature),
           "top_p": 1.0, "top_k": 0, "seed": cfg.seed, "max_new_tokens": cfg.regen_new_tokens,
           "generator": generator_name(getattr(cfg, "regen_backend", "draftsmith"))
           or (REFILL_GENERATOR if refill else GENERATOR)}
    if model.dtype != torch.float32:  # the text depends on the dtype the target computes in (fp32 keys as before)
        key["dtype"] = str(model.dtype).replace("torch.", "")
    digest = _sha(key)[:16]
    path = Path(cfg.cache_dir) / f"regen_{kind}_{digest}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.shipped_dir:
        sync_with_shipped(path, Path(cfg.shipped_dir) / (path.name + ".gz"))
    meta = path.with_suffix(".key.json")  # for people: what the hash covers
    if not meta.exists():
        from models.core.checkpoint import write_atomic

        write_atomic(meta, json.dumps(key, indent=1), "free space, or set data.cache_dir on a larger disk")
    return path


# The shipped form is treated like a checkpoint: manifest.json records each file's record count and the sha256 of
# its uncompressed JSONL (gzip headers may differ), every read verifies it, and nothing replaces a shipped file by
# one that lacks or changes any of its records unless asked to (``replace``).
MANIFEST = "manifest.json"


def payload_sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def manifest_entry(packed: Path) -> dict | None:
    """What the shipped directory's manifest says of ``packed`` (None: no manifest, or it does not list it)."""
    mpath = packed.parent / MANIFEST
    if not mpath.exists():
        return None
    try:
        files = json.loads(mpath.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{mpath}: unreadable manifest ({type(e).__name__}: {e}); restore it with git "
                         "checkout") from None
    return next((f for f in files if isinstance(f, dict) and f.get("file") == packed.name), None)


def read_shipped(packed: Path) -> bytes | None:
    """The verified JSONL bytes of a shipped file; None when nothing is shipped under that name. A file the
    manifest lists but that is missing, unreadable or edited (its sha256 differs) is an error, never a silent
    regeneration."""
    import gzip

    entry = manifest_entry(packed)
    fix = "restore it with git checkout, or set data.shipped_dir=null to regenerate"
    if not packed.exists():
        if entry and entry.get("done"):
            raise ValueError(f"{packed}: missing, though {packed.parent / MANIFEST} lists it with {entry['done']} "
                             f"records; {fix}")
        return None
    try:
        payload = gzip.decompress(packed.read_bytes())
    except (OSError, EOFError) as e:
        raise ValueError(f"{packed}: unreadable shipped regeneration ({type(e).__name__}: {e}); {fix}") from None
    want = (entry or {}).get("sha256")
    if want and payload_sha256(payload) != want:
        raise ValueError(f"{packed}: content sha256 {payload_sha256(payload)[:12]}… is not the {want[:12]}… its "
                         f"manifest records (the shipped data was edited); {fix}")
    return payload


def parse_records(payload: bytes, where: Path) -> dict[int, dict]:
    recs: dict[int, dict] = {}
    for n, line in enumerate(payload.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            recs[rec["index"]] = rec
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{where}: line {n} is not a regeneration record; restore it with git checkout") from None
    return recs


def sync_with_shipped(path: Path, packed: Path) -> None:
    """Bring the local cache file up to what is shipped: unpacked when absent; the shipped records it lacks added
    when it holds fewer (a stale or shorter copy: nothing it holds is lost); left alone when it holds them all. A
    local record that differs from the shipped one of the same index (a cache from another run or machine) is an
    error: resuming from it would silently replace shipped replies."""
    from data.resumable import load_done

    payload = read_shipped(packed)
    if payload is None:
        return
    shipped = parse_records(payload, packed)
    local = load_done(path, repair=False) if path.exists() else {}
    differ = next((i for i in sorted(shipped.keys() & local.keys()) if shipped[i] != local[i]), None)
    if differ is not None:
        raise ValueError(f"{path}: record {differ} differs from the shipped {packed}'s (a cache from another run or "
                         "machine); move it aside to use the shipped data, or set data.shipped_dir=null to keep it")
    lacking = shipped.keys() - local.keys()
    if not lacking:
        return
    from models.core.checkpoint import write_atomic

    merged = {**shipped, **local}
    write_atomic(path, _jsonl([merged[i] for i in sorted(merged)]),
                 "free space, or set data.cache_dir on a larger disk")
    how = "unpacked" if not local else f"added the {len(lacking)} records a local copy of {len(local)} lacked from"
    print(f"data: {how} the shipped regeneration {packed} into {path}", flush=True)


def pack_cache_file(path: Path, packed: Path, replace: bool = False) -> list[dict]:
    """A regeneration cache file's complete records (in index order) → ``packed`` (gzip, atomically); read beside
    a running writer, so a torn tail is skipped, never cut. Refuses to drop or change a record ``packed`` already
    holds (``replace``: ship anyway). Returns the records packed."""
    import gzip

    from data.resumable import load_done

    done = load_done(path, repair=False) if path.exists() else {}
    recs = [done[i] for i in sorted(done)]
    payload = _jsonl(recs)
    old = read_shipped(packed) if not replace else None
    if not recs and old is None:
        return recs  # nothing regenerated, nothing shipped: no empty file
    if old == payload:
        return recs  # nothing new: the shipped bytes stay (git sees no change, whatever wrote their header)
    if old is not None:
        shipped = parse_records(old, packed)
        lost = [i for i in sorted(shipped) if done.get(i) != shipped[i]]
        if lost:
            raise ValueError(f"refusing to ship {path} ({len(recs)} records) over {packed} ({len(shipped)}): it lacks "
                             f"or changes {len(lost)} of the shipped records, the first {lost[0]}; pass "
                             "--replace-shipped to ship it anyway")
    from models.core.checkpoint import write_atomic

    packed.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same records give the same bytes
    write_atomic(packed, gzip.compress(payload, compresslevel=9, mtime=0))
    return recs


def _jsonl(recs: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
