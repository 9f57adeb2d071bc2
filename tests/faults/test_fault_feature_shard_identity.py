"""Offline feature shards carry their own identity (the content they were built for: target, dtype, layers, rows),
so a cache directory whose manifest.json is gone never adopts shards it cannot vouch for: shards the cache wrote for
other content are rebuilt, shards of unknown origin (no identity, no manifest) are refused with the fix and left
where they are, and shards from before shards carried an identity stay usable while their manifest vouches for
them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from data.features import MANIFEST, FeatureCache
from data.sources import DataConfig, build_rows
from models.core.target import FrozenTarget
from tests.conftest import make_tiny_llama


@pytest.fixture(scope="module")
def targets(target_dir):
    """The tiny target and another one of the same shape and tokenizer (other weights)."""
    ours = FrozenTarget.from_pretrained(str(target_dir))
    other = FrozenTarget(make_tiny_llama(len(ours.tokenizer), seed=1), ours.tokenizer)
    rows, _ = build_rows(DataConfig(max_rows=8, max_len=32, val_rows=1), ours.tokenizer)
    return ours, other, rows


def _cache(root, target, rows):
    return FeatureCache(root, target, rows, [1, 2], dtype="float32", shard_rows=4)


def _same_features(a: FeatureCache, b: FeatureCache, n: int) -> bool:
    return all(torch.equal(a.get(r)[k], b.get(r)[k]) for r in range(n) for k in a.layer_ids)


def _strip_identity(cache: FeatureCache) -> None:
    """Rewrite each shard as caches wrote them before shards carried an identity (no safetensors metadata)."""
    for i in range(cache.n_shards()):
        p = cache.shard_path(i)
        save_file(load_file(str(p)), str(p))


def test_heldout_cache_without_manifest_rebuilds_shards_built_for_another_target(targets, tmp_path):
    ours, other, rows = targets
    held = tmp_path / "feat" / "heldout_8"
    _cache(held, other, rows).build(show_progress=False)
    (held / MANIFEST).unlink()
    cache = _cache(held, ours, rows)
    cache.build(show_progress=False)
    fresh = _cache(tmp_path / "fresh", ours, rows)
    fresh.build(show_progress=False)
    assert _same_features(cache, fresh, len(rows))  # the other target's states were not adopted
    again = _cache(held, ours, rows)  # and what was rebuilt now carries this cache's identity: kept as it is
    mtimes = [again.shard_path(i).stat().st_mtime_ns for i in range(again.n_shards())]
    again.build(show_progress=False)
    assert mtimes == [again.shard_path(i).stat().st_mtime_ns for i in range(again.n_shards())]


def test_shards_of_unknown_origin_without_manifest_are_refused_and_kept(targets, tmp_path):
    ours, other, rows = targets
    root = tmp_path / "heldout_8"
    foreign = _cache(root, other, rows)
    foreign.build(show_progress=False)
    _strip_identity(foreign)
    (root / MANIFEST).unlink()
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    with pytest.raises(ValueError) as e:
        _cache(root, ours, rows).build(show_progress=False)
    line = str(e.value)
    assert "\n" not in line and str(foreign.shard_path(0)) in line
    assert "no identity" in line and f"rm {root}/shard_" in line and "train.feature_cache" in line
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before  # nothing deleted, no manifest written


def test_shards_without_identity_stay_usable_while_their_manifest_vouches_for_them(targets, tmp_path, monkeypatch):
    ours, _, rows = targets
    old = _cache(tmp_path / "old", ours, rows)
    old.build(show_progress=False)
    _strip_identity(old)
    built: list[int] = []
    monkeypatch.setattr(FeatureCache, "_build_shard", lambda self, i: built.append(i))
    reread = _cache(tmp_path / "old", ours, rows)
    reread.build(show_progress=False)
    assert built == []
    fresh = _cache(tmp_path / "fresh", ours, rows)
    monkeypatch.undo()
    fresh.build(show_progress=False)
    assert _same_features(reread, fresh, len(rows))
