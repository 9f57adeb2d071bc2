"""`train.export --check` recomputes what an export's manifests claim instead of trusting them: a GGUF export's
gguf.json (spec type from the layout in hf/, K >= 1, draft.gguf's sha256) and the two copies of the serving manifest
(draftsmith.json and config.json). A disagreement is one `error:` line naming both values, exit 2."""

from __future__ import annotations

import json

import pytest

from models.export import llamacpp as G
from tests.faults.fault_helpers import write_small_gguf
from tests.test_export import _train
from train.export import main


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, target_dir):
    return _train(target_dir, tmp_path_factory.mktemp("e3") / "run", "eagle3")


def _fake_convert(src, outfile, target_dir=None, outtype="f32", timeout=0):
    return write_small_gguf(outfile, f"converted from {src}")  # llama.cpp is not needed to test the manifest


@pytest.fixture
def gguf_export(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(G, "convert", _fake_convert)
    out = tmp_path / "g"
    assert main([str(ckpt), "--format", "gguf", "--out", str(out)]) == 0
    assert main(["--check", str(out)]) == 0
    assert "valid GGUF export (draft-eagle3" in capsys.readouterr().out
    return out


def _edit(path, **kw):
    path.write_text(json.dumps({**json.loads(path.read_text()), **kw}))


@pytest.mark.parametrize("edit, both", [
    ({"spec_type": "draft-medusa"}, ["'draft-medusa'", "'draft-eagle3'"]),
    ({"num_speculative_tokens": 0}, ["num_speculative_tokens 0", ">= 1"]),
    ({"num_speculative_tokens": 5}, ["num_speculative_tokens 5", "draftsmith.json says 3"]),
    ({"source_format": "dflash_zlab"}, ["'dflash_zlab'", "'eagle3_native'"]),
    ({"draft_sha256": "0" * 64}, ["0" * 64, "sha256 differs"]),
], ids=["spec_type", "k0", "k-other", "source_format", "sha256"])
def test_check_recomputes_the_gguf_manifest(gguf_export, capsys, edit, both):
    marker = gguf_export / G.MARKER
    _edit(marker, **edit)
    assert main(["--check", str(gguf_export)]) == 2
    line = _one_error(capsys)
    assert str(marker) in line and all(b in line for b in both), line


def test_sha256_disagreement_names_both_digests(gguf_export, capsys):
    (gguf_export / G.DRAFT).write_bytes(b"GGUF another file")
    assert main(["--check", str(gguf_export)]) == 2
    line = _one_error(capsys)
    have, want = G.file_sha256(gguf_export / G.DRAFT), json.loads((gguf_export / G.MARKER).read_text())["draft_sha256"]
    assert have in line and want in line, line


@pytest.fixture
def native_export(ckpt, tmp_path, capsys):
    out = tmp_path / "e"
    assert main([str(ckpt), "--format", "eagle3", "--out", str(out)]) == 0
    capsys.readouterr()
    return out


def _serving(export, name):
    d = json.loads((export / name).read_text())
    return d, (d["draftsmith_target"] if name == "config.json" else d)["serving"]


@pytest.mark.parametrize("edited, key, value", [
    ("draftsmith.json", "enable_thinking", True),
    ("config.json", "enable_thinking", True),
    ("draftsmith.json", "target_head_fingerprint", "0123456789abcdef"),
    ("config.json", "chat_template_sha256", "fedcba9876543210"),
])
def test_check_refuses_two_serving_manifests_that_disagree(native_export, capsys, edited, key, value):
    """config.json travels where draftsmith.json may not, so the two copies must say the same for --check to pass
    on either one; reading the sidecar first let an edited sidecar hide the config's thinking off."""
    _, other = _serving(native_export, "config.json" if edited == "draftsmith.json" else "draftsmith.json")
    d, serving = _serving(native_export, edited)
    serving[key] = value
    (native_export / edited).write_text(json.dumps(d))
    assert main(["--check", str(native_export), "--thinking", "on"]) == 2
    line = _one_error(capsys)
    assert f"serving.{key}" in line and json.dumps(value) in line and json.dumps(other[key]) in line, line
    assert "draftsmith.json" in line and "config.json" in line
