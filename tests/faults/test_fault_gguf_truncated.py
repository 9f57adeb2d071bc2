"""`train.export --check` opens draft.gguf instead of trusting its sha256 alone: a cut copy whose gguf.json was
rewritten to the cut file's digest (the sha then agrees) is refused in one `error:` line naming the file. The
export is a real one (llama.cpp's own converter), since a GGUF that does not parse is exactly what is tested."""

from __future__ import annotations

import json

import pytest

from models.export import llamacpp as G
from models.export.shared.common import ExportError
from tests.test_export import _train
from train.export import main

pytest.importorskip("gguf", reason="pip install -e '.[real]' (gguf) reads the GGUF")


@pytest.fixture(scope="module")
def gguf_export(tmp_path_factory, target_dir):
    if not (G.llamacpp_dir() / "convert_hf_to_gguf.py").exists():
        pytest.skip(f"no llama.cpp sources at {G.llamacpp_dir()} (scripts/build_llama_cpp.sh)")
    root = tmp_path_factory.mktemp("gguf_cut")
    ckpt = _train(target_dir, root / "run", "eagle3")
    assert main([str(ckpt), "--format", "gguf", "--out", str(root / "g")]) == 0
    return root / "g"


def _cut(export, keep: int) -> None:
    """draft.gguf cut to its first ``keep`` bytes, the marker's sha256 rewritten to match."""
    draft, marker = export / G.DRAFT, export / G.MARKER
    draft.write_bytes(draft.read_bytes()[:keep])
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "draft_sha256": G.file_sha256(draft)}))


@pytest.fixture
def copy(gguf_export, tmp_path):
    import shutil

    return shutil.copytree(gguf_export, tmp_path / "g")


def test_whole_export_checks(copy, capsys):
    assert main(["--check", str(copy)]) == 0
    assert "valid GGUF export" in capsys.readouterr().out


@pytest.mark.parametrize("keep", [lambda n: n - 1, lambda n: n // 2, lambda n: 64],
                         ids=["last-byte", "half", "header"])
def test_truncated_gguf_with_recomputed_sha256_is_refused(copy, capsys, keep):
    _cut(copy, keep((copy / G.DRAFT).stat().st_size))
    assert main(["--check", str(copy)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(copy / G.DRAFT) in lines[0] and "truncated" in lines[0], lines[0]
    with pytest.raises(ExportError, match="export again with --force"):
        G.check_gguf(copy)
