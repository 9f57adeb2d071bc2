"""scripts/draft_vocab.py: the draft vocabulary measured from the regeneration cache as it stands (a tiny Gemma 3
built in code), without generating anything."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from data.sources import build_rows
from models.core.target import FrozenTarget
from tests.families import make_family
from tests.test_text_continuations import _cfg, _no_template, _source

_spec = importlib.util.spec_from_file_location("draft_vocab", Path(__file__).parents[1] / "scripts" / "draft_vocab.py")
DV = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(DV)


def _strip(rows):
    return sorted((r["input_ids"], r["loss_mask"]) for r in rows)


@pytest.fixture
def gemma(tmp_path):
    model, tok = make_family("gemma3")
    tok = _no_template(tok)
    tok.add_tokens([f"<unused{i}>" for i in range(model.config.vocab_size - len(tok))])
    cfg = _cfg(tmp_path)
    return cfg, FrozenTarget(model, tok)


def test_cache_rows_split_as_training_splits_them_and_a_partial_cache_is_read_not_extended(gemma, monkeypatch):
    cfg, target = gemma
    train, val = build_rows(cfg, target.tokenizer, target.model)
    got_train, got_val, planned = DV.cached_rows(cfg, target)
    assert planned == len(train) + len(val)
    assert _strip(got_train) == _strip(train)
    # held out: the greedy (T=0) ones among the training run's held-out rows
    assert got_val and set(map(tuple, (r["input_ids"] for r in got_val))) <= {tuple(r["input_ids"]) for r in val}

    def no_generation(*a, **kw):
        raise AssertionError("draft_vocab generated")
    monkeypatch.setattr("data.regenerate.generate_batch", no_generation)
    cache = sorted(Path(cfg.cache_dir).glob("regen_text_*.jsonl"))
    for f in cache:  # a running regeneration: the first batch whole, the next torn
        lines = f.read_text().splitlines(keepends=True)
        f.write_text("".join(lines[:3]) + lines[3][:20])
    part_train, part_val, _ = DV.cached_rows(cfg, target)
    assert 0 < len(part_train) + len(part_val) <= 6 and len(part_train) < len(got_train)


def test_coverage_grows_with_the_size_and_the_whole_vocabulary_covers_everything(gemma):
    cfg, target = gemma
    train, _ = build_rows(cfg, target.tokenizer, target.model)
    _, val, _ = DV.cached_rows(cfg, target)
    from models.core.vocab import count_tokens

    counts = count_tokens(train, target.vocab_size)
    sizes = [1, 8, 64, target.vocab_size]
    cov = DV.held_out_coverage(counts, val, sizes)
    assert [cov[n] for n in sizes] == sorted(cov[n] for n in sizes) and cov[target.vocab_size] == 1.0
    assert all(math.isnan(v) for v in DV.held_out_coverage(counts, [], sizes).values())


def test_draft_cost_counts_drafted_tokens_and_lm_head_rows_and_the_estimate_orders_sizes(gemma):
    cfg, target = gemma
    torch.manual_seed(0)
    train, _ = build_rows(cfg, target.tokenizer, target.model)
    prompts = [torch.tensor([train[0]["input_ids"][:20]])]
    from models.methods.eagle3.config import Eagle3Config

    config = Eagle3Config(draft_vocab_size=64, layer_ids=[0, 1, 2])
    r = DV.draft_cost(target, train, config, prompts, k=2, max_new=6, ar_step_s=1e-3)
    assert r["drafted"] > 0 and r["draft_ms"] > 0 and r["c"] == pytest.approx(r["draft_ms"])
    assert r["lm_head_params_M"] == 64 * target.model.config.hidden_size / 1e6
    # the estimate: higher coverage or lower cost orders higher; no coverage leaves one token a round
    assert DV.est_speedup(0.9, 0.6, 0.05, 3) > DV.est_speedup(0.8, 0.6, 0.05, 3) > DV.est_speedup(0.8, 0.6, 0.1, 3)
    assert DV.est_speedup(0.0, 0.6, 0.0, 3) == 1.0


def test_an_empty_cache_is_one_line(tmp_path, capsys):
    rc = DV.main(["+recipe=eagle3_gemma3_270m", "target=tiny_code", f"data.source={_source(tmp_path)}",
                  f"data.cache_dir={tmp_path / 'cache'}", "--no-cost", "--out", str(tmp_path / "out")])
    assert rc == 2 and "holds no training rows yet" in capsys.readouterr().err
