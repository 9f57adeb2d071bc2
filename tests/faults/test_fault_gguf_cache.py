"""The GGUF conversion cache (models/core/gguf.py) is never trusted blindly: an entry is checked against the file sizes
and the weights' sha256 recorded when it was converted, and a damaged one is converted again, saying so; what a
killed conversion left is removed; a read-only or full cache is one `error:` line naming it and DRAFTSMITH_CACHE."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="pip install -e '.[real]' (gguf) for the GGUF tests")
pytest.importorskip("accelerate", reason="pip install -e '.[real]' (accelerate) for the GGUF tests")

from transformers import AutoTokenizer  # noqa: E402

from models.core import gguf as mgguf  # noqa: E402
from models.core.target import EMBEDDED_DIR, FrozenTarget  # noqa: E402
from tests.faults.fault_helpers import (  # noqa: E402
    PAGE,
    cfg_for,
    eval_error,
    fill_disk,
    one_error_line,
    remount_readonly,
    small_tmpfs,
)
from tests.test_gguf import make_model, write_llama_gguf  # noqa: E402

IDS = torch.tensor([[5, 17, 42, 99, 7]])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    model = make_model(len(tok), tied=False, seed=3)
    path = write_llama_gguf(model, tok, tmp_path_factory.mktemp("gguf_src") / "tiny.gguf")
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
    return path, ref


def _use(root, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(root))
    return root / "gguf"


def _entry(cache, path):
    return cache / mgguf.file_sha256(path)[:16]


def _load_matches(path, ref):
    with torch.no_grad():
        torch.testing.assert_close(FrozenTarget.from_pretrained(str(path)).model(input_ids=IDS).logits, ref,
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("damage", ["truncated", "same-size", "deleted-tokenizer"])
def test_damaged_entry_is_converted_again_saying_so(built, tmp_path, monkeypatch, capsys, damage):
    path, ref = built
    cache = _use(tmp_path / "c", monkeypatch)
    FrozenTarget.from_pretrained(str(path))
    d = _entry(cache, path)
    src = json.loads((d / mgguf.SOURCE_FILE).read_text())
    assert src["files"]["model.safetensors"] == (d / "model.safetensors").stat().st_size
    assert len(src["weights_sha256"]) == 64
    w = d / "model.safetensors"
    if damage == "truncated":
        os.truncate(w, w.stat().st_size // 2)
    elif damage == "same-size":
        data = bytearray(w.read_bytes())
        data[-100:] = b"\xff" * 100  # NaN patterns in the last tensor, size unchanged
        w.write_bytes(bytes(data))
    else:
        (d / "tokenizer.json").unlink()
    mgguf._SHA_MEMO.clear()  # a new process: nothing memoised
    capsys.readouterr()
    _load_matches(path, ref)
    out = [x for x in capsys.readouterr().out.splitlines() if " is damaged (" in x]
    assert len(out) == 1 and str(d) in out[0] and f"converting {path} again" in out[0], out
    assert {"truncated": "model.safetensors is ", "same-size": "sha256 differs",
            "deleted-tokenizer": "tokenizer.json is missing"}[damage] in out[0]
    assert sorted(p.name for p in cache.iterdir()) == [d.name]  # nothing aside left behind


def test_entry_without_a_record_is_checked_and_recorded(built, tmp_path, monkeypatch, capsys):
    """An entry converted before sizes were recorded: used if its weights are whole (and recorded from then on),
    converted again if they are cut."""
    path, ref = built
    cache = _use(tmp_path / "c", monkeypatch)
    FrozenTarget.from_pretrained(str(path))
    d = _entry(cache, path)
    src = json.loads((d / mgguf.SOURCE_FILE).read_text())
    legacy = {k: v for k, v in src.items() if k not in ("files", "weights_sha256")}
    (d / mgguf.SOURCE_FILE).write_text(json.dumps(legacy))
    monkeypatch.setattr(mgguf, "convert", lambda *a: pytest.fail("a whole entry was converted again"))
    _load_matches(path, ref)
    assert json.loads((d / mgguf.SOURCE_FILE).read_text())["files"] == src["files"]
    monkeypatch.undo()
    _use(tmp_path / "c", monkeypatch)
    (d / mgguf.SOURCE_FILE).write_text(json.dumps(legacy))
    w = d / "model.safetensors"
    os.truncate(w, w.stat().st_size - 4096)
    capsys.readouterr()
    _load_matches(path, ref)
    assert "its header says" in capsys.readouterr().out


def test_temp_dirs_of_dead_conversions_are_removed(built, tmp_path, monkeypatch, capsys):
    path, ref = built
    cache = _use(tmp_path / "c", monkeypatch)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = mgguf.file_sha256(path)[:16]
    stale, live = cache / f"{key}.tmp{dead.pid}", cache / f"0123456789abcdef.tmp{os.getppid()}"
    for d in (stale, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    capsys.readouterr()
    _load_matches(path, ref)
    assert not stale.exists() and live.exists()  # a conversion still running keeps its own
    assert f"removed {stale}" in capsys.readouterr().out


def _cli_error(cfg, capsys) -> str:
    from train.__main__ import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main.__wrapped__(cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_read_only_cache_is_one_line_before_any_work(built, tmp_path, monkeypatch, capsys):
    path, ref = built
    with small_tmpfs(tmp_path / "ro", "8m") as mnt:
        remount_readonly(mnt)
        _use(mnt, monkeypatch)
        monkeypatch.setattr(mgguf, "_read_gguf", lambda *a: pytest.fail("dequantized before checking the cache"))
        line = _cli_error(cfg_for(path, tmp_path / "run"), capsys)
        assert f"GGUF cache {mnt / 'gguf'} is not writable (read-only file system)" in line
        assert "DRAFTSMITH_CACHE" in line


def test_read_only_cache_holding_the_entry_is_used(built, tmp_path, monkeypatch):
    path, ref = built
    with small_tmpfs(tmp_path / "ro", "16m") as mnt:
        _use(mnt, monkeypatch)
        FrozenTarget.from_pretrained(str(path))
        remount_readonly(mnt)
        mgguf._SHA_MEMO.clear()
        _load_matches(path, ref)


def test_full_cache_is_one_line_and_leaves_nothing(built, tmp_path, monkeypatch, capsys):
    path, _ = built
    with small_tmpfs(tmp_path / "full", "8m") as mnt:
        cache = _use(mnt, monkeypatch)
        cache.mkdir()
        filler = fill_disk(mnt, leave=64 * PAGE)  # room for the temp dir, not for the weights
        line = _cli_error(cfg_for(path, tmp_path / "run"), capsys)
        assert line.startswith(f"error: no space left on device at {cache} (converting tiny.gguf")
        assert "DRAFTSMITH_CACHE" in line
        assert list(cache.iterdir()) == [] and filler.exists()


def test_read_only_cache_is_one_line_in_eval_too(built, tmp_path):
    """python -m eval on a GGUF target with a read-only cache: the same one line, exit 2, no Hydra block."""
    path, _ = built
    with small_tmpfs(tmp_path / "ro", "8m") as mnt:
        remount_readonly(mnt)
        r = subprocess.run([sys.executable, "-m", "eval", f"target.name_or_path={path}", f"out_dir={tmp_path}/ev",
                            "methods=[ar]", "n_prompts=1", "peers=false", "batch_sizes=[]", "decode_step=eager"],
                           env={**os.environ, "DRAFTSMITH_CACHE": str(mnt)}, capture_output=True, text=True)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"GGUF cache {mnt / 'gguf'} is not writable" in lines[0] and "DRAFTSMITH_CACHE" in lines[0]


def _export_error(ckpt, path, tmp_path, capsys) -> str:
    """``python -m train.export CKPT --target X.gguf``: exit 2, its one error line, no --out written."""
    from train.export import main

    capsys.readouterr()
    assert main([str(ckpt), "--format", "eagle3", "--out", str(tmp_path / "exp"), "--target", str(path)]) == 2
    assert not (tmp_path / "exp").exists()
    return one_error_line(capsys)


def test_read_only_cache_is_one_line_in_export_too(built, trained, tmp_path, monkeypatch, capsys):
    path, _ = built
    with small_tmpfs(tmp_path / "ro", "8m") as mnt:
        remount_readonly(mnt)
        _use(mnt, monkeypatch)
        monkeypatch.setattr(mgguf, "_read_gguf", lambda *a: pytest.fail("dequantized before checking the cache"))
        line = _export_error(trained / "final", path, tmp_path, capsys)
    assert f"GGUF cache {mnt / 'gguf'} is not writable (read-only file system)" in line, line
    assert "DRAFTSMITH_CACHE" in line


@pytest.mark.parametrize("cli", ["eval", "export"])
def test_full_cache_is_one_line_in_eval_and_export(built, trained, tmp_path, monkeypatch, capsys, cli):
    path, _ = built
    with small_tmpfs(tmp_path / "full", "8m") as mnt:
        cache = _use(mnt, monkeypatch)
        cache.mkdir()
        filler = fill_disk(mnt, leave=64 * PAGE)  # room for the temp dir, not for the weights
        if cli == "eval":
            line = eval_error(path, tmp_path / "ev", capsys, monkeypatch)
        else:
            line = _export_error(trained / "final", path, tmp_path, capsys)
        assert line.startswith(f"error: no space left on device at {cache} (converting tiny.gguf"), line
        assert "DRAFTSMITH_CACHE" in line
        assert list(cache.iterdir()) == [] and filler.exists()
