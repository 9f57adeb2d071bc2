"""``python -m train.export --format gguf`` with an ``--out`` inside a run's ``final/`` (which training replaces
whole) is refused on one clear line naming that ``--out``, the directory and the fix, as every other format's
export is: not once per llama.cpp layout, naming a temporary directory. Nothing is left behind in ``final/``."""

from __future__ import annotations

import pytest

from tests.faults.fault_helpers import one_error_line


@pytest.mark.parametrize("force", [False, True])
def test_gguf_out_inside_final_is_one_clear_line(trained, capsys, force):
    from train.export import main

    final = trained / "final"
    before = sorted(p.name for p in final.iterdir())
    out = final / "gguf"
    capsys.readouterr()
    assert main([str(final), "--format", "gguf", "--out", str(out), *(["--force"] if force else [])]) == 2
    line = one_error_line(capsys)
    assert line == (f"error: --out {out} is inside {final}, which training rewrites (and would delete the export "
                    "with); export next to the run instead, e.g. OUTPUT_DIR/export")
    assert sorted(p.name for p in final.iterdir()) == before


def test_gguf_out_that_is_a_runs_checkpoints_directory_is_one_clear_line(trained, capsys):
    from train.export import main

    out = trained / "checkpoints"
    capsys.readouterr()
    assert main([str(trained / "final"), "--format", "gguf", "--out", str(out), "--force"]) == 2
    line = one_error_line(capsys)
    assert line == f"error: --out {out} is a training run's checkpoints/ directory; choose another --out"
