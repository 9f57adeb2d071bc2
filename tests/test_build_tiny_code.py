"""The tiny-code build recipe runs end to end on a tiny config (the shipped model used the full one)."""

import json

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from data import corpus
from train.build_tiny_code import Recipe, batch_at, build, lr_at


def _files():
    files = corpus.iter_stdlib_files()
    # a few kept files from both sides of the split, so held-out is non-empty
    train, held = corpus.split_files(files)
    return train[:6] + held[:2]


def test_build_runs_and_resumes(tmp_path):
    r = Recipe.tiny(steps=2)
    res = build(tmp_path, r, files=_files())
    for name in ("model.safetensors", "config.json", "tokenizer.json", "manifest.json", "heldout.jsonl",
                 "train_log.jsonl", "heldout_loss.json"):
        assert (tmp_path / name).exists(), name
    assert 0 < res["bits_per_byte"] < 20 and res["files"] == 2
    m = LlamaForCausalLM.from_pretrained(tmp_path)
    assert next(m.parameters()).dtype == torch.float16  # shipped in fp16
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.decode(tok("def f(x):\n    return x\n")["input_ids"]) == "def f(x):\n    return x\n"
    assert tok.chat_template and "<|assistant|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    # rerunning with more steps resumes from the atomic checkpoint instead of starting over
    r2 = Recipe.tiny(steps=4)
    build(tmp_path, r2, files=_files())
    steps = [json.loads(line)["step"] for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert steps.count(0) == 1 and max(steps) == 3


def test_schedule_and_batches_are_pure_functions_of_step():
    r = Recipe()
    assert lr_at(0, r) < lr_at(r.warmup - 1, r) == r.lr
    assert abs(lr_at(r.steps, r) - r.lr * r.min_lr_ratio) < 1e-9
    import numpy as np

    stream = np.arange(10_000, dtype=np.int32)
    assert torch.equal(batch_at(stream, 7, r), batch_at(stream, 7, r))
    assert not torch.equal(batch_at(stream, 7, r), batch_at(stream, 8, r))


def test_draft_model_shares_the_target_tokenizer(tmp_path):
    build(tmp_path / "t", Recipe.tiny(steps=1), files=_files())
    r = Recipe.tiny(steps=1)
    r.num_hidden_layers = 1
    build(tmp_path / "d", r, files=_files(), tokenizer_from=tmp_path / "t")
    t, d = AutoTokenizer.from_pretrained(tmp_path / "t"), AutoTokenizer.from_pretrained(tmp_path / "d")
    assert t.get_vocab() == d.get_vocab()
    assert LlamaForCausalLM.from_pretrained(tmp_path / "d").config.num_hidden_layers == 1
    assert Recipe.draft().num_hidden_layers < Recipe().num_hidden_layers
