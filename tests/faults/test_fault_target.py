"""Every way the target can fail to load in `python -m train` is one `error:` line naming the key and the fix,
exit 2 — not Hydra's "Error in call to target ..." wrapper (exit 1) or a traceback from deep in transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import TINY_TEXTS
from tests.faults.fault_helpers import ROOT, cfg_for
from train.__main__ import main


def _cli(cfg, capsys) -> list[str]:
    """The body of `python -m train` (under @hydra.main) on a composed config → its stderr lines; must exit 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main.__wrapped__(cfg)
    assert e.value.code == 2
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]


def _one_error(cfg, capsys, *needles) -> str:
    lines = _cli(cfg, capsys)
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tok():
    from models.core.tokenizer import train_tokenizer

    return train_tokenizer(TINY_TEXTS, vocab_size=300)


def test_missing_target_path(tmp_path, capsys):
    _one_error(cfg_for("/nonexistent/model", tmp_path), capsys, "'/nonexistent/model' does not exist",
               "target.name_or_path")


def test_hub_id_while_offline(tmp_path, capsys):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # tests/conftest.py
    _one_error(cfg_for("someorg/not-downloaded", tmp_path), capsys, "'someorg/not-downloaded'",
               "not a local directory and not in the Hugging Face cache", "offline")


def test_encoder_decoder_model_is_not_a_causal_lm(tmp_path, tok, capsys):
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=300, d_model=16, d_kv=4, d_ff=16, num_layers=1,
                                        num_heads=2)).save_pretrained(tmp_path / "t5")
    tok.save_pretrained(tmp_path / "t5")
    _one_error(cfg_for(tmp_path / "t5", tmp_path / "run"), capsys, "not a causal LM", "T5Config")


def test_encoder_model_is_not_a_decoder_only_causal_lm(tmp_path, tok, capsys):
    """BERT loads as BertLMHeadModel (it is in the causal-LM auto map) but has no decoder layers to hook."""
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)).save_pretrained(tmp_path / "bert")
    tok.save_pretrained(tmp_path / "bert")
    _one_error(cfg_for(tmp_path / "bert", tmp_path / "run"), capsys, "BertLMHeadModel",
               "not a decoder-only causal LM")


def test_remote_code_without_trust_remote_code(tmp_path, tok, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "custom"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(d)
    tok.save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    c.update(model_type="my_llama", auto_map={"AutoConfig": "my_model.MyConfig",
                                              "AutoModelForCausalLM": "my_model.MyModel"})
    (d / "config.json").write_text(json.dumps(c))
    (d / "my_model.py").write_text("from transformers import LlamaConfig, LlamaForCausalLM\n"
                                   "class MyConfig(LlamaConfig):\n    model_type = 'my_llama'\n"
                                   "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n")
    _one_error(cfg_for(d, tmp_path / "run"), capsys, "ships its own model code", "target.trust_remote_code=true")


def test_unknown_dtype_is_refused_before_loading(target_dir, tmp_path, capsys):
    line = _one_error(cfg_for(target_dir, tmp_path / "run", "target.dtype=int8"), capsys, "target.dtype='int8'")
    assert "bfloat16" in line and not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda(target_dir, tmp_path, capsys):
    _one_error(cfg_for(target_dir, tmp_path / "run", "target.device=cuda"), capsys, "target.device='cuda'",
               "no usable CUDA", "target.device=cpu")


@pytest.mark.slow
def test_cli_offline_hub_id_is_one_line_exit_2(tmp_path):
    """The real entry point, Hydra's wrapper included."""
    cmd = [sys.executable, "-m", "train", "target.name_or_path=someorg/not-downloaded", f"output_dir={tmp_path}",
           "tracking=none"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip() and "Warning" not in x]
    assert len(lines) == 1 and lines[0].startswith("error: target 'someorg/not-downloaded'"), p.stderr
