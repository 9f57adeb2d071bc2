"""scripts/peer_speculators.py end to end on a tiny Llama: ``prepare`` writes the rows our run trains on first (our
loss masks in speculators' convention, our draft vocabulary) with hidden-state files whose final state passes the
argmax gate, and a post-norm final state fails it; ``train`` runs speculators 0.9.0's own trainer a few steps on the
CPU, and its checkpoint passes our validator, loads through our loader and becomes a drafter directory eval reads.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab, count_tokens
from tests.conftest import make_tiny_llama
from tests.test_peers_speculators import _speculators_logits, _speculators_model

pytest.importorskip("speculators.train.cli",
                    reason="speculators==0.9.0 not installed (make install adds it with --no-deps; see Makefile)")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("peer_speculators", ROOT / "scripts" / "peer_speculators.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama whose final norm is not all ones: with a norm of ones, normalising twice changes nothing and a
    post-norm state would pass the gate."""
    d = tmp_path_factory.mktemp("verifier")
    m = make_tiny_llama(len(tiny_tokenizer), seed=3)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        m.model.norm.weight.copy_(0.3 + 2.7 * torch.rand(m.config.hidden_size, generator=g))
    m.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def recipe(verifier: Path, run: Path) -> list[str]:
    return [f"target.name_or_path={verifier}", f"output_dir={run}", "tracking=none", "data.max_rows=24",
            "data.val_rows=4", "data.max_len=48", f"data.cache_dir={run}/data_cache", "train.batch_size=2",
            "draft.config.draft_vocab_size=200", f"draft.config.layer_ids=[{','.join(map(str, LAYERS))}]"]


def prepare(out: Path, verifier: Path, *extra: str) -> int:
    return peer.main(["prepare", "--out", str(out), "--max-tokens", "400", "--threads", "1", *extra,
                      *recipe(verifier, out.parent)])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, verifier):
    out = tmp_path_factory.mktemp("peer") / "data"
    assert prepare(out, verifier) == 0
    return out


def our_rows(verifier: Path, run: Path):
    from hydra.utils import instantiate

    cfg = peer.compose_recipe(recipe(verifier, run))
    target = instantiate(cfg.target)
    return cfg, target, *peer.recipe_rows(cfg, target)


def test_prepare_writes_our_rows_masks_vocabulary_and_pre_norm_states(prepared, verifier):
    from datasets import load_from_disk

    from train.batches import batch_indices
    from train.distributed import Dist

    cfg, target, train_rows, val_rows = our_rows(verifier, prepared.parent)
    m = json.loads((prepared / "manifest.json").read_text())
    # our run's first steps (batch 2, seed 0) until 400 loss-masked tokens: whole steps, in draw order
    drawn = [i for s in range(m["train_rows"] // 2) for i in batch_indices(len(train_rows), s, 0, 2, 1, Dist(), 0)]
    assert m["our_steps"] == m["train_rows"] // 2  # our train.steps for the same budget (one pass: no repeats)
    assert m["budget_tokens_seen"] >= 400 > m["budget_tokens_seen"] - sum(sum(train_rows[i]["loss_mask"])
                                                                        for i in drawn[-2:])
    rows = [train_rows[i] for i in drawn] + val_rows
    ds = load_from_disk(str(prepared / "data"))
    assert len(ds) == len(rows) and int(len(ds) * m["train_data_ratio"]) == m["train_rows"]  # their split = ours
    for r, got in zip(rows, ds):
        assert got["input_ids"].tolist() == r["input_ids"] and int(got["seq_len"]) == len(r["input_ids"])
        assert got["loss_mask"].tolist() == r["loss_mask"][1:] + [0]  # scores the predictions ours scores
    d2t, t2d = build_draft_vocab(count_tokens(train_rows, target.vocab_size), 200)  # the drafter's vocabulary
    assert np.array_equal(np.load(prepared / "d2t.npy"), d2t.numpy())
    assert np.array_equal(np.load(prepared / "t2d.npy"), t2d.numpy())
    assert m["layer_ids"] == LAYERS and m["gate"]["rows"] == peer.GATE_ROWS
    head = target.model.get_output_embeddings()
    for i in (0, len(rows) - 1):
        f = load_file(str(prepared / "hidden_states" / f"hs_{i}.safetensors"))
        ids = torch.tensor([rows[i]["input_ids"]])
        out = target(ids, layer_ids=[*LAYERS, target.num_layers])
        assert f["hidden_states"].shape == (ids.shape[1], 4, target.hidden_size)
        assert torch.equal(f["token_ids"], ids[0])
        for j, k in enumerate(LAYERS):
            torch.testing.assert_close(f["hidden_states"][:, j].float(), out.hidden[k][0], rtol=1e-2, atol=1e-2)
        final = f["hidden_states"][:, 3].float()
        torch.testing.assert_close(head(target.norm(final)), out.logits[0], rtol=0, atol=0.05)
        assert not torch.allclose(final, out.hidden[target.num_layers][0], atol=0.1)  # not our post-norm id L


def test_a_post_norm_final_state_fails_the_gate(prepared, verifier, tmp_path, capsys):
    from datasets import load_from_disk

    out = tmp_path / "data"
    shutil.copytree(prepared, out)
    target = FrozenTarget.from_pretrained(str(verifier))
    path = out / "hidden_states" / "hs_1.safetensors"
    f = load_file(str(path))
    hs = f["hidden_states"].clone()
    hs[:, 3] = target.norm(hs[:, 3].float()).to(hs.dtype)  # what our feature cache stores as id L
    save_file({"hidden_states": hs, "token_ids": f["token_ids"]}, str(path))
    rows = [{"input_ids": r["input_ids"].tolist()} for r in load_from_disk(str(out / "data"))]
    with pytest.raises(peer.GateError, match="row 1"):
        peer.argmax_gate(out, target, rows, [0, 1], LAYERS)
    # the file is complete (its tokens and shape are right), so a rerun keeps it and the gate stops the run
    assert prepare(out, verifier) == 2
    assert "error: argmax gate failed on row 1" in capsys.readouterr().err


def test_prepare_resumes_only_missing_or_torn_rows(prepared, verifier, tmp_path, capsys):
    out = tmp_path / "data"
    shutil.copytree(prepared, out)
    (out / "hidden_states" / "hs_5.safetensors").write_bytes(b"torn")
    (out / "hidden_states" / "hs_6.safetensors").unlink()
    assert prepare(out, verifier) == 0
    assert "; 2 hs files written now" in capsys.readouterr().out
    assert prepare(out, verifier) == 0
    assert "; 0 hs files written now" in capsys.readouterr().out


def test_train_runs_speculators_on_the_cpu_and_our_harness_loads_its_checkpoint(prepared, verifier, tmp_path):
    from models.export.api import load_export
    from models.registry import load_drafter
    from train.export import main as export_main

    sync = torch.accelerator.synchronize
    save = tmp_path / "ckpt"
    assert peer.main(["train", "--data", str(prepared), "--threads", "1", "--max-steps", "3", "--log-freq", "1",
                      "--save-path", str(save)]) == 0
    assert torch.accelerator.synchronize is sync  # the patches are put back
    recs = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train" in r]
    assert [r["global_step"] for r in steps] == [0, 1, 2] and all(r["profile"]["tokens_per_s"] > 0 for r in steps)
    assert any("val" in r for r in recs)  # validated on our held-out rows
    ckpt = save / "0"
    assert export_main(["--check", str(ckpt), "--target", str(verifier)]) == 0
    target = FrozenTarget.from_pretrained(str(verifier))
    theirs = load_export(ckpt, target).float()
    assert theirs.cfg.norm_before_fc and theirs.cfg.norm_output and theirs.cfg.norm_before_residual
    assert theirs.layer_ids == LAYERS
    assert torch.equal(theirs.d2t, torch.from_numpy(np.load(prepared / "d2t.npy")))
    # speculators' own model, loaded from its checkpoint, drafts what our loader's drafter drafts
    spec_model = _speculators_model(ckpt, "sdpa").float()
    toks = torch.randint(3, target.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    hidden = target(toks[:, :10], layer_ids=LAYERS).hidden
    mine = theirs.ttt_forward(toks[:, :10], hidden, steps=3)
    spec = _speculators_logits(spec_model, torch.cat([hidden[k] for k in LAYERS], -1), toks[:, 1:], 3)
    for k in range(3):
        torch.testing.assert_close(spec[k][0, : 9 - k], mine[k][0, : 9 - k].detach(), rtol=0, atol=2e-5)
    ours, meta = load_drafter(save / "final", target)  # what `python -m eval checkpoints.eagle3=...` loads
    assert meta["draft"]["ttt_steps"] == 3 and meta["trained_by"]["checkpoint"] == str(ckpt)
    toks = toks[:, :10]
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.embed.weight)  # load_export cast its copy to bf16 with the rest
        for a, b in zip(theirs.ttt_forward(toks, hidden, steps=3), ours.ttt_forward(toks, hidden, steps=3)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_input_is_one_error_line(prepared, verifier, tmp_path, capsys, monkeypatch, tiny_tokenizer):
    assert peer.main(["train", "--data", str(tmp_path / "nowhere")]) == 2
    assert "no manifest.json there; run `scripts/peer_speculators.py prepare" in capsys.readouterr().err
    assert peer.main(["train", "--data", str(prepared), "--verifier-name-or-path", str(tmp_path)]) == 2
    assert "is not the target" in capsys.readouterr().err
    other = tmp_path / "other"
    make_tiny_llama(len(tiny_tokenizer), seed=9).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    shutil.copy(prepared / "manifest.json", tmp_path / "manifest.json")
    assert peer.main(["prepare", "--out", str(tmp_path), *recipe(other, tmp_path)]) == 2
    assert "was prepared for another target" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "speculators.train.cli", None)
    assert peer.main(["train", "--data", str(prepared)]) == 2
    assert "run `make install`" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_muon_orthogonalisation_in_fp32_is_torchs_iteration(shape):
    """The CPU patch's fp32 Newton-Schulz is torch.optim.Muon's bf16 one up to bf16 rounding, in both orientations,
    and orthogonalises as Muon's quintic does (singular values pushed into ~[0.5, 1.5], never transposed)."""
    import torch.optim._muon as muon
    from peer_cpu import newton_schulz_fp32

    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coeffs = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
    ours = newton_schulz_fp32(g, coeffs, muon.DEFAULT_NS_STEPS, 1e-7)
    theirs = muon._zeropower_via_newtonschulz(g, coeffs, muon.DEFAULT_NS_STEPS, 1e-7).float()
    assert ours.shape == g.shape and ours.dtype == g.dtype
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    s = torch.linalg.svdvals(ours)
    assert s.min() > 0.3 and s.max() < 1.6
