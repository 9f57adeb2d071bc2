"""The engine benchmark and the export as a user runs them (the export recommends the K that measured best in the
engine, since the engine's per-round cost, not the harness's, decides it): ``python -m eval.engines.bench --engine
llamacpp --server --draft-k ...`` serves one trained drafter at several K through llama-server, and ``python -m
train.export --results`` carries the fastest K into the GGUF export. The drafters are the tier's
(tests/engines/served_llamacpp.py trains them once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eval.engines import serving as E
from tests.engines import drafters as D
from tests.engines.served import _root, _runs_dir
from tests.engines.served_llamacpp import llamacpp_results

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _py(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=E.REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_bench_sweeps_k_in_llama_server_and_the_export_carries_the_fastest(tmp_path_factory, tmp_path):
    llamacpp_results(tmp_path_factory)  # the tier's drafters trained (and the engine built, else skipped)
    ckpt = D.final(_runs_dir(_root(tmp_path_factory)), "eagle3")
    out = tmp_path / "bench"
    proc = _py("-m", "eval.engines.bench", "--engine", "llamacpp", "--server", "--target", "tiny-code",
               "--checkpoint", f"eagle3={ckpt}", "--draft-k", "1", "3", "--draft-types", "f32", "q8_0",
               "--repetitions", "2", "--n-prompts", "2", "--max-new-tokens", "24", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # 1 would be a row off AR's tokens
    res = json.loads((out / "results.json").read_text())
    rows = {n: r for n, r in res["methods"].items() if r["method"] == "eagle3"}
    names = {f"eagle3_k{k}_{t}" for k in (1, 3) for t in ("f32", "q8_0")}
    assert set(rows) == names and all(r["ok"] and r["lossless"] for r in rows.values())
    assert {(r["num_speculative_tokens"], r["draft_type"]) for r in rows.values()} == {
        (k, t) for k in (1, 3) for t in ("f32", "q8_0")}
    # two repetitions each, and the round in parts (llama-bench is built with the tools)
    assert all(len(r["tokens_per_s_reps"]["1"]) == 2 and r["breakdown"]["draft_ms"] > 0 for r in rows.values())
    best = max(rows, key=lambda n: rows[n]["speedup_vs_engine_ar"]["1"])

    exp = tmp_path / "gguf"
    proc = _py("-m", "train.export", str(ckpt), "--format", "gguf", "--out", str(exp), "--target", "tiny-code",
               "--results", str(out / "results.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads((exp / "gguf.json").read_text())
    k = rows[best]["num_speculative_tokens"]
    assert m["num_speculative_tokens"] == k and m["measured_best"]["row"] == best
    assert m["outtype"] == rows[best]["draft_type"]  # the draft's type is the fastest row's
    readme = (exp / "README.md").read_text()
    assert f"--spec-draft-n-max {k}" in readme and f"Measured best (`{out / 'results.json'}`)" in readme
