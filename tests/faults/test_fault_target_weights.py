"""A target whose weights hold NaN/inf is refused at load: one `error:` line naming the tensor and the file, exit 2
from `python -m train`, `python -m eval` and `python -m train.export`; for an HF directory (one file or shards) and
for a GGUF, whose converter never caches a non-finite result."""

from __future__ import annotations

import pytest
import torch

from models.core.target import FrozenTarget, TargetLoadError
from tests.conftest import make_tiny_llama
from tests.faults.fault_helpers import cfg_for, eval_error, one_error_line
from train.loop import run

DEEP = "model.layers.2.mlp.down_proj.weight"


def _poisoned(tok, d, tensor, value=float("nan"), **save_kw):
    model = make_tiny_llama(len(tok))
    with torch.no_grad():
        model.get_parameter(tensor).view(-1)[3] = value
    model.save_pretrained(d, **save_kw)
    tok.save_pretrained(d)
    return d


def test_train_cli_names_the_tensor_and_the_file(tiny_tokenizer, tmp_path, capsys):
    from train.__main__ import main

    d = _poisoned(tiny_tokenizer, tmp_path / "nan", DEEP)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main.__wrapped__(cfg_for(d, tmp_path / "run"))
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert f"tensor '{DEEP}' in {d / 'model.safetensors'} holds NaN/inf" in line and "re-download" in line


def test_sharded_target_names_the_shard(tiny_tokenizer, tmp_path):
    d = _poisoned(tiny_tokenizer, tmp_path / "sharded", DEEP, float("inf"), max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").is_file()
    with pytest.raises(TargetLoadError) as e:
        FrozenTarget.from_pretrained(str(d))
    msg = str(e.value)
    assert "\n" not in msg and f"tensor '{DEEP}' in {d}/model-0" in msg and ".safetensors holds NaN/inf" in msg


def test_eval_cli_exits_2(tiny_tokenizer, tmp_path, capsys, monkeypatch):
    d = _poisoned(tiny_tokenizer, tmp_path / "nan", DEEP)
    line = eval_error(d, tmp_path / "e", capsys, monkeypatch)
    assert f"tensor '{DEEP}' in {d / 'model.safetensors'} holds NaN/inf" in line


def test_export_cli_exits_2(target_dir, tiny_tokenizer, tmp_path, capsys):
    """Export reads only the target's embedding and lm_head (TargetView): those are checked."""
    from train.export import main

    run(cfg_for(target_dir, tmp_path / "run", "train.steps=2"))
    d = _poisoned(tiny_tokenizer, tmp_path / "nan", "lm_head.weight")
    capsys.readouterr()
    rc = main([str(tmp_path / "run" / "final"), "--format", "eagle3", "--out", str(tmp_path / "exp"),
               "--target", str(d)])
    assert rc == 2
    assert "tensor 'lm_head.weight' in " in one_error_line(capsys)
    assert not (tmp_path / "exp").exists()


GGUF_NAN = "model.layers.1.mlp.up_proj.weight"


def _nan_gguf(tmp_path, monkeypatch):
    """A GGUF (built in code) whose one tensor holds a NaN, with DRAFTSMITH_CACHE in ``tmp_path``."""
    pytest.importorskip("gguf", reason="pip install -e '.[real]' (gguf) for the GGUF tests")
    from transformers import AutoTokenizer

    from models.core.target import EMBEDDED_DIR
    from tests.test_gguf import make_model, write_llama_gguf

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "dcache"))
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    model = make_model(len(tok), tied=False, seed=0)
    with torch.no_grad():
        model.get_parameter(GGUF_NAN).view(-1)[5] = float("nan")
    return write_llama_gguf(model, tok, tmp_path / "nan.gguf")


def _refused_gguf(line, path, tmp_path):
    assert str(path) in line and f"'{GGUF_NAN}' holds NaN/inf" in line and "nothing was cached" in line, line
    cache = tmp_path / "dcache" / "gguf"
    assert not cache.exists() or not any(cache.iterdir())


def test_gguf_with_nan_is_refused_and_nothing_is_cached(tmp_path, monkeypatch, capsys):
    from train.__main__ import main

    path = _nan_gguf(tmp_path, monkeypatch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main.__wrapped__(cfg_for(path, tmp_path / "run"))
    assert e.value.code == 2
    _refused_gguf(one_error_line(capsys), path, tmp_path)


def test_gguf_with_nan_is_refused_by_eval(tmp_path, monkeypatch, capsys):
    """Before the check, eval on such a GGUF exited 0 with a full benchmark ("Lossless: every method reproduced
    AR's tokens")."""
    path = _nan_gguf(tmp_path, monkeypatch)
    _refused_gguf(eval_error(path, tmp_path / "e", capsys, monkeypatch), path, tmp_path)


def test_gguf_with_nan_is_refused_by_export(trained, tmp_path, monkeypatch, capsys):
    """train.export --target X.gguf converts the GGUF to read its embedding and lm_head: the converter refuses."""
    from train.export import main

    path = _nan_gguf(tmp_path, monkeypatch)
    capsys.readouterr()
    rc = main([str(trained / "final"), "--format", "eagle3", "--out", str(tmp_path / "exp"), "--target", str(path)])
    assert rc == 2
    _refused_gguf(one_error_line(capsys), path, tmp_path)
    assert not (tmp_path / "exp").exists()
