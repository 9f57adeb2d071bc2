"""scripts/heldout_prompts.py on an --out it cannot write or a recipe that does not exist: one `error:` line and
exit status 2, as the other scripts do, never a traceback; an unwritable --out is refused before the config is
composed and the rows are built (minutes of work), not after."""

from __future__ import annotations

import importlib.util

from tests.faults.fault_helpers import ROOT, one_error_line

_spec = importlib.util.spec_from_file_location("heldout_prompts", ROOT / "scripts" / "heldout_prompts.py")
heldout_prompts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heldout_prompts)


def test_an_unwritable_out_is_refused_before_any_rows_are_built(tmp_path, capsys, monkeypatch):
    """--out's parent is a file, so no directory can be made there (root ignores permission bits, not this)."""
    calls = []
    monkeypatch.setattr(heldout_prompts, "heldout_messages", lambda overrides: calls.append(overrides) or [])
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "a_file" / "prompts.jsonl"
    assert heldout_prompts.main(["--out", str(out), "+recipe=eagle3_smollm2_onpolicy"]) == 2
    line = one_error_line(capsys)
    assert "--out" in line and str(tmp_path / "a_file") in line and "not writable" in line
    assert calls == []  # refused before composing the config or building a row


def test_an_out_that_is_a_directory_is_refused_before_any_rows_are_built(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(heldout_prompts, "heldout_messages", lambda overrides: calls.append(overrides) or [])
    assert heldout_prompts.main(["--out", str(tmp_path), "+recipe=eagle3_smollm2_onpolicy"]) == 2
    assert "is a directory" in one_error_line(capsys) and calls == []


def test_an_unknown_recipe_is_one_line_naming_it_and_conf_recipe(tmp_path, capsys):
    assert heldout_prompts.main(["--out", str(tmp_path / "p.jsonl"), "+recipe=no_such_recipe"]) == 2
    line = one_error_line(capsys)
    assert "no recipe 'no_such_recipe' in conf/recipe/" in line and "eagle3_smollm2_onpolicy" in line
    assert not (tmp_path / "p.jsonl").exists()
