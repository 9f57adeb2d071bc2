"""The llama.cpp GGUF export's own logic, without llama.cpp (the engine tier, tests/engines/test_llamacpp.py, runs
the converter and the engine): which layout each method goes through, the refusals, the manifest check, the
round counters, and that a failed export leaves nothing behind."""

from __future__ import annotations

import json

import pytest

from eval.engines.llamacpp import counts, sum_counts
from models.export import llamacpp as G
from models.export.shared.common import ExportError
from tests.faults.fault_helpers import write_small_gguf
from tests.test_export import _train
from train.export import main


def test_the_layouts_llamacpp_converts():
    assert [(f.name, f.llamacpp) for f in G.llamacpp_rows("eagle3")] == [
        ("eagle3_native", "draft-eagle3"), ("eagle3_speculators", "draft-eagle3")]
    assert [(f.name, f.llamacpp) for f in G.llamacpp_rows("dflash")] == [
        ("dflash_zlab", "draft-dflash"), ("dspark_zlab", "draft-dspark"), ("dspark_speculators", "draft-dspark")]


@pytest.mark.parametrize("method", ["medusa", "mtp", "peagle"])
def test_gaps_are_refused_with_the_reason(method):
    """Tracked gaps, not skips: when a method's export.py gains a llama.cpp row, this fails and it joins the tier."""
    with pytest.raises(ExportError, match=f"llama.cpp has no {method} draft layout.*Llama graph"):
        G.require_rows(method)


def test_counts_stop_at_the_budget_and_count_like_vllm():
    # budget 6 tokens after t0: rounds (2,3)->3, (0,3)->1, (1,1)->2 fill it; (1,3) is the round past the budget
    c = counts([(2, 3), (0, 3), (1, 1), (1, 3)], budget=6, num_speculative_tokens=3)
    assert c == {"num_drafts": 3, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1, 0], "past_budget": 1,
                 "accepted_by_round": [2, 0, 1]}
    # a round that drafted nothing is no draft
    assert counts([(0, 0), (3, 3)], budget=5, num_speculative_tokens=3)["num_drafts"] == 1
    assert sum_counts([c, c])["accepted_per_pos"] == [4, 2, 0]


def test_server_rounds_and_divergence_positions():
    """llama-server reports totals per request: two requests of 9 generated tokens, the first from the prompt's
    forward; 5 and 2 drafts accepted leave 3 and 6 rounds."""
    from eval.engines.llamacpp_server import first_difference, round_counts

    c = round_counts([{"decoded": 9, "draft_n": 9, "draft_n_accepted": 5},
                      {"decoded": 9, "draft_n": 18, "draft_n_accepted": 2}])
    assert c["rounds"] == 9 and c["acceptance"] == 7 / 27 and c["tokens_per_round"] == 16 / 9
    assert round_counts([{"decoded": 4, "draft_n": 0, "draft_n_accepted": 0}])["acceptance"] is None
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # one ending early is a divergence too


def test_check_gguf_refuses_another_draft_file(tmp_path):
    write_small_gguf(tmp_path / G.DRAFT, "the converted bytes")
    (tmp_path / G.MARKER).write_text(json.dumps({"draft_sha256": G.file_sha256(tmp_path / G.DRAFT)}))
    assert G.check_gguf(tmp_path)["draft_sha256"]
    (tmp_path / G.DRAFT).write_bytes(b"GGUF other bytes")
    with pytest.raises(ExportError, match="sha256 differs"):
        G.check_gguf(tmp_path)
    (tmp_path / G.DRAFT).unlink()
    with pytest.raises(ExportError, match="missing"):
        G.check_gguf(tmp_path)


@pytest.fixture(scope="module")
def eagle3_ckpt(tmp_path_factory, target_dir):
    return _train(target_dir, tmp_path_factory.mktemp("e3") / "run", "eagle3")


def test_without_llamacpp_sources_a_clear_error_and_nothing_left(eagle3_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_LLAMA_CPP_DIR", str(tmp_path / "no-llama.cpp"))
    out = tmp_path / "exports" / "g"
    assert main([str(eagle3_ckpt), "--format", "gguf", "--out", str(out)]) == 2
    assert "no llama.cpp sources" in capsys.readouterr().err
    assert not out.exists() and list((tmp_path / "exports").iterdir()) == []  # the temporary directory is gone too


def test_gguf_export_never_replaces_a_foreign_directory(eagle3_ckpt, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main([str(eagle3_ckpt), "--format", "gguf", "--out", str(out), "--force"]) == 2
    assert "not a previous GGUF export" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


def test_the_gguf_readme_recommends_the_measured_target_type_and_k():
    """A GGUF export made with engine --results names the target type and K that served fastest, and says plainly
    when even that was slower than the engine's own AR."""
    m = {"spec_type": "draft-eagle3", "source_format": "eagle3_native", "num_speculative_tokens": 2, "outtype": "f32",
         "llama_cpp_python_sources": G.LLAMA_CPP_PYTHON_VERSION, "serve_name": None,
         "measured_best": {"engine": "llama-server", "target_type": "bf16", "num_speculative_tokens": 2,
                           "tokens_per_s": 112.0, "speedup": 1.12, "results": "bench/x/results.json"}}
    text = G.readme(m)
    assert "--spec-draft-n-max 2" in text
    assert "llama-server with the target as a bf16 GGUF at K=2, 112.0 tokens/s, 1.12×" in text
    assert "faster than plain decoding there" in text
    m["measured_best"]["speedup"] = 0.8
    assert "slower than plain decoding there: serve the target alone" in G.readme(m)
    assert "Measured best" not in G.readme({**m, "measured_best": None})
