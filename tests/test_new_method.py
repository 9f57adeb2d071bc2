"""A new draft method is one file + its yaml + one registry line (+ one export-format row): issue 10's proof.

tests/toy_method.py defines a fourth method (a bigram head); this test registers it with one line, trains it for
two steps through the real training loop, reloads the checkpoint, decodes with it losslessly, runs it through the
benchmark's method setup, and exports it through one added format row and loads that back. Nothing in train/,
eval/, models/ or conf/ knows the toy exists.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import tests.toy_method as toy
from eval.bench_setup import build_methods
from eval.decode import decode_ar, speculative_decode
from models import registry
from models.export import export, export_format, load_export, validate
from models.proposal import Sampling
from models.target import FrozenTarget
from train.loop import run as train_run

CONF = Path(__file__).resolve().parents[1] / "conf"
TOY_YAML = """# the toy bigram head (tests/toy_method.py)
method: toy
config:
  _target_: tests.toy_method.ToyConfig
  rank: 16
"""
PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n", "class Point:\n    def"]


@pytest.fixture
def toy_env(tmp_path, monkeypatch, tiny_llama, tiny_tokenizer):
    monkeypatch.setitem(registry.METHODS, "toy", toy.SPEC)  # the one registry line
    tiny_llama.save_pretrained(tmp_path / "target")
    tiny_tokenizer.save_pretrained(tmp_path / "target")
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "draft" / "toy.yaml").write_text(TOY_YAML)
    out = tmp_path / "run"
    over = [f"target.name_or_path={tmp_path / 'target'}", f"output_dir={out}", "tracking=none", "data.max_rows=8",
            "data.val_rows=2", "data.max_len=48", f"data.cache_dir={out}/data", "train.steps=2",
            "train.batch_size=2", "train.ckpt_every=100", "train.log_every=1", "train.eval_every=100",
            "optim.warmup_steps=1", "draft=toy"]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        summary = train_run(compose(config_name="config", overrides=over))
    target = FrozenTarget.from_pretrained(str(tmp_path / "target"))
    prompts = [torch.tensor([tiny_tokenizer(t, add_special_tokens=False)["input_ids"]]) for t in PROMPTS]
    return tmp_path, out / "final", summary, target, prompts


def _proposals(proposer, target: FrozenTarget, prompt: torch.Tensor, rounds: int = 4) -> list[list[int]]:
    """The proposer's drafts over a few rounds, fed the target's own greedy continuation one token at a time."""
    L = proposer.layer_ids
    out = target(prompt, layer_ids=L)
    ids = torch.cat([prompt, out.logits[:, -1:].argmax(-1)], 1)
    proposer.begin(ids, out.hidden, Sampling())
    seen = []
    for _ in range(rounds):
        seen.append(proposer.propose(3).tokens.tolist())
        out = target(ids, layer_ids=L)
        nxt = out.logits[:, -1:].argmax(-1)
        ids = torch.cat([ids, nxt], 1)
        proposer.accept(nxt, {k: v[:, -1:] for k, v in out.hidden.items()})
    return seen


def test_a_toy_method_trains_decodes_benchmarks_and_exports(toy_env):
    tmp, final, summary, target, prompts = toy_env
    # trained through train.loop.run: two logged steps with a finite loss, a self-describing checkpoint
    assert summary["method"] == "toy" and summary["steps"] == 2
    logged = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in logged)
    assert 0 <= logged[0]["elapsed_s"] <= logged[1]["elapsed_s"] and logged[1]["elapsed_s"] > 0  # the x axis
    val = [json.loads(line) for line in (tmp / "run" / "val.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val] == [2] and val[0]["elapsed_s"] >= logged[1]["elapsed_s"]
    assert val[0]["val/sim_tau"] == summary["val"]["sim_tau"]
    data = json.loads((tmp / "run" / "data_stats.json").read_text())
    assert data["train_rows"] > 0 and data["regenerated"] == [] and data["regen_seconds_total"] == 0
    meta = json.loads((final / "config.json").read_text())
    assert meta["method"] == "toy" and meta["draft"]["layer_id"] == target.num_layers

    # reloaded through the registry: the saved weights, in the method's own module
    head, meta2 = registry.load_drafter(final, target)
    assert isinstance(head, toy.BigramHead) and meta2["step"] == 2
    saved = load_file(str(final / "model.safetensors"))
    assert all(torch.equal(head.state_dict()[k], v) for k, v in saved.items())

    # lossless greedy speculative decoding with it, and it really drafts
    drafted = 0
    for p in prompts:
        spec = speculative_decode(target, toy.BigramChainProposer(head, k=3), p, 24)
        assert spec.tokens == decode_ar(target, p, 24).tokens
        drafted += sum(spec.drafted)
    assert drafted > 0

    # the benchmark's method setup finds it by name, with its option defaults, from the checkpoint
    methods, skipped = build_methods(target, ["ar", "toy"], {"toy": str(final)}, options={"toy": {"k": 2}})
    assert not skipped and [m.name for m in methods] == ["ar", "toy"]
    m = methods[1]
    assert m.chain and m.k == 2 and m.options == {"k": 2} and isinstance(m.model, toy.BigramHead)
    p = prompts[0]
    assert speculative_decode(target, m.make(None), p, 24).tokens == decode_ar(target, p, 24).tokens
    # ...and `python -m eval`'s config rows list it, its checkpoint dir, options and variant, from its spec alone
    from eval.defaults import eval_defaults

    rows = eval_defaults()
    assert rows["methods"][-2:] == ["toy", "toy_k1"] and rows["checkpoints"]["toy"] == "runs/toy/final"
    assert rows["options"]["toy"] == {"k": 3} and rows["variants"]["toy_k1"] == {"method": "toy", "k": 1}
    methods, _ = build_methods(target, ["toy_k1"], {"toy": str(final)})  # the declared variants by default
    assert [m.name for m in methods] == ["ar", "toy_k1"] and methods[1].k == 1 and methods[1].variant_of == "toy"

    # exported through one added format row, validated, detected and loaded back: the same proposals
    assert export_format("toy").name == "toy_native"  # its CLI spelling
    path = export(head, "toy_native", tmp / "export", target)
    assert validate(path, None, target) == "toy_native"  # detected from config.json
    back = load_export(path, target)
    readme = (path / "README.md").read_text()
    assert "# draftsmith export: toy_native" in readme and "vllm serve" not in readme  # no engine snippet invented
    assert isinstance(back, toy.BigramHead)
    for p in prompts:
        want = _proposals(toy.BigramChainProposer(head, k=3, sample_drafts=False), target, p)
        assert _proposals(toy.BigramChainProposer(back, k=3, sample_drafts=False), target, p) == want
        assert all(len(d) == 3 for d in want)


def test_toy_training_loss_matches_its_positionwise_reference(tiny_llama):
    """The toy's vectorised loss is what its docstring says (so the two trained steps optimise something real)."""
    target = FrozenTarget(tiny_llama)
    head = toy.build(toy.ToyConfig(rank=8), target)
    ids = torch.randint(3, tiny_llama.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    out = target(ids, layer_ids=head.layer_ids)
    loss, metrics = head.training_loss(ids, mask, out.hidden, out.logits)
    ref = toy.training_loss_reference(head, ids, mask, out.hidden, out.logits)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5) and metrics["n_0"] == 10 + 5
