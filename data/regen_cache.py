"""The regeneration cache: a file of target-regenerated text named by a hash of everything its content depends on
(``regen_cache_path``), and its shipped, compressed form (``pack_cache_file`` / ``unpack_shipped``) that a fresh
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

    from models.core.target import FrozenTarget

    ident = {k: v for k, v in FrozenTarget(model, tok).identity().items() if k != "name_or_path"}
    vocab = sorted(tok.get_vocab().items())
    key = {"kind": kind, "target": ident,
           "tokenizer": {"size": len(tok), "vocab": _sha(vocab), "template": getattr(tok, "chat_template", None)},
           "inputs": _sha(inputs),
           "temperature": float(cfg.regen_temperature if temperature is None else temperature),
           "top_p": 1.0, "top_k": 0, "seed": cfg.seed, "max_new_tokens": cfg.regen_new_tokens,
           "generator": REFILL_GENERATOR if refill else GENERATOR}
    if model.dtype != torch.float32:  # the text depends on the dtype the target computes in (fp32 keys as before)
        key["dtype"] = str(model.dtype).replace("torch.", "")
    digest = _sha(key)[:16]
    path = Path(cfg.cache_dir) / f"regen_{kind}_{digest}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.shipped_dir and not path.exists():
        unpack_shipped(Path(cfg.shipped_dir) / (path.name + ".gz"), path)
    meta = path.with_suffix(".key.json")  # for people: what the hash covers
    if not meta.exists():
        from models.core.checkpoint import out_of_space_as_error

        with out_of_space_as_error(meta, "free space, or set data.cache_dir on a larger disk"):
            meta.write_text(json.dumps(key, indent=1))
    return path


def pack_cache_file(path: Path, packed: Path) -> list[dict]:
    """A regeneration cache file's complete records (in index order) → ``packed`` (gzip, atomically); read beside
    a running writer, so a torn tail is skipped, never cut. Returns the records packed."""
    import gzip
    import os

    from data.resumable import load_done

    done = load_done(path, repair=False) if path.exists() else {}
    recs = [done[i] for i in sorted(done)]
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()
    if packed.exists() and gzip.decompress(packed.read_bytes()) == payload:
        return recs  # nothing new: the shipped bytes stay (git sees no change, whatever wrote their header)
    packed.parent.mkdir(parents=True, exist_ok=True)
    tmp = packed.with_name(packed.name + f".tmp{os.getpid()}")
    try:
        # mtime=0: the same records give the same bytes
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as fh:
            fh.write(payload)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, packed)
    return recs


def unpack_shipped(packed: Path, path: Path) -> bool:
    """``packed`` (gzip, from ``python -m train.regenerate --ship``) → ``path``, atomically; False when nothing
    is shipped."""
    import gzip
    import os

    if not packed.exists():
        return False
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with gzip.open(packed, "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (OSError, EOFError) as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{packed}: unreadable shipped regeneration ({type(e).__name__}: {e}); restore it with "
                         "git checkout, or set data.shipped_dir=null to regenerate") from None
    os.replace(tmp, path)
    print(f"data: unpacked the shipped regeneration {packed} into {path}", flush=True)
    return True


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
