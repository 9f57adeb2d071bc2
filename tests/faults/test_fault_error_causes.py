"""An error names the setting or file that caused it, not a neighbour: `data.max_len` too short for a code window
(not "no training rows"), the completion keys of a prompts file, a missing `train.export --results` file (not "not
an export directory")."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.faults.fault_helpers import ROOT, cfg_for, eval_prompts_error, one_error_line
from train.checks import ConfigError
from train.loop import run


@pytest.mark.parametrize("max_len", [1, 7])
def test_max_len_below_a_code_window_names_data_max_len(target_dir, tmp_path, max_len):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        run(cfg_for(target_dir, out, f"data.max_len={max_len}"))
    msg = str(e.value)
    assert msg.startswith(f"data.max_len={max_len}: ") and ">= 8" in msg and "\n" not in msg, msg
    assert not out.exists()


def test_max_len_of_a_code_window_trains(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path / "run", "data.max_len=8", "train.steps=1"))
    assert (tmp_path / "run" / "final").is_dir()


def test_prompts_file_row_of_no_known_kind_lists_every_key(target_dir, tmp_path, capsys, monkeypatch):
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"question": "what is 2+2?"}) + "\n")
    line = eval_prompts_error(target_dir, p, tmp_path / "e", capsys, monkeypatch)
    assert f"{p} line 2" in line, line
    assert all(f"'{k}'" in line for k in ("prompt", "text", "turns", "messages", "conversations")), line


@pytest.mark.parametrize("missing", ["file", "dir"])
def test_missing_results_file_is_named_before_loading_the_target(tmp_path, capsys, monkeypatch, missing):
    from models.core import target_view
    from train.export import main

    ckpt = tmp_path / "final"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    results = tmp_path / ("eval/results.json" if missing == "file" else "no-eval-dir/results.json")
    if missing == "file":
        results.parent.mkdir()
    monkeypatch.setattr(target_view.TargetView, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded the target before reading --results"))
    capsys.readouterr()
    assert main([str(ckpt), "--format", "eagle3", "--out", str(tmp_path / "x"), "--results", str(results)]) == 2
    line = one_error_line(capsys)
    assert f"--results {results}: no such file" in line and "not an export directory" not in line, line


def test_a_non_ascii_output_dir_reaches_hydra_quoted(target_dir, tmp_path):
    """Hydra's lexer refuses a non-ASCII unquoted value (multi-line, exit 1); the CLIs quote it first, so
    ``python -m train output_dir=…/café`` composes, and docs/training.md's quoted form trains there."""
    import subprocess
    import sys

    from hydra.errors import OverrideParseException

    from models.core.cli import quote_non_ascii

    out = tmp_path / "runs" / "café"
    with pytest.raises(OverrideParseException, match="LexerNoViableAlt"):
        cfg_for(target_dir, out)
    assert quote_non_ascii([f"output_dir={out}", "+recipe=eagle3", "x='é'", "~a.b=ü", "plain"]) == \
        [f"output_dir='{out}'", "+recipe=eagle3", "x='é'", "~a.b='ü'", "plain"]
    for cli, key in (("train", "output_dir"), ("eval", "out_dir")):
        proc = subprocess.run([sys.executable, "-m", cli, f"{key}={out}", "--cfg", "job"], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 0 and f"{key}: {out}" in proc.stdout, (cli, proc.stderr[-500:])
    doc = (ROOT / "docs" / "training.md").read_text()
    cmd = re.search(r"`(python -m train [^`]*output_dir='[^`]*)`", doc)
    assert cmd, "docs/training.md shows no quoted output_dir"
    override = next(a for a in shlex.split(cmd.group(1)) if a.startswith("output_dir="))
    assert not override.isascii() and override.endswith("'")
    quoted = override.split("=", 1)[0] + "='" + str(out) + "'"
    cfg = cfg_for(target_dir, tmp_path / "placeholder", quoted, "train.steps=1")
    assert cfg.output_dir == str(out)
    run(cfg)
    assert (out / "final" / "model.safetensors").is_file()
