"""Files read as JSON name themselves and the fix when they are damaged, not a bare "Expecting value: line 1 column 1":
the offline feature cache's manifest.json, a GGUF export's gguf.json (`train.export --check`), and a prompts file
whose bytes are not UTF-8 (`python -m eval`). One `error:` line, exit 2."""

from __future__ import annotations

import json

import pytest

from tests.faults.fault_helpers import cfg_for, eval_prompts_error, one_error_line
from train.loop import run


@pytest.mark.parametrize("content", [b"", b'{"layer_ids": [1, 2', b"\xff\xfe{}"], ids=["emptied", "torn", "binary"])
def test_damaged_feature_cache_manifest(target_dir, tmp_path, capsys, content):
    from train.__main__ import main

    out = tmp_path / "run"
    cfg = cfg_for(target_dir, out, "train.mode=offline", "train.steps=2")
    run(cfg)
    manifest = out / "features" / "manifest.json"
    assert json.loads(manifest.read_text())["layer_ids"]
    manifest.write_bytes(content)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main.__wrapped__(cfg)
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert str(manifest) in line and "delete it to rebuild" in line and str(out / "features") in line
    assert ("is empty" in line) == (content == b"")


@pytest.mark.parametrize("content", [b"", b'{"spec_type": "draft-eagle3", ', b'["draft-eagle3"]', b'{"spec_type": "x"}',
                                     b"\xff{}"])
def test_damaged_gguf_marker_in_an_export(tmp_path, capsys, content):
    from train.export import main

    exp = tmp_path / "exp"
    (exp / "hf").mkdir(parents=True)
    (exp / "draft.gguf").write_bytes(b"GGUF")
    (exp / "gguf.json").write_bytes(content)
    capsys.readouterr()
    assert main(["--check", str(exp)]) == 2
    line = one_error_line(capsys)
    assert f"{exp / 'gguf.json'} " in line and "--force" in line


def test_prompts_file_with_bad_utf8_names_the_line(target_dir, tmp_path, capsys, monkeypatch):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(json.dumps({"prompt": "def f(x):"}).encode() + b"\n\n"
                  + b'{"prompt": "caf\xe9 = 1"}\n' + json.dumps({"prompt": "x"}).encode() + b"\n")
    line = eval_prompts_error(target_dir, p, tmp_path / "e", capsys, monkeypatch)
    assert f"{p} line 3: not UTF-8 (byte 0xe9" in line and "save the file as UTF-8" in line
