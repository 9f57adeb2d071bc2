"""A new draft method is its package + its yaml + one registry line, proven with a fifth method: adding one must
not mean editing shared code or a hand-kept list of methods.

models/methods/toy (a bigram head, conf/draft/toy.yaml) sits exactly where a real method goes and is registered by
one flagged registry line (``DRAFTSMITH_TOY_METHOD=1``), never monkeypatched in. With the flag set, subprocesses run
what a user runs: the layer and config tests (they must pass with the toy in the registry), ``python -m train
draft=toy``, ``python -m eval`` with it and its declared variant, and ``python -m train.export`` / ``--check``. The
grep test proves no other code names it, so no hand-kept list was needed anywhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import registry
from models.core.target import FrozenTarget
from models.methods import toy

ROOT = Path(__file__).resolve().parents[1]
CODE = ("train", "models", "data", "eval", "conf", "scripts", "Makefile", "pyproject.toml")
ALLOWED = ("models/methods/toy/", "conf/draft/toy.yaml")


def _env() -> dict:
    return {**os.environ, "DRAFTSMITH_TOY_METHOD": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "disabled"}


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{args[:3]} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def test_nothing_outside_its_package_and_yaml_names_the_toy():
    """Every mention of the toy in the code and configs: its package, its yaml and the one registry line."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *CODE], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for rel in files:
        if rel.startswith(ALLOWED) or not (ROOT / rel).is_file() or b"\0" in (ROOT / rel).read_bytes():
            continue  # binary files (shipped .gz data) hold no code; their bytes spell "toy" by chance
        for i, line in enumerate((ROOT / rel).read_text(errors="replace").splitlines(), 1):
            if re.search(r"\btoy\b", line, re.I):
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert len(hits) == 1 and hits[0].startswith("models/registry.py:"), "\n".join(hits)
    assert 'METHODS["toy"]' in hits[0]


def test_the_toy_is_registered_only_under_its_flag():
    assert "toy" not in registry.METHODS or os.environ.get("DRAFTSMITH_TOY_METHOD") == "1"
    out = _run("-c", "from models import registry; print(list(registry.METHODS))").stdout
    assert out.strip().endswith("'toy']")


@pytest.fixture(scope="module")
def target_path(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("toy_target")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def test_the_layer_and_config_tests_pass_with_the_toy_registered():
    """They derive layers from paths and eval rows from the specs: a fifth method needs no edit to either."""
    out = _run("-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "tests/test_layers.py",
               "tests/test_config.py").stdout
    assert re.search(r"\d+ passed", out) and "failed" not in out


def test_the_toy_trains_benchmarks_and_exports_through_the_real_clis(target_path, tmp_path):
    run_dir, bench, export = tmp_path / "run", tmp_path / "bench", tmp_path / "export"
    _run("-m", "train", "draft=toy", f"target.name_or_path={target_path}", f"output_dir={run_dir}", "tracking=none",
         "data.max_rows=8", "data.val_rows=2", "data.max_len=48", f"data.cache_dir={run_dir}/data", "train.steps=2",
         "train.batch_size=2", "train.ckpt_every=100", "train.log_every=1", "train.eval_every=100",
         "optim.warmup_steps=1")
    final = run_dir / "final"
    meta = json.loads((final / "config.json").read_text())
    assert meta["method"] == "toy" and meta["step"] == 2
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in logged)

    # eval: the toy and its declared variant (toy_k1) with their spec defaults, lossless against AR at T=0
    _run("-m", "eval", f"target.name_or_path={target_path}", "methods=[ar,toy,toy_k1]", f"checkpoints.toy={final}",
         "n_prompts=2", "prompt_tokens=12", "max_new_tokens=16", "repetitions=1", "warmup=0", "cost_reps=1",
         "threads=1", "progress=false", "temperatures=[0]", "batch_sizes=[]", "peers=false", "draft_model=null",
         "decode_step=eager", f"out_dir={bench}")
    res = json.loads((bench / "results.json").read_text())
    assert res["lossless"] and {"toy", "toy_k1"} <= set(res["methods"])
    assert res["methods"]["toy"]["options"] == {"num_speculative_tokens": 3}
    assert res["methods"]["toy_k1"]["options"] == {"num_speculative_tokens": 1}
    assert all(m["lossless"] for m in res["methods"].values())
    toy_runs = [r for r in res["runs"] if r["method"] == "toy"]
    assert toy_runs and toy_runs[0]["tau"] >= 1.0

    # export through its own format row (CLI spelling "toy"), validated and detected from config.json
    _run("-m", "train.export", str(final), "--format", "toy", "--out", str(export))
    readme = (export / "README.md").read_text()
    assert "# draftsmith export: toy_native" in readme and "## Loading it" in readme  # its row's own section
    assert "vllm serve" not in readme  # no engine command invented
    checked = _run("-m", "train.export", "--check", str(export), "--target", str(target_path)).stdout
    assert "valid toy_native export" in checked


def test_toy_decodes_losslessly_and_really_drafts(tiny_llama, tiny_tokenizer):
    """In process, straight from the package (no registry needed): greedy speculative decoding equals AR."""
    from eval.decode.single import decode_ar, speculative_decode

    target = FrozenTarget(tiny_llama)
    torch.manual_seed(0)
    head = toy.build(toy.ToyConfig(rank=8), target)
    drafted = 0
    for text in ["def add(a, b):\n    return", "for i in range(10):\n"]:
        p = torch.tensor([tiny_tokenizer(text, add_special_tokens=False)["input_ids"]])
        spec = speculative_decode(target, toy.BigramChainProposer(head, num_speculative_tokens=3), p, 24)
        assert spec.tokens == decode_ar(target, p, 24).tokens
        drafted += sum(spec.drafted)
    assert drafted > 0


def test_toy_training_loss_matches_its_positionwise_reference(tiny_llama):
    """The toy's vectorised loss is what its docstring says (so the two trained steps optimise something real)."""
    target = FrozenTarget(tiny_llama)
    head = toy.build(toy.ToyConfig(rank=8), target)
    ids = torch.randint(3, tiny_llama.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    out = target(ids, layer_ids=head.layer_ids)
    loss, metrics = head.training_loss(ids, mask, out.hidden, out.logits)
    ref = training_loss_reference(head, ids, mask, out.hidden, out.logits)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5) and metrics["n_0"] == 10 + 5


def training_loss_reference(head: toy.BigramHead, ids: torch.Tensor, mask: torch.Tensor,
                            hidden: dict[int, torch.Tensor],
                            logits: torch.Tensor) -> torch.Tensor:
    """The same loss written position by position (the no-vectorisation reference)."""
    total, n = torch.zeros(()), 0.0
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1] - 2):
            if mask[b, i + 2]:
                p = logits[b, i + 1].float().softmax(-1)
                lq = head.logits(ids[b, i + 1], hidden[head.layer_ids[0]][b, i]).float().log_softmax(-1)
                total = total - (p * lq).sum()
                n += 1
    return total / max(n, 1.0)
