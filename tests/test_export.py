"""Exports for serving engines: exact layouts, a validator that refuses broken directories, round trips, CLI.

Tiny targets (a 4-layer Llama, a 2-layer DeepSeek-V3 for the SGLang NextN format) and drafters trained for
2 steps through the real training loop; every export is loaded back into draftsmith's modules and must give
the very same proposals as the training checkpoint.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab
from models.export.api import export, load_export
from models.export.formats import export_format
from models.export.shared.common import CONFIG, README, SIDECAR, WEIGHTS, ExportError
from models.export.validate import detect_format, validate
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.net import Eagle3Drafter
from models.methods.medusa.export import MEDUSA_WEIGHTS
from models.methods.medusa.net import propose
from models.methods.mtp.export import fuse_experts, unfuse_experts
from models.methods.mtp.proposers import propose_chain
from models.registry import load_drafter
from tests.conftest import make_tiny_llama
from train.export import main
from train.loop import run

CONF = Path(__file__).resolve().parent.parent / "conf"


def _train(target_dir: Path, out: Path, method: str) -> Path:
    over = [f"target.name_or_path={target_dir}", f"output_dir={out}", "tracking=none", "data.max_rows=16",
            "data.val_rows=2", "data.max_len=40", f"data.cache_dir={out}/data", "train.steps=2", "train.batch_size=2",
            "train.ckpt_every=100", "train.log_every=1", "train.eval_every=100", "optim.warmup_steps=1",
            f"draft={method}"]
    if method == "eagle3":
        over += ["draft.config.draft_vocab_size=200", "draft.config.ttt_steps=2", "draft.config.layer_ids=[1,2,3]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        run(compose(config_name="config", overrides=over))
    return out / "final"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("llama")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def target(llama_dir):
    return FrozenTarget.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module")
def ckpts(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {m: _train(llama_dir, root / m, m) for m in ("eagle3", "medusa", "mtp")}


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                           q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           num_nextn_predict_layers=1, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                           pad_token_id=2)
    d = tmp_path_factory.mktemp("deepseek")
    DeepseekV3ForCausalLM(cfg).eval().save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def ds(ds_dir, tmp_path_factory):
    ckpt = _train(ds_dir, tmp_path_factory.mktemp("ds_ckpt") / "mtp", "mtp")
    return FrozenTarget.from_pretrained(str(ds_dir)), ckpt


@pytest.fixture(scope="module")
def native(ckpts, target, tmp_path_factory):
    """A good eagle3_native export, copied by tests that break it."""
    d, meta = load_drafter(ckpts["eagle3"], target)
    return export(d, "eagle3_native", tmp_path_factory.mktemp("good") / "e3", target, meta=meta)


def _broken(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path: Path, fn, file: str = WEIGHTS) -> None:
    sd = load_file(str(path / file))
    fn(sd)
    save_file(sd, str(path / file), metadata={"format": "pt"})


def _edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / CONFIG).read_text())
    fn(cfg)
    (path / CONFIG).write_text(json.dumps(cfg))


def _keys(path: Path, file: str = WEIGHTS) -> set[str]:
    with safe_open(str(path / file), framework="pt") as f:
        return set(f.keys())


# --------------------------------------------------------------------------------------------- proposals
def _inputs(target: FrozenTarget, n: int = 12, B: int = 2, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, target.vocab_size, (B, n + 2), generator=g)


def _proposals(drafter, target: FrozenTarget, method: str) -> list[torch.Tensor]:
    ids = _inputs(target)
    n = ids.shape[1] - 2
    out = target(ids[:, : n + 1], layer_ids=drafter.layer_ids)
    if method == "eagle3":
        toks, logits = drafter.draft_greedy(out.hidden, ids, num_speculative_tokens=4, return_logits=True)
        return [toks, logits]
    h = out.hidden[drafter.layer_ids[0]]
    if method == "medusa":
        return [propose(drafter, h[:, -1], top_k=3), drafter(h)]
    return [propose_chain(drafter, ids[:, : n + 1], h[:, :n], num_speculative_tokens=3)]


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


ROUND_TRIP = [("eagle3", "eagle3_native"), ("eagle3", "eagle3_speculators"), ("medusa", "medusa_fasterdecoding"),
              ("medusa", "medusa_vllm"), ("mtp", "mtp_deepseek")]


@pytest.mark.parametrize("method,fmt", ROUND_TRIP)
def test_round_trip_gives_identical_proposals(ckpts, target, tmp_path, method, fmt):
    drafter, meta = load_drafter(ckpts[method], target)
    out = export(drafter, fmt, tmp_path / fmt, target, meta=meta)
    assert detect_format(out) == fmt and validate(out) == fmt and validate(out, fmt, target) == fmt
    back = load_export(out, target)
    assert type(back) is type(drafter)
    _same_state(drafter, back)
    for a, b in zip(_proposals(drafter, target, method), _proposals(back, target, method)):
        assert torch.equal(a, b)
    names = {p.name for p in out.iterdir()}
    assert {CONFIG, README, SIDECAR} <= names


def test_nextn_round_trip_on_deepseek_target(ds, tmp_path):
    target, ckpt = ds
    drafter, meta = load_drafter(ckpt, target)
    for fmt in ("mtp_deepseek", "mtp_sglang_nextn"):
        out = export(drafter, fmt, tmp_path / fmt, target, meta=meta)
        back = load_export(out, target)
        _same_state(drafter, back)
        assert torch.equal(_proposals(drafter, target, "mtp")[0], _proposals(back, target, "mtp")[0])
    keys = _keys(tmp_path / "mtp_sglang_nextn")
    # SGLang's export_deepseek_nextn.py layout: layer 0, per-expert names, no embedding/head copies
    assert {"model.layers.0.eh_proj.weight", "model.layers.0.shared_head.norm.weight",
            "model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"} <= keys
    assert not any("embed_tokens" in k or "shared_head.head" in k or "gate_up_proj" in k for k in keys)
    cfg = json.loads((tmp_path / "mtp_sglang_nextn" / CONFIG).read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLMNextN"] and cfg["num_hidden_layers"] == 1
    assert "--speculative-algorithm NEXTN" in (tmp_path / "mtp_sglang_nextn" / README).read_text()
    assert "model.layers.2.embed_tokens.weight" in _keys(tmp_path / "mtp_deepseek")  # vLLM deepseek_mtp layout


def test_expert_split_matches_transformers_checkpoint_layout(ds, ds_dir):
    """Our per-expert names and gate/up split are exactly what transformers itself writes for DeepSeek-V3."""
    target, _ = ds
    fused = {k: v for k, v in target.model.state_dict().items() if k.startswith("model.layers.1.mlp.experts.")}
    ours = unfuse_experts(fused, "deepseek_v3")
    saved = load_file(str(ds_dir / "model.safetensors"))
    assert len(ours) == 12
    for k, v in ours.items():
        assert torch.equal(v, saved[k]), k
    assert all(torch.equal(a, b) for a, b in zip(fuse_experts(ours).values(), fused.values()))


# --------------------------------------------------------------------------------------------- formats
def test_eagle3_layouts_and_layer_id_conventions(native, ckpts, target, tmp_path):
    cfg = json.loads((native / CONFIG).read_text())
    keys = _keys(native)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == 300 and cfg["draft_vocab_size"] == 200
    # vLLM: capture before layer i == our ids; SGLang: output of layer i == ours - 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert "embed_tokens.weight" not in keys and "midlayer.hidden_norm.weight" in keys
    with safe_open(str(native / WEIGHTS), framework="pt") as f:
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert list(f.get_slice("fc.weight").get_shape()) == [32, 96]

    drafter, meta = load_drafter(ckpts["eagle3"], target)
    spec = export(drafter, "eagle3-speculators", tmp_path / "spec", target, meta=meta, num_speculative_tokens=5)
    sc = json.loads((spec / CONFIG).read_text())
    assert sc["architectures"] == ["Eagle3Speculator"] and sc["speculators_model_type"] == "eagle3"
    assert sc["norm_before_residual"] is False  # explicit: vLLM's reader assumes true when absent
    assert sc["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert sc["speculators_config"]["proposal_methods"][0] == {
        "proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    # the target's id, not this machine's path to it (a tmp directory here: its name)
    assert sc["speculators_config"]["verifier"]["name_or_path"] == Path(target.model.config._name_or_path).name
    assert sc["transformer_layer_config"]["vocab_size"] == 300
    assert {k for k in _keys(spec) if k.startswith("layers.0.")} and not any("midlayer" in k for k in _keys(spec))
    readme = (spec / README).read_text()
    assert '"num_speculative_tokens": 5' in readme and '"draft_tensor_parallel_size": 1' in readme


@pytest.mark.parametrize("method,fmt", [("eagle3", "eagle3_native"), ("medusa", "medusa_vllm")])
def test_bfloat16_export_keeps_mapping_dtypes(ckpts, target, tmp_path, method, fmt):
    drafter, meta = load_drafter(ckpts[method], target)
    out = export(drafter, fmt, tmp_path / fmt, target, meta=meta, dtype=torch.bfloat16)
    assert json.loads((out / CONFIG).read_text())["torch_dtype"] == "bfloat16"
    back = load_export(out, target)
    _same_state(copy.deepcopy(drafter).to(torch.bfloat16), back)  # d2t/t2d stay int64/bool


def test_norm_before_residual_drafter_goes_to_speculators_only(ckpts, target, tmp_path):
    drafter, meta = load_drafter(ckpts["eagle3"], target)
    d = copy.deepcopy(drafter)
    d.cfg.norm_before_residual = d.midlayer.norm_before_residual = True
    with pytest.raises(ExportError, match="norm_before_residual=True cannot be expressed"):
        export(d, "eagle3_native", tmp_path / "native", target, meta=meta)
    assert not (tmp_path / "native").exists()  # refused before anything was written
    out = export(d, "eagle3_speculators", tmp_path / "spec", target, meta=meta)
    assert json.loads((out / CONFIG).read_text())["norm_before_residual"] is True
    back = load_export(out, target)
    assert back.midlayer.norm_before_residual
    for a, b in zip(_proposals(d, target, "eagle3"), _proposals(back, target, "eagle3")):
        assert torch.equal(a, b)


def test_medusa_layouts(ckpts, target, tmp_path):
    drafter, meta = load_drafter(ckpts["medusa"], target)
    fd = export(drafter, "medusa", tmp_path / "fd", target, meta=meta)
    assert (fd / MEDUSA_WEIGHTS).exists() and not (fd / WEIGHTS).exists()
    assert _keys(fd, MEDUSA_WEIGHTS) == {f"{h}.0.linear.{w}" for h in range(4) for w in ("weight", "bias")} | {
        f"{h}.1.weight" for h in range(4)}
    cfg = json.loads((fd / CONFIG).read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (4, 1)
    assert cfg["base_model_name_or_path"] == Path(target.model.config._name_or_path).name
    vl = export(drafter, "medusa-vllm", tmp_path / "vl", target, meta=meta)
    vc = json.loads((vl / CONFIG).read_text())
    assert vc["model_type"] == "medusa" and vc["architectures"] == ["MedusaModel"] and vc["medusa_fc_bias"] is True
    assert (vc["num_heads"], vc["num_hidden_layers"], vc["truncated_vocab_size"]) == (4, 1, 300)
    assert _keys(vl) == {f"blocks.{h}.layers.0.{w}" for h in range(4) for w in ("weight", "bias")} | {
        f"lm_heads.{h}.weight" for h in range(4)}
    with pytest.raises(ExportError, match="exceeds the drafter's 4 Medusa heads"):
        export(drafter, "medusa-vllm", tmp_path / "k", target, meta=meta, num_speculative_tokens=5)


def test_mtp_refusals_for_a_llama_block(ckpts, target, tmp_path):
    drafter, meta = load_drafter(ckpts["mtp"], target)
    with pytest.raises(ExportError, match="runs a DeepSeek-V3 block"):
        export(drafter, "mtp-nextn", tmp_path / "nextn", target, meta=meta)
    assert not (tmp_path / "nextn").exists()
    out = export(drafter, "mtp", tmp_path / "ds", target, meta=meta)
    assert "No engine serves this block as-is" in (out / README).read_text()
    assert json.loads((out / CONFIG).read_text())["num_nextn_predict_layers"] == 1


def test_export_refuses_layer_ids_engines_cannot_capture(target, tmp_path):
    d2t, t2d = build_draft_vocab(torch.arange(target.vocab_size), 50)
    d = Eagle3Drafter(Eagle3Config(layer_ids=[1, 2, 4], draft_vocab_size=50), target.model.config,
                      target.embed.weight.detach().clone(), d2t, t2d)  # id 4 = L: after the final norm
    with pytest.raises(ExportError, match=r"layer ids \[4\] cannot be served"):
        export(d, "eagle3", tmp_path / "x", target)
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------- the validator
def test_validator_rejects_missing_tensor(native, tmp_path):
    bad = _broken(native, tmp_path)
    _edit_weights(bad, lambda sd: sd.pop("norm.weight"))
    with pytest.raises(ExportError, match=r"missing 1 tensor\(s\), e.g. \['norm.weight'\]"):
        validate(bad)


def test_validator_rejects_extra_tensor(native, target, tmp_path):
    bad = _broken(native, tmp_path)
    _edit_weights(bad, lambda sd: sd.update({"embed_tokens.weight": torch.zeros(300, 32)}))
    with pytest.raises(ExportError, match=r"unexpected tensor\(s\), e.g. \['embed_tokens.weight'\]"):
        validate(bad, "eagle3_native", target)


def test_validator_rejects_wrong_shape_fc(native, tmp_path):
    bad = _broken(native, tmp_path)
    _edit_weights(bad, lambda sd: sd.update({"fc.weight": torch.zeros(32, 64)}))
    with pytest.raises(ExportError, match=r"fc.weight has shape \[32, 64\], expected \[32, 96\]"):
        validate(bad)


def test_validator_rejects_layer_ids_off_by_one(native, target, tmp_path):
    bad = _broken(native, tmp_path)

    def shift(cfg):  # both fields moved up by one: the last id names the 4-layer target's final output
        cfg["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]

    _edit_config(bad, shift)
    (bad / SIDECAR).unlink()  # the target's layer count then comes from config.json's draftsmith_target ...
    with pytest.raises(ExportError, match=r"\[4\] out of range for a 4-layer target .* off by one"):
        validate(bad)
    with pytest.raises(ExportError, match=r"\[4\] out of range for a 4-layer target .* off by one"):
        validate(bad, None, target)  # ... or from the target: the top id is one past the last capturable layer
    _edit_config(bad, lambda c: c.pop("draftsmith_target"))
    validate(bad)  # with neither, the ids are merely self-consistent
    bad2 = _broken(native, tmp_path / "b")
    _edit_config(bad2, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    _edit_config(bad2, lambda c: c.pop("draftsmith_target"))
    (bad2 / SIDECAR).unlink()  # no layer count known: the two fields must still agree with each other
    with pytest.raises(ExportError, match=r"must be the top-level ids \[1, 2, 3\] .* minus 1"):
        validate(bad2)  # SGLang's field written in vLLM's convention


def test_validator_rejects_misaligned_d2t(native, tmp_path):
    bad = _broken(native, tmp_path)

    def rebuilt(sd):  # d2t from another draft vocabulary (other data after fine-tuning), t2d left as it was
        other, _ = build_draft_vocab(torch.arange(300), 200)  # ids 100..299
        assert not torch.equal(other, sd["d2t"])
        sd["d2t"] = other

    _edit_weights(bad, rebuilt)
    with pytest.raises(ExportError, match="d2t/t2d rejected: .*misaligned"):
        validate(bad)
    bad2 = _broken(native, tmp_path / "b")
    _edit_weights(bad2, lambda sd: sd.update({"d2t": sd["d2t"].to(torch.int32)}))
    with pytest.raises(ExportError, match="d2t must be int64, got torch.int32"):
        validate(bad2)


def test_validator_rejects_export_for_another_target(native, target, tiny_tokenizer):
    from transformers import LlamaConfig

    wider = LlamaConfig(vocab_size=300, hidden_size=48, num_hidden_layers=4, num_attention_heads=4)
    with pytest.raises(ExportError, match="exported for another target: hidden_size 32 != the target's 48"):
        validate(native, None, wider)
    twin = FrozenTarget(make_tiny_llama(target.vocab_size, seed=1), tiny_tokenizer)  # same shape, other weights
    twin.model.config._name_or_path = target.model.config._name_or_path
    with pytest.raises(ExportError, match="exported for another target: embed_fingerprint"):
        validate(native, None, twin)
    renamed = {"num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 300, "_name_or_path": "org/other-model"}
    with pytest.raises(ExportError, match="exported for another target: verifier"):
        validate(native, None, renamed)


@pytest.mark.parametrize("fmt,edit,msg", [
    ("eagle3_speculators", lambda c: c.pop("norm_before_residual"), "must be written explicitly"),
    ("medusa_vllm", lambda c: c.update(medusa_fc_bias=False), "medusa_fc_bias must be true"),
    ("medusa_vllm", lambda c: c.update(num_attention_heads=4), "would overwrite num_heads"),
])
def test_validator_rejects_engine_traps(ckpts, target, tmp_path, fmt, edit, msg):
    method = export_format(fmt).method
    drafter, meta = load_drafter(ckpts[method], target)
    out = export(drafter, fmt, tmp_path / fmt, target, meta=meta)
    _edit_config(out, edit)
    with pytest.raises(ExportError, match=msg):
        validate(out)


def test_validator_rejects_mtp_layer_index_off_by_one(ckpts, target, tmp_path):
    drafter, meta = load_drafter(ckpts["mtp"], target)
    out = export(drafter, "mtp", tmp_path / "mtp", target, meta=meta)
    _edit_weights(out, lambda sd: sd.update({k.replace("layers.4.", "layers.5."): sd.pop(k) for k in list(sd)}))
    with pytest.raises(ExportError, match=r"sit at layers \[5\], expected model.layers.4..4 .* off by one"):
        validate(out)


def test_detect_format_refuses_non_exports(llama_dir, tmp_path):
    with pytest.raises(ExportError, match="matches no export format"):
        detect_format(llama_dir)
    with pytest.raises(ExportError, match="no config.json"):
        validate(tmp_path)


# --------------------------------------------------------------------------------------------- CLI
def test_cli_exports_checks_and_refuses(ckpts, llama_dir, target, tiny_tokenizer, tmp_path, capsys):
    res = tmp_path / "eval.json"
    res.write_text(json.dumps({"recommended_num_speculative_tokens": 4}))
    out = tmp_path / "e3"
    # target defaults to the one recorded in the checkpoint
    assert main([str(ckpts["eagle3"]), "--format", "eagle3", "--out", str(out), "--results", str(res)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("exported eagle3 checkpoint") and "num_speculative_tokens=4" in line
    assert "--speculative-num-steps 4" in (out / README).read_text()
    assert main(["--check", str(out), "--target", str(llama_dir)]) == 0
    assert "valid eagle3_native export" in capsys.readouterr().out

    assert main([str(ckpts["eagle3"]), "--format", "eagle3", "--out", str(out)]) == 2  # not empty, no --force
    assert "exists and is not empty" in capsys.readouterr().err

    _edit_weights(out, lambda sd: sd.pop("lm_head.weight"))
    assert main(["--check", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing 1 tensor(s)" in err and err.count("\n") == 1

    other = tmp_path / "other"
    make_tiny_llama(target.vocab_size, seed=1).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    assert main([str(ckpts["medusa"]), "--format", "medusa", "--out", str(tmp_path / "m"),
                 "--target", str(other)]) == 2
    assert "trained for another target" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["medusa_fasterdecoding", "medusa_vllm"])
def test_shared_lm_head_medusa_round_trip(target, tmp_path, fmt):
    """The CPU recipe's heads borrow the target's frozen lm_head; both formats must reproduce its proposals."""
    from models.methods.medusa.config import MedusaConfig
    from models.methods.medusa.net import MedusaHeads

    torch.manual_seed(0)
    lm = target.model.get_output_embeddings().weight.detach()
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=2, share_lm_head=True), target.model.config, lm)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out = export(heads.eval(), fmt, tmp_path / fmt, target, meta={"method": "medusa", "target": target.identity()})
    back = load_export(out, target)
    h = target(_inputs(target), layer_ids=heads.layer_ids).hidden[heads.layer_ids[0]]
    torch.testing.assert_close(back(h), heads(h), rtol=1e-5, atol=1e-5)
    assert torch.equal(propose(back, h[:, -1], top_k=3), propose(heads, h[:, -1], top_k=3))


def _engine_results(path: Path, engine: str, target_type: str | None, rows: dict, ar: float = 100.0) -> Path:
    """An engine benchmark's results.json as python -m eval.engines.bench writes it (the fields export reads)."""
    methods = {name: {"ok": True, "lossless": True, "method": m, "num_speculative_tokens": k,
                      "tokens_per_s": {"1": tps}, "speedup_vs_engine_ar": {"1": tps / ar}}
               for name, (m, k, tps) in rows.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"engine": engine, "target": "tiny-code", "target_type": target_type,
                                "methods": {"ar": {"ok": True, "method": "ar", "tokens_per_s": {"1": ar},
                                                   "speedup_vs_engine_ar": {"1": 1.0},
                                                   "num_speculative_tokens": None}, **methods}}))
    return path


def test_cli_carries_the_k_and_target_type_an_engine_measured_fastest(ckpts, tmp_path, capsys):
    """--results with engine benchmark files (one per target type): the export carries the K of the method's
    fastest served row across them, and its README says where, how fast, and whether it pays."""
    # q4_1's K=3 gains more over its AR (1.15x) but bf16's K=2 serves more tokens/s: that is the one to serve
    q4 = _engine_results(tmp_path / "q4_1/results.json", "llama-server", "source",
                         {"eagle3_k1": ("eagle3", 1, 104.0), "eagle3_k3": ("eagle3", 3, 107.0),
                          "ngram": ("ngram", 3, 130.0), "dflash": ("dflash", 7, 150.0)}, ar=93.0)
    bf16 = _engine_results(tmp_path / "bf16/results.json", "llama-server", "bf16",
                           {"eagle3_k1": ("eagle3", 1, 98.0), "eagle3_k2": ("eagle3", 2, 112.0)})
    out = tmp_path / "e3"
    assert main([str(ckpts["eagle3"]), "--format", "eagle3", "--out", str(out), "--results", str(q4),
                 "--results", str(bf16)]) == 0
    line = capsys.readouterr().out
    assert "num_speculative_tokens=2" in line
    assert "best measured: llama-server with the target as a bf16 GGUF at K=2" in line
    side = json.loads((out / "draftsmith.json").read_text())
    assert side["num_speculative_tokens"] == 2 and side["measured_best"]["row"] == "eagle3_k2"
    readme = (out / README).read_text()
    assert "--speculative-num-steps 2" in readme and "112.0 tokens/s, 1.12× the engine's own AR, faster than" in readme
    # nothing faster than AR: the K is still the best measured, and the README says to serve without it
    slow = _engine_results(tmp_path / "slow/results.json", "llama-server", "source",
                           {"eagle3_k1": ("eagle3", 1, 80.0), "eagle3_k4": ("eagle3", 4, 60.0)})
    assert main([str(ckpts["eagle3"]), "--format", "eagle3", "--out", str(out), "--force", "--results",
                 str(slow)]) == 0
    assert "K=1, 80.0 tokens/s, 0.80× the engine's own AR, slower than plain decoding there" in capsys.readouterr().out
    assert "slower than plain decoding there: serve the target alone" in (out / README).read_text()
    # eval's results and engine results are different questions; a file without the method's rows says so
    assert main([str(ckpts["eagle3"]), "--format", "eagle3", "--out", str(tmp_path / "x"), "--results", str(q4),
                 "--results", str(tmp_path / "eval.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "eval.json").write_text(json.dumps({"recommended_num_speculative_tokens": 4}))
    assert main([str(ckpts["eagle3"]), "--format", "eagle3", "--out", str(tmp_path / "x"), "--results", str(q4),
                 "--results", str(tmp_path / "eval.json")]) == 2
    assert "not an engine benchmark's results.json" in capsys.readouterr().err
    assert main([str(ckpts["medusa"]), "--format", "medusa", "--out", str(tmp_path / "m"), "--results",
                 str(q4)]) == 2
    assert "no served medusa row at batch 1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "m").exists()
