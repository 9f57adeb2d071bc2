"""The shipped regeneration (data/shipped/, python -m train.regenerate --ship) is treated like a checkpoint: the round
trip unpack → resume → ship is exercised against a stale, a shorter, an edited and a missing file, and against a
ship that would list fewer files or be killed while writing its manifest. Each case either completes from what is
shipped or stops with one line, and the shipped bytes never shrink or change."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from data.regen_cache import pack_cache_file
from train.regenerate import regenerate, ship


def _snapshot(d: Path) -> dict:
    """Every shipped file's bytes, and the manifest's file entries (its data_config names this test's temp dirs)."""
    snap: dict = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "manifest.json"}
    snap["manifest.json"] = json.loads((d / "manifest.json").read_text())["files"]
    return snap


@pytest.fixture(scope="module")
def shipped_run(tmp_path_factory, target_dir):
    """4 conversations regenerated (2 greedy, 2 at T=1) by the tiny target and shipped; the overrides that made them."""
    root = tmp_path_factory.mktemp("shipped_run")
    src = root / "chats.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i}?"},
                                                         {"from": "gpt", "value": f"answer {i}"}]}) + "\n"
                           for i in range(6)))
    over = [f"target.name_or_path={target_dir}", "data=sharegpt", f"data.source={src}", "data.regenerate=4",
            "data.regen_temperature=[0.0,1.0]", "data.regen_new_tokens=3", "data.regen_batch_size=2",
            f"data.cache_dir={root / 'cache'}", f"data.shipped_dir={root / 'shipped'}", "data.max_len=64"]
    regenerate(over, None, threads=0)
    ship(over)
    return root, over


@pytest.fixture
def fresh(shipped_run, tmp_path):
    """A copy of the shipped directory and overrides pointing a new, empty cache at it (a fresh machine)."""
    root, over = shipped_run
    shipped = tmp_path / "shipped"
    shutil.copytree(root / "shipped", shipped)
    over = [o for o in over if not o.startswith(("data.cache_dir", "data.shipped_dir"))]
    return shipped, tmp_path / "cache", over + [f"data.cache_dir={tmp_path / 'cache'}", f"data.shipped_dir={shipped}"]


def _files(shipped: Path) -> list[dict]:
    return json.loads((shipped / "manifest.json").read_text())["files"]


def _records(gz: Path) -> list[str]:
    return gzip.decompress(gz.read_bytes()).decode().splitlines(keepends=True)


def test_a_fresh_machine_unpacks_resumes_and_ships_the_same_bytes(fresh):
    shipped, cache, over = fresh
    before = _snapshot(shipped)
    got = regenerate(over, None, threads=0)
    assert [g["generated_now"] for g in got["groups"]] == [0, 0]  # everything came from the shipped files
    ship(over)
    assert _snapshot(shipped) == before
    assert all(len(f["sha256"]) == 64 and f["done"] == 2 for f in _files(shipped))


def test_a_stale_local_cache_is_refused_and_the_shipped_file_kept(fresh):
    """A local cache from another run (its record 0 differs from the shipped one) used to shadow the shipped file:
    regeneration resumed from it and --ship rewrote the shipped file and manifest to its records."""
    shipped, cache, over = fresh
    before = _snapshot(shipped)
    gz = shipped / _files(shipped)[0]["file"]
    stale = json.loads(_records(gz)[0])
    stale["messages"][-1]["content"] = "a reply from another machine"
    cache.mkdir()
    (cache / gz.name.removesuffix(".gz")).write_text(json.dumps(stale) + "\n")
    with pytest.raises(ValueError, match="record 0 differs from the shipped"):
        regenerate(over, None, threads=0)
    with pytest.raises(ValueError, match="record 0 differs from the shipped"):
        ship(over)
    assert _snapshot(shipped) == before


def test_a_shorter_local_cache_is_completed_and_never_shipped_over_more(fresh, monkeypatch):
    shipped, cache, over = fresh
    before = _snapshot(shipped)
    gz = shipped / _files(shipped)[0]["file"]
    local = cache / gz.name.removesuffix(".gz")
    cache.mkdir()
    local.write_text(_records(gz)[0])  # what a killed unpack-and-resume on this machine left: the first record
    got = regenerate(over, None, threads=0)
    assert [g["generated_now"] for g in got["groups"]] == [0, 0]
    assert local.read_text().splitlines(keepends=True) == _records(gz)
    ship(over)
    assert _snapshot(shipped) == before
    # packing a shorter file over the shipped one directly is refused, unless asked for
    short = cache / "short.jsonl"
    short.write_text(_records(gz)[0])
    with pytest.raises(ValueError, match="lacks or changes 1 of the shipped records, the first 1"):
        pack_cache_file(short, gz)
    assert gz.read_bytes() == before[gz.name]
    assert len(pack_cache_file(short, gz, replace=True)) == 1


def test_an_edited_shipped_file_is_refused_on_read(fresh):
    """An edited reply, re-gzipped: the manifest's content hash no longer matches, so nothing trains on it."""
    shipped, cache, over = fresh
    gz = shipped / _files(shipped)[1]["file"]
    recs = _records(gz)
    rec = json.loads(recs[1])
    rec["messages"][-1]["content"] += " (edited)"
    gz.write_bytes(gzip.compress((recs[0] + json.dumps(rec) + "\n").encode(), mtime=0))
    with pytest.raises(ValueError, match="the shipped data was edited"):
        regenerate(over, None, threads=0)
    with pytest.raises(ValueError, match="the shipped data was edited"):
        ship(over)


def test_a_missing_shipped_file_is_an_error_not_an_empty_file(fresh):
    shipped, cache, over = fresh
    gz = shipped / _files(shipped)[0]["file"]
    gz.unlink()
    with pytest.raises(ValueError, match="missing, though .*manifest.json lists it with 2 records"):
        regenerate(over, None, threads=0)
    with pytest.raises(ValueError, match="missing, though"):
        ship(over)
    assert not gz.exists()


def test_a_group_not_generated_yet_ships_no_file(tmp_path, shipped_run):
    root, over = shipped_run
    over = [o for o in over if not o.startswith(("data.cache_dir", "data.shipped_dir"))]
    over += [f"data.cache_dir={tmp_path / 'cache'}", f"data.shipped_dir={tmp_path / 'shipped'}"]
    regenerate(over, [0.0], threads=0)
    files = ship(over)["files"]
    assert [f["temperature"] for f in files] == [0.0]
    assert sorted(p.name.endswith(".gz") for p in (tmp_path / "shipped").iterdir()).count(True) == 1


def test_a_ship_with_a_config_that_makes_fewer_files_is_refused(fresh):
    """The Makefile's default `make smollm2-data` (without the later-turn data config) dropped the later-turn files
    from the manifest: they stayed on disk, unlisted and unverified."""
    shipped, cache, over = fresh
    more = over + ["data.regen_extra=2", "data.regen_extra_dtype=bfloat16"]  # a later tranche, its own file
    regenerate(more, [1.0], threads=0)
    assert len(ship(more)["files"]) == 3
    before = _snapshot(shipped)
    with pytest.raises(ValueError, match="lists 1 file.* this data config does not make"):
        ship(over)
    assert _snapshot(shipped) == before
    assert len(ship(over, replace=True)["files"]) == 2


def test_a_ship_killed_while_writing_its_manifest_leaves_the_old_one(fresh, monkeypatch):
    import os

    shipped, cache, over = fresh
    before = _snapshot(shipped)
    real = os.replace

    def killed(src, dst):
        if Path(dst).name == "manifest.json":
            raise KeyboardInterrupt  # the kill between writing the temp file and the rename
        return real(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        ship(over)
    monkeypatch.undo()
    assert _snapshot(shipped) == before  # no torn manifest, no temp file left behind
