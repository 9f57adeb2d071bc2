"""A drafter of a target that ships its own model code (auto_map, trained with target.trust_remote_code=true)
exports with `python -m train.export --trust-remote-code`; without the flag it is one `error:` line naming the flag
(the code is never run because the checkpoint was trained that way: the user opts in at export too)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.faults.fault_helpers import cfg_for
from train.export import main
from train.loop import run

CODE = ("from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class MyConfig(LlamaConfig):\n    model_type = 'my_llama'\n"
        "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n")


@pytest.fixture(scope="module")
def remote(tmp_path_factory, target_dir):
    """The tiny target as a repository with its own model classes, and a drafter trained on it."""
    root = tmp_path_factory.mktemp("remote")
    d = shutil.copytree(target_dir, root / "custom")
    c = json.loads((d / "config.json").read_text())
    c.update(model_type="my_llama", auto_map={"AutoConfig": "my_model.MyConfig",
                                              "AutoModelForCausalLM": "my_model.MyModel"})
    (d / "config.json").write_text(json.dumps(c))
    (d / "my_model.py").write_text(CODE)
    run(cfg_for(d, root / "run", "target.trust_remote_code=true"))
    return d, root / "run" / "final"


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("fmt", ["eagle3", "gguf"])
def test_export_without_the_flag_names_it(remote, tmp_path, capsys, fmt):
    d, ckpt = remote
    assert main([str(ckpt), "--format", fmt, "--out", str(tmp_path / "e")]) == 2
    line = _error(capsys)
    assert "ships its own model code" in line and "--trust-remote-code" in line and str(d) in line, line
    assert not (tmp_path / "e").exists()


def test_export_with_the_flag_writes_a_valid_export(remote, tmp_path, capsys):
    d, ckpt = remote
    out = tmp_path / "e"
    assert main([str(ckpt), "--format", "eagle3", "--out", str(out), "--trust-remote-code"]) == 0
    assert f"validated against {d}" in capsys.readouterr().out
    assert main(["--check", str(out), "--target", str(d)]) == 2  # --check loads the target too: same rule
    assert "--trust-remote-code" in _error(capsys)
    assert main(["--check", str(out), "--target", str(d), "--trust-remote-code"]) == 0
    assert f"valid eagle3_native export against {d}" in capsys.readouterr().out
