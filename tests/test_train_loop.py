"""The training recipe end to end on a tiny target: all three methods, resume, offline features, errors."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from data.features import FeatureCache
from data.sources import DataConfig, build_rows
from models.core.drafter import DraftVocabTeacher
from models.core.target import FrozenTarget
from train.batches import collate
from train.loop import build_drafter, run, target_features

CONF = Path(__file__).resolve().parent.parent / "conf"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("target")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def cfg_for(target_dir, out, *overrides, method="eagle3"):
    base = [f"target.name_or_path={target_dir}", f"output_dir={out}", "tracking=none",
            "data.max_rows=24", "data.val_rows=4", "data.max_len=48", f"data.cache_dir={out}/data",
            "train.steps=4", "train.batch_size=2", "train.ckpt_every=2", "train.log_every=1",
            "train.eval_every=100", "optim.warmup_steps=1", f"draft={method}"]
    if method == "eagle3":
        base += ["draft.config.draft_vocab_size=200", "draft.config.ttt_steps=3", "draft.config.layer_ids=[1,2,3]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=base + list(overrides))


def final_weights(out):
    return load_file(str(Path(out) / "final" / "model.safetensors"))


def test_eagle3_resume_after_kill_equals_uninterrupted(target_dir, tmp_path):
    full = run(cfg_for(target_dir, tmp_path / "a"))
    assert full["val"]["sim_tau"] >= 1.0 and "acc_0" in full["val"]
    # "kill" after step 3: the checkpoint of step 2 survives, step 3's work is lost
    stopped = run(cfg_for(target_dir, tmp_path / "b", "train.stop_after=3"))
    assert stopped["stopped_at"] == 3
    (tmp_path / "b" / "checkpoints" / "step_0000004.tmp").mkdir()  # a half-written checkpoint
    run(cfg_for(target_dir, tmp_path / "b"))
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert a.keys() == b.keys() and "embed_tokens.weight" not in a  # frozen target copy not saved
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    # the learning curve's x axis: target tokens trained on, carried across the resume, the same at every step
    import json

    recs = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("a", "b")]
    seen = [[r["tokens_seen"] for r in rs] for rs in recs]
    assert seen[0] == seen[1] and seen[0] == sorted(seen[0]) and seen[0][0] > 0
    # of the training seconds, those the target's features took: cumulative across the resume (without the carry,
    # the resumed step 3 would hold one step's seconds, below step 2's two), never more than the training seconds
    for rs in recs:
        target_s = [r["target_s"] for r in rs]
        assert target_s == sorted(target_s) and 0 < target_s[0] and all(r["target_s"] <= r["elapsed_s"] for r in rs)


@pytest.mark.parametrize("method", ["medusa", "mtp"])
def test_other_methods_train_on_same_pipeline(target_dir, tmp_path, method):
    extra = ["draft.config.metric_top_k=2", "draft.config.tree_nodes=5"] if method == "medusa" else []
    res = run(cfg_for(target_dir, tmp_path, *extra, method=method))
    assert res["method"] == method and "acc_0" in res["val"]
    assert (tmp_path / "final" / "config.json").exists()
    if method == "medusa":  # the static tree built from held-out rank accuracies ships with the weights
        from models.methods.medusa.tree import load_static_tree

        tree = load_static_tree(tmp_path / "final")
        assert tree is not None and len(tree) == 5 and all(len(p) <= 4 for p in tree)


def test_resume_refuses_other_draft_config(target_dir, tmp_path):
    run(cfg_for(target_dir, tmp_path, "train.stop_after=2"))
    with pytest.raises(ValueError, match="different draft"):
        run(cfg_for(target_dir, tmp_path, "draft.config.ttt_steps=2"))


def test_bad_layer_ids_and_vocab(target_dir, tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        run(cfg_for(target_dir, tmp_path / "x", "draft.config.layer_ids=[1,2,9]"))
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        run(cfg_for(target_dir, tmp_path / "y", "draft.config.draft_vocab_size=100000"))


def test_online_and_offline_give_same_loss(target_dir, tmp_path):
    cfg = cfg_for(target_dir, tmp_path)
    target = FrozenTarget.from_pretrained(str(target_dir))
    rows, _ = build_rows(DataConfig(max_rows=6, max_len=48, val_rows=2), target.tokenizer)
    drafter = build_drafter(cfg.draft, target, rows)
    cache = FeatureCache(tmp_path / "feat", target, rows, drafter.layer_ids, dtype="float32", shard_rows=4)
    meta = cache.build(show_progress=False)
    assert meta["bytes_per_token"] > 0
    idx = [1, 4, 5]
    ids, mask = collate([rows[i] for i in idx], target.tokenizer.pad_token_id)
    on = drafter.training_loss(ids, mask, *target_features(target, drafter.layer_ids, ids, idx, None))[0]
    off = drafter.training_loss(ids, mask, *target_features(target, drafter.layer_ids, ids, idx, cache))[0]
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)
    # the stored argmax + draft-vocab logits (what a reduced-vocabulary EAGLE-3 step reads offline): same loss
    assert cache.has_top() and drafter.reads_draft_vocab_teacher
    hidden, teacher = target_features(target, drafter.layer_ids, ids, idx, cache, drafter.draft_ids)
    assert isinstance(teacher, DraftVocabTeacher) and teacher.logits.shape[-1] == len(drafter.draft_ids)
    loss, m = drafter.training_loss(ids, mask, hidden, teacher)
    torch.testing.assert_close(on, loss, rtol=1e-5, atol=1e-6)
    assert m["n_0"] == drafter.training_loss(ids, mask, *target_features(target, drafter.layer_ids, ids, idx,
                                                                          None))[1]["n_0"]
    # an interrupted build resumes: remove one shard, rebuild, same files
    cache.shard_path(1).unlink()
    cache.build(show_progress=False)
    assert cache.shard_path(1).exists()


def test_offline_evaluation_reads_heldout_features_not_the_target(target_dir, tmp_path, monkeypatch):
    """Offline mode caches the held-out rows' features once (beside the training cache) and evaluates from them,
    as training reads its own: the same numbers as running the target (float32 features), no target forward."""
    import train.loop as loop

    feats = tmp_path / "feat"
    cfg = cfg_for(target_dir, tmp_path / "run", "train.mode=offline", f"train.feature_cache={feats}",
                  "train.feature_dtype=float32", "train.eval_rows=3")
    calls = {"evaluations": 0, "target_forwards": 0}
    real_evaluate, real_forward = loop.evaluate, FrozenTarget.__call__
    seen = {}

    def counting_evaluate(drafter, target, rows, batch_size, pad_id, cache=None, teacher_ids=None):
        calls["evaluations"] += 1
        before = calls["target_forwards"]
        out = real_evaluate(drafter, target, rows, batch_size, pad_id, cache, teacher_ids)
        assert cache is not None and calls["target_forwards"] == before  # read from the cache, not the target
        seen.update(drafter=drafter, target=target, rows=rows, batch_size=batch_size, pad_id=pad_id, out=out)
        return out

    def counting_forward(self, *a, **k):
        calls["target_forwards"] += 1
        return real_forward(self, *a, **k)

    monkeypatch.setattr(loop, "evaluate", counting_evaluate)
    monkeypatch.setattr(FrozenTarget, "__call__", counting_forward)
    res = run(cfg)
    assert calls["evaluations"] >= 1 and (feats / "heldout_3" / "manifest.json").exists()
    online = real_evaluate(seen["drafter"], seen["target"], seen["rows"], seen["batch_size"], seen["pad_id"])
    assert len(seen["rows"]) == 3 and online.keys() == seen["out"].keys()
    for k in online:
        assert online[k] == pytest.approx(seen["out"][k], rel=1e-4, abs=1e-5), k
    assert res["val"] == seen["out"]


def test_one_feature_cache_serves_methods_whose_layers_it_stores(target_dir, tmp_path):
    """train.feature_layers: a cache built with the union of layers serves each subset, bit-identical to a cache of
    its own; a layer it does not store, or other data, is refused with the fix."""
    target = FrozenTarget.from_pretrained(str(target_dir))
    rows, _ = build_rows(DataConfig(max_rows=6, max_len=48, val_rows=2), target.tokenizer)
    shared = FeatureCache(tmp_path / "shared", target, rows, [1], dtype="float32", shard_rows=4,
                          store_layer_ids=[1, 2, 3])
    shared.build(show_progress=False)
    n_files = len(list((tmp_path / "shared").iterdir()))
    reader = FeatureCache(tmp_path / "shared", target, rows, [2, 3], dtype="float32", shard_rows=4)
    reader.build(show_progress=False)  # nothing to build: its layers are stored
    assert len(list((tmp_path / "shared").iterdir())) == n_files
    own = FeatureCache(tmp_path / "own", target, rows, [2, 3], dtype="float32", shard_rows=4)
    own.build(show_progress=False)
    h_shared, logits_shared = reader.batch([0, 5], 48)
    h_own, logits_own = own.batch([0, 5], 48)
    assert sorted(h_shared) == sorted(h_own) == [2, 3, target.num_layers]
    for k in h_own:
        assert torch.equal(h_shared[k], h_own[k])
    assert torch.equal(logits_shared, logits_own)
    with pytest.raises(ValueError, match=r"not \[0\].*feature_layers"):
        FeatureCache(tmp_path / "shared", target, rows, [0, 1], dtype="float32", shard_rows=4).build(False)
    with pytest.raises(ValueError, match="other data"):
        FeatureCache(tmp_path / "shared", target, rows[:5], [1], dtype="float32", shard_rows=4).build(False)
    with pytest.raises(ValueError, match="layer ids must lie"):
        FeatureCache(tmp_path / "z", target, rows, [1], store_layer_ids=[99])


def test_feature_cache_computed_in_bf16_is_keyed_apart_and_leaves_the_target_fp32(target_dir, tmp_path):
    """train.cache_compute_dtype=bfloat16: the states come from a bf16 copy of the target (close to the fp32 ones,
    not equal), the cache is refused to an fp32 run, and the target itself keeps its fp32 weights."""
    target = FrozenTarget.from_pretrained(str(target_dir))
    w = target.model.get_output_embeddings().weight.clone()
    rows, _ = build_rows(DataConfig(max_rows=5, max_len=48, val_rows=1), target.tokenizer)
    fp32 = FeatureCache(tmp_path / "fp32", target, rows, [1], dtype="float32", shard_rows=4)
    fp32.build(show_progress=False)
    bf16 = FeatureCache(tmp_path / "bf16", target, rows, [1], dtype="float32", shard_rows=4, compute_dtype="bfloat16")
    bf16.build(show_progress=False)
    assert bf16.meta["target"]["compute_dtype"] == "bfloat16" and "compute_dtype" not in fp32.meta["target"]
    assert target.model.dtype == torch.float32 and torch.equal(target.model.get_output_embeddings().weight, w)
    assert bf16.compute is target  # the bf16 copy is dropped once built
    built = {k: v for k, v in bf16.meta.items() if k.startswith("build_")}
    assert built["build_tokens"] == sum(len(r["input_ids"]) for r in rows) and built["build_tokens_per_s"] > 0
    again = FeatureCache(tmp_path / "bf16", target, rows, [1], dtype="float32", shard_rows=4, compute_dtype="bfloat16")
    again.build(show_progress=False)  # a run that only reads it keeps the ledger of the build that made it
    assert {k: v for k, v in again.meta.items() if k.startswith("build_")} == built
    h32, _ = fp32.batch([0, 3], 48)
    h16, _ = bf16.batch([0, 3], 48)
    assert not torch.equal(h32[1], h16[1])
    assert torch.allclose(h32[1], h16[1], atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="other data/target/dtype"):
        FeatureCache(tmp_path / "bf16", target, rows, [1], dtype="float32", shard_rows=4).build(False)


def test_wrong_tokenizer_data_is_refused(tiny_tokenizer):
    class Big:
        def __len__(self):
            return 10

        def __getattr__(self, name):
            return getattr(tiny_tokenizer, name)

        def __call__(self, *a, **k):
            return tiny_tokenizer(*a, **k)

    with pytest.raises(ValueError, match="another tokenizer"):
        build_rows(DataConfig(max_rows=2, max_len=32, val_rows=1), Big())


def test_final_checkpoint_loads_back_and_refuses_other_target(target_dir, tmp_path):
    from models.registry import load_drafter
    from tests.conftest import make_tiny_llama

    run(cfg_for(target_dir, tmp_path, "train.steps=2"))
    target = FrozenTarget.from_pretrained(str(target_dir))
    drafter, meta = load_drafter(tmp_path / "final", target)
    saved = final_weights(tmp_path)
    for k, v in drafter.state_dict().items():
        if k in saved:
            torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    assert meta["layer_ids"] == [1, 2, 3]
    other = FrozenTarget(make_tiny_llama(target.vocab_size, seed=1), target.tokenizer)  # same shape, other weights
    with pytest.raises(ValueError, match="another target"):
        load_drafter(tmp_path / "final", other)


def test_length_bucketed_epochs_cover_every_row_once_with_less_padding():
    """train.length_bucket: each epoch still visits every row once, in an order fixed by (seed, epoch), and a
    step's rows have similar lengths, so its padded width shrinks."""
    import numpy as np

    from train.batches import batch_indices
    from train.distributed import Dist

    d = Dist(rank=0, world_size=1, local_rank=0)
    lengths = tuple(int(x) for x in np.random.default_rng(0).integers(20, 512, 96))
    n, bs = len(lengths), 4

    def epoch(bucket):
        return [batch_indices(n, s, 0, bs, 1, d, seed=3, lengths=lengths, bucket=bucket) for s in range(n // bs)]

    plain, bucketed = epoch(0), epoch(8)
    assert sorted(i for b in bucketed for i in b) == list(range(n))
    assert bucketed == epoch(8) and bucketed != plain
    padded = lambda batches: sum(bs * max(lengths[i] for i in b) for b in batches)
    assert padded(bucketed) < 0.8 * padded(plain)


def test_keep_best_holds_the_best_held_out_drafter_across_resumes(target_dir, tmp_path):
    """train.keep_best: best/ is a loadable drafter whose eval.json is the highest simulated τ of val.jsonl."""
    import json

    from models.registry import load_drafter

    over = ["train.keep_best=true", "train.eval_every=1", "train.steps=4"]
    run(cfg_for(target_dir, tmp_path, *over, "train.stop_after=2"))
    run(cfg_for(target_dir, tmp_path, *over))  # resumed: compares with the best of the first piece
    vals = [json.loads(x) for x in (tmp_path / "val.jsonl").read_text().splitlines()]
    best = json.loads((tmp_path / "best" / "eval.json").read_text())
    top = max(vals, key=lambda r: r["val/sim_tau"])
    assert best["sim_tau"] == top["val/sim_tau"] and best["step"] == min(
        r["step"] for r in vals if r["val/sim_tau"] == top["val/sim_tau"])
    target = FrozenTarget.from_pretrained(str(target_dir))
    drafter, meta = load_drafter(tmp_path / "best", target)
    assert meta["step"] == best["step"]


@pytest.mark.parametrize("mode", ["target", "target_frozen"])
def test_lm_head_from_the_target_trains_saves_and_reloads(target_dir, tmp_path, mode):
    """draft.config.lm_head: the head starts as the target's draft-vocabulary rows; target_frozen keeps them through
    training and is still saved and reloaded (it is the drafter's, not the target's, once the vocabulary is cut)."""
    from models.registry import load_drafter

    run(cfg_for(target_dir, tmp_path, f"draft.config.lm_head={mode}"))
    target = FrozenTarget.from_pretrained(str(target_dir))
    drafter, _ = load_drafter(tmp_path / "final", target)
    rows = target.model.get_output_embeddings().weight.float()[drafter.draft_ids]
    saved = final_weights(tmp_path)["lm_head.weight"]
    assert torch.equal(drafter.lm_head.weight, saved)
    assert torch.equal(saved, rows) == (mode == "target_frozen")  # trained away from the copy, or kept
    if mode == "target":
        assert (saved - rows).abs().max() < 0.01  # it started there: 4 AdamW steps move it by ~4 x lr


def test_bf16_autocast_trains_close_to_fp32_and_keeps_fp32_weights(target_dir, tmp_path):
    """train.autocast=bfloat16: the drafter's GEMMs in bf16, its weights and optimizer in fp32; the losses follow the
    fp32 run's to bf16's precision (not bit-equal: the arithmetic is another)."""
    import json

    from train.loop import autocast_dtype

    runs = {}
    for name, over in (("fp32", []), ("bf16", ["train.autocast=bfloat16"])):
        run(cfg_for(target_dir, tmp_path / name, *over))
        runs[name] = [json.loads(x)["train/loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert runs["fp32"] != runs["bf16"]
    for a, b in zip(runs["fp32"], runs["bf16"]):
        assert b == pytest.approx(a, rel=0.05)
    assert all(v.dtype == torch.float32 for v in final_weights(tmp_path / "bf16").values() if v.is_floating_point())
    assert autocast_dtype(None, "cpu") is None and autocast_dtype("bfloat16", "cpu") == torch.bfloat16
    assert autocast_dtype("auto", "cpu") in (None, torch.bfloat16)


def test_a_feature_cache_grows_with_its_rows(target_dir, tmp_path, monkeypatch):
    """Rows that extend the cache's rows (a second data tranche after the first): the full shards are kept, the
    old partial one and the new ones are built, and every row reads what a cache built at once holds. Fewer or
    other rows are refused, and nothing is deleted then."""
    target = FrozenTarget.from_pretrained(str(target_dir))
    rows, _ = build_rows(DataConfig(max_rows=12, max_len=48, val_rows=2), target.tokenizer)
    old, new = rows[:6], rows[:6] + rows[6:9]
    FeatureCache(tmp_path / "grow", target, old, [1], dtype="float32", shard_rows=4).build(show_progress=False)
    kept = (tmp_path / "grow" / "shard_00000.safetensors").stat().st_mtime_ns
    built: list[int] = []
    real = FeatureCache._build_shard
    monkeypatch.setattr(FeatureCache, "_build_shard", lambda self, i: (built.append(i), real(self, i)))
    grown = FeatureCache(tmp_path / "grow", target, new, [1], dtype="float32", shard_rows=4)
    meta = grown.build(show_progress=False)
    assert built == [1, 2] and meta["rows"] == 9
    assert (tmp_path / "grow" / "shard_00000.safetensors").stat().st_mtime_ns == kept
    once = FeatureCache(tmp_path / "once", target, new, [1], dtype="float32", shard_rows=4)
    once.build(show_progress=False)
    for r in range(9):
        got, want = grown.get(r), once.get(r)
        assert all(torch.equal(got[k], want[k]) for k in want)
    files = sorted(p.name for p in (tmp_path / "grow").iterdir())
    for other in (old, rows[1:10]):  # fewer rows, or rows that do not extend the cache's
        with pytest.raises(ValueError, match="other data"):
            FeatureCache(tmp_path / "grow", target, other, [1], dtype="float32", shard_rows=4).build(False)
    assert sorted(p.name for p in (tmp_path / "grow").iterdir()) == files
    # a cache whose rows fit in one partial shard grows too
    FeatureCache(tmp_path / "small", target, rows[:2], [1], dtype="float32", shard_rows=4).build(False)
    FeatureCache(tmp_path / "small", target, rows[:7], [1], dtype="float32", shard_rows=4).build(False)
