"""Export and ``--check`` read only the target's config, tokenizer, embedding and lm_head (models/core/target_view.py).

The view must equal the full load in everything export reads (identity, fingerprint, the two matrices, the
config), for one-file and sharded checkpoints and tied embeddings; and the CLI must export and check every
format without ever calling ``AutoModelForCausalLM.from_pretrained``, writing the very files the full-load
path writes.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from models.core.target import FrozenTarget
from models.core.target_view import TargetView
from models.export.api import export
from models.export.formats import export_format
from models.export.shared.common import CONFIG, SIDECAR
from models.export.validate import detect_format
from models.methods.dflash.config import DFlashConfig
from models.methods.eagle3.config import Eagle3Config
from models.methods.medusa.config import MedusaConfig
from models.methods.mtp.config import MTPConfig
from models.registry import build_drafter
from tests.conftest import make_tiny_llama
from tests.families import FAMILIES, save_family
from train.checkpoint import save_drafter
from train.export import main

SHARD = "30KB"  # small enough that a tiny target is written as several shards plus an index


def _head(t: FrozenTarget) -> torch.Tensor:
    return t.model.get_output_embeddings().weight


def _same_view(full: FrozenTarget, view: TargetView) -> None:
    assert view.identity() == full.identity()
    assert view.legacy_fingerprint() == full.legacy_fingerprint()
    assert view.embed.weight.dtype == full.embed.weight.dtype and torch.equal(view.embed.weight, full.embed.weight)
    assert torch.equal(_head(view), _head(full))
    assert (_head(view) is view.embed.weight) == (_head(full) is full.embed.weight)
    assert (view.num_layers, view.hidden_size, view.vocab_size) == (full.num_layers, full.hidden_size,
                                                                    full.vocab_size)
    assert type(view.layers[0]) is type(full.layers[0])
    skip = {"dtype", "torch_dtype"}  # the full load records the load dtype in its config, the view the stored one
    a, b = view.model.config.to_dict(), full.model.config.to_dict()
    assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_view_equals_the_full_load(family, sharded, tmp_path):
    d = save_family(family, tmp_path / "t")
    if sharded:
        FrozenTarget.from_pretrained(str(d)).model.save_pretrained(tmp_path / "s", max_shard_size=SHARD)
        FrozenTarget.from_pretrained(str(d)).tokenizer.save_pretrained(tmp_path / "s")
        d = tmp_path / "s"
        index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(index.values())) > 1
    _same_view(FrozenTarget.from_pretrained(str(d)), TargetView.from_pretrained(str(d)))


def test_view_of_tied_embeddings_and_of_the_embedded_target(tmp_path, tiny_tokenizer):
    m = make_tiny_llama(len(tiny_tokenizer))
    m.config.tie_word_embeddings = True
    m = transformers.LlamaForCausalLM(m.config).eval()
    m.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in stored  # tied: only the embedding is on disk
    view = TargetView.from_pretrained(str(tmp_path))
    assert _head(view) is view.embed.weight
    _same_view(FrozenTarget.from_pretrained(str(tmp_path)), view)
    _same_view(FrozenTarget.from_pretrained("tiny-code"), TargetView.from_pretrained("tiny-code"))


def test_view_refuses_to_run_and_names_a_missing_target(tmp_path, target_dir):
    view = TargetView.from_pretrained(str(target_dir))
    with pytest.raises(RuntimeError, match="only the target's embedding and lm_head"):
        view(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TargetView.from_pretrained(str(tmp_path / "nope"))
    (tmp_path / "nw").mkdir()
    for f in target_dir.iterdir():
        if not f.name.startswith("model"):
            (tmp_path / "nw" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        TargetView.from_pretrained(str(tmp_path / "nw"))


CONFIGS = {"eagle3": Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=64, ttt_steps=2),
           "medusa": MedusaConfig(num_heads=2), "mtp": MTPConfig(num_modules=1),
           "dflash": DFlashConfig(num_layers=1, block_size=4)}
FORMATS = {"eagle3": ["eagle3", "eagle3-speculators"], "medusa": ["medusa", "medusa-vllm"], "mtp": ["mtp"],
           "dflash": ["dflash-speculators", "dflash"]}


def _same_export(a, b) -> None:
    fmt = export_format(detect_format(a))
    for name in (CONFIG, SIDECAR):
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name
    ta, tb = load_file(str(a / fmt.weights_file)), load_file(str(b / fmt.weights_file))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def test_export_and_check_never_load_the_model(tmp_path, tiny_tokenizer, monkeypatch):
    """Every format of every method exported and checked by the CLI from a sharded target: from_pretrained is
    never called, and the files equal those the full-load path writes."""
    tdir = tmp_path / "target"
    make_tiny_llama(len(tiny_tokenizer)).save_pretrained(tdir, max_shard_size=SHARD)
    tiny_tokenizer.save_pretrained(tdir)
    assert (tdir / "model.safetensors.index.json").is_file()
    full = FrozenTarget.from_pretrained(str(tdir))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, full.vocab_size, (24,), generator=g).tolist(), "loss_mask": [1] * 24}
            for _ in range(4)]
    refs = {}
    for method, cfg in CONFIGS.items():
        torch.manual_seed(0)
        d = build_drafter(method, cfg, full, rows).eval()
        meta = {"method": method, "draft": d.config_dict(), "target": full.identity(), "step": 2}
        save_drafter(tmp_path / method, d, meta)
        for fmt in FORMATS[method]:
            refs[fmt] = export(d, fmt, tmp_path / f"ref_{fmt}", full, target_name=str(tdir), meta=meta)

    def refuse(*_a, **_k):
        raise AssertionError("export/--check loaded the whole target")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(AssertionError, match="loaded the whole target"):
        FrozenTarget.from_pretrained(str(tdir))  # the guard is live
    for method, fmts in FORMATS.items():
        for fmt in fmts:
            out = tmp_path / f"x_{fmt}"
            assert main([str(tmp_path / method), "--format", fmt, "--out", str(out), "--target", str(tdir)]) == 0
            assert main(["--check", str(out), "--target", str(tdir)]) == 0
            _same_export(out, refs[fmt])
