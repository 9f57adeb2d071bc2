"""scripts/ship_drafter.py stages its copy next to the destination, so the final rename never crosses file systems
(a destination on another mount than the system temp dir), and leaves no staging directory on any exit."""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.faults.fault_helpers import ROOT, small_tmpfs

_spec = importlib.util.spec_from_file_location("ship_drafter", ROOT / "scripts" / "ship_drafter.py")
ship_drafter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ship_drafter)


def _staged(d):
    return sorted(str(p) for p in d.rglob(".ship_*"))


def test_destination_on_another_file_system_with_absent_parents(trained, target_dir, tmp_path, capsys):
    """The destination's parents do not exist yet and it lives on its own mount (the system temp dir does not):
    staging in the temp dir made os.replace fail with "Invalid cross-device link"."""
    with small_tmpfs(tmp_path / "mnt", "16m") as mnt:
        dest = mnt / "repo" / "drafters" / "eagle3"
        assert ship_drafter.main([str(trained), str(dest), "--target", str(target_dir)]) == 0, \
            capsys.readouterr().err
        assert (dest / "final" / "model.safetensors").is_file() and (dest / "manifest.json").is_file()
        assert _staged(mnt) == []
    assert _staged(tmp_path) == [] and not list(Path(tempfile.gettempdir()).glob(".ship_*"))


def test_a_refused_copy_leaves_no_staging_directory(trained, tmp_path, capsys, monkeypatch):
    from models.core.target import FrozenTarget

    def refuse(*a, **k):
        raise ValueError("checkpoint was trained for another target")

    monkeypatch.setattr(FrozenTarget, "from_pretrained", refuse)
    dest = tmp_path / "repo" / "eagle3"
    assert ship_drafter.main([str(trained), str(dest), "--target", "elsewhere"]) == 2
    assert "another target" in capsys.readouterr().err
    assert not dest.exists() and _staged(tmp_path) == []
    monkeypatch.setattr(ship_drafter, "_stage", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ship_drafter.main([str(trained), str(dest)])
    assert not dest.exists() and _staged(tmp_path) == []


def test_staging_directories_are_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", "models/smollm2_drafters/.ship_abc123"], cwd=ROOT)
    assert r.returncode == 0


def test_a_killed_ship_is_cleaned_up_by_the_next(trained, tmp_path, capsys):
    """What kill -9 leaves: a staging directory of a dead pid (removed by the next ship, saying so; a live ship's is
    kept), and a --replace killed between its two renames (the old copy aside, no destination: put back, then
    replaced). Nothing else next to the destination is touched."""
    import os
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    repo = tmp_path / "repo"
    dest = repo / "eagle3"
    assert ship_drafter.main([str(trained), str(dest)]) == 0
    (dest / "old_copy").write_text("the earlier ship")
    os.replace(dest, repo / ".ship_old_eagle3")  # killed after moving the old copy aside
    (repo / f".ship_{dead.pid}_x1" / "final").mkdir(parents=True)  # killed while staging
    (repo / f".ship_{os.getpid()}_x2").mkdir()  # a ship still running (this process)
    (repo / ".ship_notes").write_text("mine")  # not the script's
    assert ship_drafter.main([str(trained), str(dest), "--replace"]) == 0
    err = capsys.readouterr().err
    assert f"removed {repo / f'.ship_{dead.pid}_x1'}" in err and f"put back {dest}" in err
    assert (dest / "manifest.json").is_file() and not (dest / "old_copy").exists()  # put back, then replaced
    assert sorted(p.name for p in repo.iterdir()) == [f".ship_{os.getpid()}_x2", ".ship_notes", "eagle3"]


def test_a_killed_replace_is_put_back_and_refused_without_replace(trained, tmp_path, capsys):
    """kill -9 between --replace's two renames leaves the old copy in the git-ignored .ship_old_<name> and no
    destination. A later ship without --replace puts it back and refuses (the destination exists again); it used to
    see no destination and replace the old copy with the new one."""
    import os

    repo = tmp_path / "repo"
    dest = repo / "eagle3"
    assert ship_drafter.main([str(trained), str(dest)]) == 0
    (dest / "old_copy").write_text("the earlier ship")
    os.replace(dest, repo / ".ship_old_eagle3")  # killed after moving the old copy aside
    capsys.readouterr()
    assert ship_drafter.main([str(trained), str(dest)]) == 2
    err = capsys.readouterr().err
    assert f"put back {dest}" in err and f"error: {dest} exists" in err and "--replace" in err, err
    assert (dest / "old_copy").read_text() == "the earlier ship" and (dest / "manifest.json").is_file()
    assert sorted(p.name for p in repo.iterdir()) == ["eagle3"]
