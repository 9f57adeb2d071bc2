"""scripts/peer_table.py: the ours-vs-speculators table is computed from the runs' own records, copied beside it, and
runs that did not train on the same rows or vocabulary, or a harness run without both drafters, are refused in one
line (exit 2) with nothing written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("peer_table", ROOT / "scripts" / "peer_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


def _run(method: str, tau: float) -> dict:
    return {"method": method, "temperature": 0.0, "tau": tau, "acceptance_by_pos": [0.5, 0.4, 0.3, 0.2],
            "tokens": 320, "rounds": int(320 / tau), "lossless": True}


@pytest.fixture
def runs(tmp_path):
    d2t = np.arange(8, dtype=np.int64)
    ours, peer, bench = tmp_path / "ours", tmp_path / "peer", tmp_path / "bench"
    (ours / "final").mkdir(parents=True)
    save_file({"d2t": torch.from_numpy(d2t), "fc.weight": torch.zeros(2, 2)}, str(ours / "final" / "model.safetensors"))
    (ours / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": 60.0 * s, "tokens_seen": 100 * s})
                                                + "\n" for s in (1, 2, 3)))
    (peer / "data").mkdir(parents=True)
    (peer / "checkpoints").mkdir()
    np.save(peer / "data" / "d2t.npy", d2t)
    (peer / "data" / "manifest.json").write_text(json.dumps({
        "train_rows": 12, "val_rows": 4, "train_tokens": 300, "layer_ids": [1, 2, 3], "recipe": ["+recipe=x"],
        "hidden_states_dtype": "float32", "our_steps": 3, "states_written": {"rows": 8, "seconds": 30.0}}))
    (peer / "checkpoints" / "train_result.json").write_text(json.dumps({"steps": 2, "seconds": 90.0,
                                                                        "tokens_per_s": 400.0}))
    for name, (ours_tau, peer_tau) in {"heldout": (2.0, 1.6), "mt_bench": (1.5, 1.5)}.items():
        (bench / name).mkdir(parents=True)
        (bench / name / "results.json").write_text(json.dumps({"prompts": {"n": 10}, "runs": [
            _run("ar", 1.0), _run("eagle3", ours_tau), _run("eagle3_peer", peer_tau)]}))
    return ours, peer, bench


def test_table_from_the_runs_records(runs, capsys):
    ours, peer, bench = runs
    assert table.main(["--ours", str(ours), "--peer", str(peer), "--bench", str(bench)]) == 0
    s = json.loads((bench / "summary.json").read_text())
    assert s["ratio_heldout_tau"] == pytest.approx(2.0 / 1.6) and s["ratio_mt_bench_tau"] == pytest.approx(1.0)
    assert s["cost"]["ours"]["seconds"] == 180.0
    assert s["cost"]["ours"]["train_seconds"] == pytest.approx(180.0 - 60.0 * 12 / 16)  # minus the states' share
    assert s["cost"]["ours"]["train_seconds_estimated"]  # (its records predate target_s)
    assert s["cost"]["peer"]["seconds"] == pytest.approx(30.0 * 16 / 8 + 90.0)  # states scaled to all 16 rows
    assert s["data"]["draft_vocab_size"] == 8
    assert (bench / "train_ours" / "metrics.jsonl").is_file() and (bench / "train_peer" / "manifest.json").is_file()
    assert "| speculators 0.9.0 | held-out prompts (clean split) | 1.60 |" in capsys.readouterr().out


def test_a_torn_last_record_is_not_read(runs):
    ours, peer, _ = runs
    with open(ours / "metrics.jsonl", "a") as fh:  # killed while writing its next record
        fh.write('{"step": 4, "elaps')
    cost = table.training_costs(ours, peer, json.loads((peer / "data" / "manifest.json").read_text()))["ours"]
    assert cost["steps"] == 3 and cost["seconds"] == 180.0


def test_our_own_seconds_from_target_s(runs):
    ours, peer, bench = runs
    with open(ours / "metrics.jsonl", "a") as fh:  # records with target_s: no estimate
        fh.write(json.dumps({"step": 3, "elapsed_s": 200.0, "target_s": 50.0, "tokens_seen": 300}) + "\n")
    cost = table.training_costs(ours, peer, json.loads((peer / "data" / "manifest.json").read_text()))["ours"]
    assert cost["train_seconds"] == 150.0 and not cost["train_seconds_estimated"]


def _refused(runs, capsys, needle: str) -> None:
    ours, peer, bench = runs
    assert table.main(["--ours", str(ours), "--peer", str(peer), "--bench", str(bench)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not (bench / "summary.json").exists()


def test_another_draft_vocabulary_is_refused(runs, capsys):
    np.save(runs[1] / "data" / "d2t.npy", np.arange(1, 9, dtype=np.int64))
    _refused(runs, capsys, "different draft vocabularies")


def test_another_step_count_is_refused(runs, capsys):
    with open(runs[0] / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 4, "elapsed_s": 240.0, "tokens_seen": 400}) + "\n")
    _refused(runs, capsys, "not the 3 that draw the peer's rows")


def test_a_harness_run_without_the_peer_is_refused(runs, capsys):
    path = runs[2] / "mt_bench" / "results.json"
    res = json.loads(path.read_text())
    res["runs"] = [r for r in res["runs"] if r["method"] != "eagle3_peer"]
    path.write_text(json.dumps(res))
    _refused(runs, capsys, "no T=0 run of ['eagle3_peer']")
