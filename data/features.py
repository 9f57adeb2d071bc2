"""Offline mode: the target's hidden states computed once into a sharded on-disk cache.

Per row we store the requested layers' states plus the last hidden state after the final norm
(id L), from which the target's logits are recomputed on the fly with its lm_head — storing
logits would cost V/H times more disk — and the target's full-vocabulary argmax (``{row}.top``, int32), so a
reduced-vocabulary drafter's step computes the lm_head over its draft vocabulary only (``DraftVocabTeacher``).
Shards are safetensors files written atomically, so an interrupted build resumes at the first missing shard. The
manifest reports bytes per token. Each shard also records in its safetensors metadata the content it was built for
(target, dtype, layers, its rows): a directory whose manifest is gone adopts only the shards that say they are this
cache's, rebuilds the ones another cache wrote, and refuses shards that say nothing unless a manifest vouches for
them (shards from before shards carried an identity).

One cache can serve several methods: it may store more layers than a method reads (``store_layer_ids``, from
``train.feature_layers``), and a cache whose stored layers include the requested ones is reused as it is, so the
30-layer target runs once for every recipe that shares the directory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from models.core.checkpoint import out_of_space_as_error
from models.core.drafter import DraftVocabTeacher, softcap
from models.core.kernels import cast_copy, native_bf16
from models.core.target import FrozenTarget, parse_dtype

MANIFEST = "manifest.json"
SHARD_IDENTITY = "draftsmith.feature_shard"  # the safetensors metadata key a shard's identity is stored under
_FIX = "free space, or point train.feature_cache at a larger disk"


def _key(meta: dict) -> dict:
    """What decides the content, bar the layer set (a superset serves a subset) and the rows (rows that extend the
    cache's own reuse its full shards): both checked apart."""
    return {k: meta[k] for k in ("target", "dtype", "shard_rows")}


def _valid_shards(old: dict, rows: list[dict], shard_rows: int) -> int | None:
    """How many leading shards of a cache built by ``old`` (its manifest) hold exactly ``rows``' first shards: all
    of them for the same rows; the full ones when ``rows`` extend the old rows (a second data tranche appended to
    the first); None for any other rows (fewer rows too: the cache stays whole for the run that built it)."""
    n_old = old["rows"]
    if len(rows) < n_old or _row_digest(rows[:n_old]) != old["row_digest"]:
        return None
    return -(-n_old // shard_rows) if len(rows) == n_old else n_old // shard_rows


def _row_digest(rows: list[dict]) -> str:
    import hashlib

    h = hashlib.sha256()
    for r in rows:
        h.update(str(r["input_ids"]).encode())
    return h.hexdigest()[:16]


def resolve_compute_dtype(setting: str | None) -> str | None:
    """``train.cache_compute_dtype``: null computes the cache in the target's dtype; ``auto`` in bf16 where the CPU
    has a bf16 dot product (the batched forward ~2x fp32's speed there), else in the target's dtype."""
    if setting == "auto":
        return "bfloat16" if native_bf16() else None
    return setting


class FeatureCache:
    def __init__(self, root: Path, target: FrozenTarget, rows: list[dict], layer_ids: list[int],
                 dtype: str = "bfloat16", shard_rows: int = 64, batch_size: int = 8,
                 store_layer_ids: list[int] | None = None, compute_dtype: str | None = None):
        self.root, self.target, self.rows = Path(root), target, rows
        # the target that computes the states: ``target`` itself, or a copy in ``compute_dtype`` (bf16 runs a
        # batched forward ~2x faster than fp32 on a CPU with AVX-512 BF16); training reads the teacher's lm_head from
        # ``target`` either way
        self.compute_dtype = cdt = parse_dtype(compute_dtype) if compute_dtype else target.model.dtype
        self.compute = target  # the copy is made by build(), only when it has shards to compute, and dropped after
        self.layer_ids = sorted(set(layer_ids) | {target.num_layers})  # what get/batch return
        bad = [k for k in store_layer_ids or [] if not 0 <= k <= target.num_layers]
        if bad:
            raise ValueError(f"train.feature_layers {bad}: layer ids must lie in [0, {target.num_layers}]")
        self.stored = sorted(set(self.layer_ids) | set(store_layer_ids or []))  # what the shards hold
        self.dtype, self.shard_rows, self.batch_size = parse_dtype(dtype), shard_rows, batch_size
        ident = target.identity()
        if cdt != torch.float32:  # states depend on the dtype the target computes in
            ident["compute_dtype"] = str(cdt).replace("torch.", "")
        self.meta = {"target": ident, "layer_ids": self.stored, "dtype": str(self.dtype),
                     "rows": len(rows), "shard_rows": shard_rows, "row_digest": _row_digest(rows)}
        self._shard: tuple[int, dict[str, torch.Tensor]] | None = None

    def n_shards(self) -> int:
        return -(-len(self.rows) // self.shard_rows)

    def shard_path(self, i: int) -> Path:
        return self.root / f"shard_{i:05d}.safetensors"

    def build(self, show_progress: bool = True) -> dict:
        self.root.mkdir(parents=True, exist_ok=True)
        mpath = self.root / MANIFEST
        vouched = 0  # leading shards a manifest of this content vouches for (those may predate shard identities)
        if mpath.exists():
            raw = mpath.read_bytes()
            try:  # emptied or torn (a kill while it was written): the shards cannot be checked against this run
                old = json.loads(raw)
                if not isinstance(old, dict) or "layer_ids" not in old:
                    raise ValueError("no layer_ids")
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError too
                what = "empty" if not raw.strip() else f"damaged ({str(e).splitlines()[0][:80]})"
                raise ValueError(f"feature cache {self.root} cannot be checked against this run: its manifest {mpath} "
                                 f"is {what}; delete it to rebuild (rm -r {self.root}), or set "
                                 "train.feature_cache to a new directory") from None
            valid = _valid_shards(old, self.rows, self.shard_rows) if _key(old) == _key(self.meta) else None
            if valid is None:
                raise ValueError(f"feature cache {self.root} was built for other data/target/dtype; "
                                 "delete it or set train.feature_cache to a new directory")
            missing = sorted(set(self.layer_ids) - set(old["layer_ids"]))
            if missing:
                raise ValueError(f"feature cache {self.root} stores layers {old['layer_ids']}, not {missing}; "
                                 "set train.feature_cache to a new directory (train.feature_layers: the union "
                                 "of every method that shares one)")
            # the rows grew: the old last shard, if partial, was built for fewer rows; this cache wrote it, and it
            # goes before the new manifest (a kill in between leaves the old one, which says the same)
            for i in range(valid, -(-old["rows"] // self.shard_rows)):
                self.shard_path(i).unlink(missing_ok=True)
            self.stored = list(old["layer_ids"])  # reused as built: its shards hold these
            self.meta["layer_ids"] = self.stored
            # the ledger of the build that made it survives runs that only read it
            self.meta.update({k: v for k, v in old.items() if k.startswith("build_")})
            vouched = valid
        todo = self._shards_to_build(vouched)  # before the manifest: a refusal leaves the directory as it was
        self._write_manifest(mpath)
        t0 = time.time()
        if todo and self.compute_dtype != self.target.model.dtype:
            self.compute = FrozenTarget(cast_copy(self.target.model, self.compute_dtype), self.target.tokenizer)
        try:
            for i in tqdm(todo, desc="feature cache", disable=not show_progress):
                self._build_shard(i)
        finally:
            self.compute = self.target
        secs = time.time() - t0
        n_bytes = sum(self.shard_path(i).stat().st_size for i in range(self.n_shards()))
        n_tok = sum(len(r["input_ids"]) for r in self.rows)
        self.meta.update(bytes=n_bytes, tokens=n_tok, bytes_per_token=n_bytes / max(1, n_tok))
        if todo:  # the throughput ledger: target tokens/s of this build (resumed builds: the part built now)
            built = sum(len(r["input_ids"]) for i in todo
                        for r in self.rows[i * self.shard_rows : (i + 1) * self.shard_rows])
            self.meta.update(build_seconds=round(secs, 1), build_tokens=built,
                             build_tokens_per_s=round(built / max(secs, 1e-9), 1),
                             build_threads=torch.get_num_threads())
        self._write_manifest(mpath)
        return self.meta

    def shard_identity(self, i: int) -> str:
        """What shard ``i`` of this cache holds: the content key, the layers stored and its rows."""
        lo, hi = i * self.shard_rows, min(len(self.rows), (i + 1) * self.shard_rows)
        return json.dumps({**_key(self.meta), "layer_ids": self.stored, "rows": [lo, hi],
                           "row_digest": _row_digest(self.rows[lo:hi])}, sort_keys=True)

    def _shards_to_build(self, vouched: int) -> list[int]:
        """The shards to (re)build: missing ones, and ones another cache wrote (their identity is not this cache's;
        this class wrote them, so they are replaced). A shard without an identity is kept only where a manifest of
        this content vouches for it; otherwise nothing says whose features it holds, and it is refused, not
        deleted (no command deletes what it did not write)."""
        todo = []
        for i in range(self.n_shards()):
            p = self.shard_path(i)
            if not p.exists():
                todo.append(i)
                continue
            try:
                with safe_open(str(p), "pt") as f:
                    ident = (f.metadata() or {}).get(SHARD_IDENTITY)
            except Exception as e:  # noqa: BLE001 - truncated/corrupt header: name it and the fix
                raise ValueError(f"{p}: unreadable feature shard ({type(e).__name__}: {e}); delete it and rerun to "
                                 "rebuild it") from None
            if ident is None and i >= vouched:
                raise ValueError(f"feature cache {self.root}: {p} carries no identity and no manifest vouches for "
                                 "it, so it may hold another target's or data's features; delete the shards (rm "
                                 f"{self.root}/shard_*.safetensors) or set train.feature_cache to a new directory")
            if ident is not None and ident != self.shard_identity(i):
                todo.append(i)
        return todo

    def _write_manifest(self, mpath: Path) -> None:
        """Atomically (temp file + rename): a kill or a full disk never leaves an empty or torn manifest."""
        tmp = mpath.with_name(MANIFEST + ".tmp")
        try:
            with out_of_space_as_error(mpath, _FIX):
                tmp.write_text(json.dumps(self.meta, indent=1))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, mpath)

    @torch.no_grad()
    def _build_shard(self, i: int) -> None:
        lo, hi = i * self.shard_rows, min(len(self.rows), (i + 1) * self.shard_rows)
        tensors: dict[str, torch.Tensor] = {}
        # rows batched in order of length: a batch is padded to its longest row, so this pads far less
        order = sorted(range(lo, hi), key=lambda r: len(self.rows[r]["input_ids"]))
        for b in range(0, len(order), self.batch_size):
            chunk = order[b : b + self.batch_size]
            ids = pad_ids([self.rows[r]["input_ids"] for r in chunk], self.target.model.config.pad_token_id or 0)
            ids = ids.to(self.compute.embed.weight.device)
            out = self.compute(ids, layer_ids=self.stored, logits_to_keep=1)  # logits come from h_L later
            top = self._head(out.hidden[self.target.num_layers]).argmax(-1)  # [b, T], from h_L before rounding
            for j, r in enumerate(chunk):
                n = len(self.rows[r]["input_ids"])
                for k in self.stored:
                    tensors[f"{r}.{k}"] = out.hidden[k][j, :n].to("cpu", self.dtype).contiguous()
                tensors[f"{r}.top"] = top[j, :n].to("cpu", torch.int32).contiguous()
        tmp = self.shard_path(i).with_suffix(".tmp")
        try:
            with out_of_space_as_error(self.shard_path(i), _FIX):
                save_file(tensors, str(tmp), metadata={"format": "pt", SHARD_IDENTITY: self.shard_identity(i)})
        except BaseException:
            tmp.unlink(missing_ok=True)  # a half shard would only fill the disk further
            raise
        os.replace(tmp, self.shard_path(i))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        head = self.compute.model.get_output_embeddings()
        return self._capped(head(h.to(head.weight.dtype)).float())

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's final-logit soft-capping (Gemma-2), which its forward applies after the head: the teacher
        must be the logits the target computes, not the head's raw product."""
        return softcap(logits, getattr(self.target.model.config, "final_logit_softcapping", None))

    def _load_shard(self, row: int) -> dict[str, torch.Tensor]:
        s = row // self.shard_rows
        if self._shard is None or self._shard[0] != s:
            try:
                self._shard = (s, load_file(str(self.shard_path(s))))
            except Exception as e:  # noqa: BLE001 - truncated/corrupt shard: name it and the fix
                raise ValueError(f"{self.shard_path(s)}: unreadable feature shard ({type(e).__name__}: {e}); delete "
                                 "it and rerun to rebuild it") from None
        return self._shard[1]

    def get(self, row: int) -> dict[int, torch.Tensor]:
        shard = self._load_shard(row)
        return {k: shard[f"{row}.{k}"].float() for k in self.layer_ids}

    def has_top(self) -> bool:
        """Whether the shards store the target's argmax (caches built before it did not)."""
        return f"{(self.n_shards() - 1) * self.shard_rows}.top" in self._load_shard((self.n_shards() - 1)
                                                                                   * self.shard_rows)

    @torch.no_grad()
    def batch(self, rows: list[int], width: int, draft_ids: torch.Tensor | None = None
              ) -> tuple[dict[int, torch.Tensor], torch.Tensor | DraftVocabTeacher]:
        """Hidden states {id: [B, width, H]} (zero-padded) and the target's logits [B, width, V]; with
        ``draft_ids`` (and a cache that stores the argmax), a ``DraftVocabTeacher`` instead: logits at those ids."""
        per = [self.get(r) for r in rows]
        hidden = {}
        dev = self.target.embed.weight.device  # read on the CPU, returned where the target (and drafter) is
        for k in self.layer_ids:
            h = torch.zeros(len(rows), width, per[0][k].shape[-1])
            for j, p in enumerate(per):
                h[j, : p[k].shape[0]] = p[k]
            hidden[k] = h.to(dev)
        h_last = hidden[self.target.num_layers]
        if draft_ids is None:
            return hidden, self._head(h_last)
        top = torch.zeros(len(rows), width, dtype=torch.long)
        for j, r in enumerate(rows):
            t = self._load_shard(r)[f"{r}.top"]
            top[j, : t.shape[0]] = t.long()
        draft_ids = draft_ids.to(dev)
        w = self.target.model.get_output_embeddings().weight.index_select(0, draft_ids)  # [Vd, H]
        logits = self._capped(torch.nn.functional.linear(h_last.to(w.dtype), w).float())
        return hidden, DraftVocabTeacher(top.to(dev), logits, draft_ids)


def pad_ids(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right padding: with causal attention, pads after a row's end cannot change its states."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for j, s in enumerate(seqs):
        out[j, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out
