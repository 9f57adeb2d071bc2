"""Files read as JSON name themselves and the fix when they are damaged, not a bare "Expecting value: line 1 column 1":
the offline feature cache's manifest.json, a GGUF export's gguf.json, an export's config.json and draftsmith.json
(`train.export --check`), a `train.export --results` file, and a prompts file whose bytes are not UTF-8
(`python -m eval`). One `error:` line, exit 2, with the line and offset where the JSON stops."""

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


def _damage(content: bytes, how: str) -> bytes:
    return {"emptied": b"", "cut": content[: len(content) // 2], "binary": b"\xff" + content[1:],
            "array": b"[" + content + b"]"}[how]


def _what(content: bytes) -> str:
    """What the error must say of ``content``: where json itself stops (line, column, character offset), or why it
    is no JSON object."""
    if content.startswith(b"\xff"):
        return ": not UTF-8 text (byte 0xff at offset 0); "
    try:
        json.loads(content)
    except json.JSONDecodeError as e:
        return f": not valid JSON ({e}{', the file is empty' if not content else ''}); "
    return ": holds a JSON list, not an object; "


@pytest.fixture(scope="module")
def export_dir(trained, tmp_path_factory):
    from train.export import main

    out = tmp_path_factory.mktemp("exp") / "e3"
    assert main([str(trained / "final"), "--format", "eagle3", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("how", ["emptied", "cut", "binary", "array"])
@pytest.mark.parametrize("name", ["config.json", "draftsmith.json"])
def test_damaged_export_json_under_check(export_dir, tmp_path, capsys, name, how):
    """`--check` on an export whose config.json or draftsmith.json was emptied, cut (a kill while copying it),
    overwritten with bytes that are not UTF-8, or holds an array."""
    import shutil

    from train.export import main

    exp = shutil.copytree(export_dir, tmp_path / "exp")
    f = exp / name
    f.write_bytes(_damage(f.read_bytes(), how))
    capsys.readouterr()
    assert main(["--check", str(exp)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {f}{_what(f.read_bytes())}"), line
    assert "restore or re-create it: export the checkpoint again" in line and "--force" in line


@pytest.mark.parametrize("how", ["emptied", "cut", "binary", "array"])
def test_damaged_results_file(trained, tmp_path, capsys, how):
    """`train.export --results` pointing at a damaged results.json: named, with the fix, before any loading."""
    from train.export import main

    res = tmp_path / "results.json"
    res.write_bytes(_damage(json.dumps({"recommended_num_speculative_tokens": 3, "methods": {}}).encode(), how))
    capsys.readouterr()
    rc = main([str(trained / "final"), "--format", "eagle3", "--out", str(tmp_path / "exp"), "--results", str(res)])
    assert rc == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {res}{_what(res.read_bytes())}"), line
    assert "restore or re-create it: python -m eval writes results.json" in line and "without --results" in line
    assert not (tmp_path / "exp").exists()
