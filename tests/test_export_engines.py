"""Exports computed the engines' way: the embedding speculators needs, ascending aux-layer order, file modes,
the validator's target identity checks.

Tiny 4-layer Llama target saved to disk; EAGLE-3 drafters built in code with randomised weights (no training
needed: every check compares two computations of the same drafter).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab
from models.export.api import export, load_export
from models.export.shared.common import CONFIG, README, SIDECAR, WEIGHTS, ExportError
from models.export.validate import validate
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.net import Eagle3Drafter


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("llama")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return FrozenTarget.from_pretrained(str(d))


def make_drafter(target: FrozenTarget, layer_ids=(1, 2, 3), seed: int = 0, **flags) -> Eagle3Drafter:
    torch.manual_seed(seed)
    counts = torch.randint(0, 1000, (target.vocab_size,))
    d2t, t2d = build_draft_vocab(counts, 120)
    d = Eagle3Drafter(Eagle3Config(layer_ids=list(layer_ids), draft_vocab_size=120, **flags), target.model.config,
                      target.embed.weight.detach().clone(), d2t, t2d)
    with torch.no_grad():  # norms away from 1 and a non-trivial fc, so any permutation or drop shows
        for p in d.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    return d.eval()


def _keys(path: Path) -> set[str]:
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        return set(f.keys())


def _cfg(path: Path) -> dict:
    return json.loads((path / CONFIG).read_text())


def _hidden(target: FrozenTarget, ids, n: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(3, target.vocab_size, (1, n + 2), generator=g)
    out = target(toks[:, : n + 1], layer_ids=sorted(ids))
    return toks, out.hidden


# --------------------------------------------------------------------------------------------- 1. embedding
def test_speculators_export_writes_the_targets_embedding_native_does_not(target, tmp_path):
    d = make_drafter(target)
    spec = export(d, "eagle3_speculators", tmp_path / "spec", target)
    nat = export(d, "eagle3_native", tmp_path / "nat", target)
    assert "embed_tokens.weight" in _keys(spec) and "embed_tokens.weight" not in _keys(nat)
    with safe_open(str(spec / WEIGHTS), framework="pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), target.embed.weight.detach())
    # a speculators export without it is refused: speculators would run the draft on its init embedding
    bad = tmp_path / "bad"
    shutil.copytree(spec, bad)
    sd = load_file(str(bad / WEIGHTS))
    sd.pop("embed_tokens.weight")
    save_file(sd, str(bad / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"missing 1 tensor\(s\), e.g. \['embed_tokens.weight'\]"):
        validate(bad)
    sd = load_file(str(spec / WEIGHTS))
    sd["embed_tokens.weight"] = sd["embed_tokens.weight"].flip(0)
    save_file(sd, str(bad / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="embed_tokens.weight is not this target's embedding"):
        validate(bad, None, target)


# --------------------------------------------------------------------------------------------- 2. id order
def _engine_fused(path: Path, hidden: dict) -> torch.Tensor:
    """What vLLM/SGLang compute for g: fc over the captured states concatenated in ASCENDING layer order."""
    ids = _cfg(path)["eagle_aux_hidden_state_layer_ids"]
    fc = load_file(str(path / WEIGHTS))["fc.weight"]
    return torch.cat([hidden[k] for k in sorted(ids)], dim=-1) @ fc.T


@pytest.mark.parametrize("fmt", ["eagle3_native", "eagle3_speculators"])
def test_out_of_order_layer_ids_export_sorted_with_fc_permuted(target, tmp_path, fmt):
    toks, hidden = _hidden(target, (1, 2, 3))
    base = make_drafter(target, (1, 2, 3))
    shuffled = make_drafter(target, (3, 1, 2))
    with torch.no_grad():  # the same drafter with its fc blocks listed in the order 3, 1, 2
        w = base.fc.weight.chunk(3, dim=1)
        shuffled.load_state_dict({**base.state_dict(), "fc.weight": torch.cat([w[2], w[0], w[1]], dim=1)})
    torch.testing.assert_close(shuffled.fuse(hidden), base.fuse(hidden), rtol=0, atol=1e-6)
    outs = {}
    for name, d in (("sorted", base), ("shuffled", shuffled)):
        out = export(d, fmt, tmp_path / name, target)
        assert _cfg(out)["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        # engine order: the fused state the engines compute equals the drafter's own
        torch.testing.assert_close(_engine_fused(out, hidden), d.fuse(hidden), rtol=1e-5, atol=1e-5)
        back = load_export(out, target)
        assert back.layer_ids == [1, 2, 3]
        outs[name] = back.draft_greedy(hidden, toks, num_speculative_tokens=3, return_logits=True)[1]
        torch.testing.assert_close(outs[name],
                                   d.draft_greedy(hidden, toks, num_speculative_tokens=3, return_logits=True)[1],
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["sorted"], outs["shuffled"], rtol=1e-5, atol=1e-5)
    side = json.loads((tmp_path / "shuffled" / SIDECAR).read_text())
    assert side["trained_layer_ids"] == [3, 1, 2] and side["layer_ids"] == [1, 2, 3]


def test_validator_refuses_unsorted_layer_ids(target, tmp_path):
    out = export(make_drafter(target), "eagle3_native", tmp_path / "e3", target)
    cfg = _cfg(out)
    cfg["eagle_aux_hidden_state_layer_ids"] = [3, 1, 2]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 0, 1]
    (out / CONFIG).write_text(json.dumps(cfg))
    (out / SIDECAR).unlink()
    with pytest.raises(ExportError, match=r"\[3, 1, 2\] are not ascending: both engines fuse"):
        validate(out)


# --------------------------------------------------------------------------------------------- 3. file modes
@pytest.mark.parametrize("fmt", ["eagle3_native", "eagle3_speculators"])
def test_exported_files_are_world_readable(target, tmp_path, fmt):
    old = os.umask(0o077)  # even a strict umask: a server running as another user must read the export
    try:
        out = export(make_drafter(target), fmt, tmp_path / fmt, target)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == {n: 0o644 for n in modes} and WEIGHTS in modes
    assert out.stat().st_mode & 0o755 == 0o755


# --------------------------------------------------------------------------------------------- 4. identity
def _medusa(target: FrozenTarget):
    from models.methods.medusa.config import MedusaConfig
    from models.methods.medusa.net import MedusaHeads

    lm = target.model.get_output_embeddings().weight.detach()
    return MedusaHeads(MedusaConfig(num_heads=2, num_layers=1), target.model.config, lm).eval()


@pytest.fixture(scope="module")
def twin(target, tiny_tokenizer):
    """Same shape and name as ``target``, other weights: only the embedding tells them apart."""
    from tests.conftest import make_tiny_llama

    t = FrozenTarget(make_tiny_llama(target.vocab_size, seed=1), tiny_tokenizer)
    t.model.config._name_or_path = target.model.config._name_or_path
    return t


@pytest.mark.parametrize("fmt", ["eagle3_native", "medusa_vllm"])
def test_validator_identifies_the_target_without_the_sidecar(target, twin, tiny_tokenizer, tmp_path, fmt):
    from tests.conftest import make_tiny_llama

    d = make_drafter(target) if fmt.startswith("eagle3") else _medusa(target)
    out = export(d, fmt, tmp_path / fmt, target)
    (out / SIDECAR).unlink()  # copied to a hub/server: only config.json + weights travel
    stamp = _cfg(out)["draftsmith_target"]
    assert stamp["num_hidden_layers"] == 4 and stamp["architectures"] == ["LlamaForCausalLM"]
    assert stamp["embed_fingerprint"] == target.fingerprint() and stamp["vocab_size"] == 300
    assert validate(out, None, target) == fmt
    with pytest.raises(ExportError, match="exported for another target: embed_fingerprint .* draftsmith_target"):
        validate(out, None, twin)
    deeper = FrozenTarget(make_tiny_llama(target.vocab_size, layers=6), tiny_tokenizer)
    with pytest.raises(ExportError, match="exported for another target: num_hidden_layers 4 != the target's 6"):
        validate(out, None, deeper)


def _swap_weights(out: Path, **tensors) -> None:
    sd = load_file(str(out / WEIGHTS))
    sd.update(tensors)
    save_file(sd, str(out / WEIGHTS), metadata={"format": "pt"})


def test_validator_refuses_a_self_consistent_mapping_for_another_vocabulary(target, tmp_path):
    out = export(make_drafter(target), "eagle3_native", tmp_path / "e3", target)
    d2t, t2d = build_draft_vocab(torch.arange(target.vocab_size), 120)  # consistent pair, other token set
    _swap_weights(out, d2t=d2t, t2d=t2d)
    with pytest.raises(ExportError, match="d2t/t2d are not the draft vocabulary lm_head.weight was exported"):
        validate(out)


def test_validator_refuses_a_mapping_sized_for_another_vocabulary(target, tmp_path):
    out = export(make_drafter(target), "eagle3_native", tmp_path / "e3", target)
    bigger = {"num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 320}
    with pytest.raises(ExportError, match="built for a vocabulary of 300 tokens, the target has 320"):
        validate(out, None, bigger)


def test_export_refuses_draft_ids_beyond_the_targets_tokenizer(tiny_tokenizer, tmp_path):
    from tests.conftest import make_tiny_llama

    padded = FrozenTarget(make_tiny_llama(320), tiny_tokenizer)  # embedding padded past the 300 real tokens
    d2t, t2d = build_draft_vocab(torch.arange(320), 60)  # the 60 most "frequent": ids 260..319
    d = Eagle3Drafter(Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=60), padded.model.config,
                      padded.embed.weight.detach().clone(), d2t, t2d)
    with pytest.raises(ExportError, match="d2t maps to target id 319, beyond the target tokenizer's 300 tokens"):
        export(d, "eagle3_native", tmp_path / "x", padded)
    assert not (tmp_path / "x").exists()


def _shift_ids(out: Path, by: int, stamp_too: bool = False) -> None:
    cfg = _cfg(out)
    cfg["eagle_aux_hidden_state_layer_ids"] = [i + by for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    sg = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + by for i in sg]
    if stamp_too:
        cfg["draftsmith_target"]["layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    (out / CONFIG).write_text(json.dumps(cfg))
    side = json.loads((out / SIDECAR).read_text())
    side["layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    (out / SIDECAR).write_text(json.dumps(side))


def test_validator_refuses_ids_below_the_range_in_sglangs_convention(target, tmp_path):
    out = export(make_drafter(target), "eagle3_native", tmp_path / "e3", target)
    _shift_ids(out, -1, stamp_too=True)  # vLLM [0, 1, 2] / SGLang [-1, 0, 1], every file agreeing
    (out / SIDECAR).unlink()
    with pytest.raises(ExportError, match=r"\[0, 1, 2\]: \[0\] out of range for a 4-layer target"):
        validate(out)


def test_validator_refuses_consistently_shifted_ids(tiny_tokenizer, tmp_path):
    from tests.conftest import make_tiny_llama

    deep = FrozenTarget(make_tiny_llama(len(tiny_tokenizer), layers=6), tiny_tokenizer)
    out = export(make_drafter(deep), "eagle3_native", tmp_path / "e3", deep)
    _shift_ids(out, +1)  # [2, 3, 4] / [1, 2, 3] and draftsmith.json: in range, mutually consistent
    with pytest.raises(ExportError, match=r"\[2, 3, 4\] differ from the ids fc.weight was exported with"):
        validate(out, None, deep)


# --------------------------------------------------------------------------------------------- 5. engine versions
def _all_exports(target: FrozenTarget, root: Path) -> dict[str, Path]:
    from models.methods.mtp.config import MTPConfig
    from models.methods.mtp.net import MTPDrafter

    out = {f: export(make_drafter(target), f, root / f, target) for f in ("eagle3_native", "eagle3_speculators")}
    for f in ("medusa_fasterdecoding", "medusa_vllm"):
        out[f] = export(_medusa(target), f, root / f, target)
    out["mtp_deepseek"] = export(MTPDrafter.from_target(MTPConfig(), target).eval(), "mtp", root / "mtp", target)
    return out


def test_readmes_name_engine_versions_and_offer_no_removed_method(target, tmp_path):
    for fmt, out in _all_exports(target, tmp_path).items():
        text = (out / README).read_text()
        heads = [ln for ln in text.splitlines() if ln.startswith("## ") and ("vLLM" in ln or "SGLang" in ln)]
        for h in heads:
            assert "checked against" in h or "0.32 and older" in h, (fmt, h)
        if '"method": "medusa"' in text:  # only under the vLLM <= 0.32 heading, with the pin
            assert fmt == "medusa_vllm" and "vLLM 0.33.0 removed Medusa" in text and "vllm<=0.32.0" in text
            assert text.index("## vLLM 0.32 and older only") < text.index('"method": "medusa"')
            assert "## vLLM (checked" not in text
    fd = (tmp_path / "medusa_fasterdecoding" / README).read_text()
    assert "medusa-vllm` is for vLLM <= 0.32" in fd
    nat = (tmp_path / "eagle3_native" / README).read_text()
    assert "SGLang 0.5.23 adds 1 to every SGLang id" in nat and "SGLang (checked against SGLang 0.5.23)" in nat


def test_sglang_plus_one_rule_per_family():
    from models.export.shared.identity import sglang_reads

    assert sglang_reads([0, 1, 2], "llama") == [1, 2, 3]  # llama.py: always +1
    assert sglang_reads([1, 3, 5], "deepseek_v3") == [2, 4, 6]  # first id 1: +1 (the default layers)
    assert sglang_reads([0, 1, 2], "deepseek_v3") == [0, 1, 2]  # otherwise taken as they are
    assert sglang_reads([0, 1, 2], "glm4_moe") == [0, 1, 2]


def test_validator_warns_when_sglang_would_read_the_ids_differently(tiny_tokenizer, tmp_path):
    import warnings

    from models.export.readme import render_readme
    from tests.conftest import make_tiny_llama

    deep = FrozenTarget(make_tiny_llama(len(tiny_tokenizer), layers=6), tiny_tokenizer)
    for ids, warns in (((1, 2, 3), True), ((2, 3, 4), False)):
        out = export(make_drafter(deep, ids), "eagle3_native", tmp_path / str(ids[0]), deep)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            validate(out)  # a Llama target: SGLang's +1 always applies, nothing to warn about
        cfg = _cfg(out)
        cfg["draftsmith_target"]["model_type"] = "deepseek_v3"  # the same ids for a DeepSeek-V3 target
        (out / CONFIG).write_text(json.dumps(cfg))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            validate(out)
        msgs = [str(x.message) for x in w if "SGLang 0.5.23" in str(x.message)]
        assert bool(msgs) == warns
        if warns:
            assert "would capture layers [0, 1, 2] instead of [1, 2, 3]" in msgs[0] and "\n" not in msgs[0]
        side = json.loads((out / SIDECAR).read_text())
        text = render_readme("eagle3_native", cfg, side)
        assert ("SGLang would capture [0, 1, 2] instead of [1, 2, 3]" in text) == warns


# --------------------------------------------------------------------------------------------- 7. MTP depth input
@pytest.mark.parametrize("between", ["post_norm", "pre_norm"])
def test_mtp_export_records_the_hidden_state_depth_two_was_trained_on(target, tmp_path, between):
    from models.methods.mtp.config import MTPConfig
    from models.methods.mtp.net import MTPDrafter

    d = MTPDrafter.from_target(MTPConfig(num_modules=2, hidden_between_depths=between), target).eval()
    out = export(d, "mtp", tmp_path / "mtp", target)
    assert _cfg(out)["draftsmith_target"]["mtp_hidden_between_depths"] == between
    text = (out / README).read_text()
    assert f"trained on the `{between}` hidden state" in text
    assert ("served acceptance at depth >= 2 differs" in text) == (between == "pre_norm")
    assert MTPConfig().hidden_between_depths == "post_norm"  # the default is what vLLM/SGLang feed


# --------------------------------------------------------------------------------------------- portable names
def _engine_names(out: Path) -> list[str]:
    cfg = _cfg(out)
    names = [(cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path"),
             cfg.get("base_model_name_or_path")]
    return [n for n in names if n]


def test_exports_name_the_target_not_this_machines_path_to_it(target, tmp_path):
    """verifier.name_or_path and the README's `vllm serve` line travel with the export: a training machine's
    absolute path there is wrong on any server."""
    here = str(Path(target.model.config._name_or_path).resolve())
    out = export(make_drafter(target), "eagle3_speculators", tmp_path / "e3s", target)
    assert _engine_names(out) == [Path(here).name]
    readme = (out / README).read_text()
    assert here not in readme and f"vllm serve {Path(here).name}" in readme
    assert here not in (out / CONFIG).read_text()
    # the user sets another name; the validator still identifies the target (by its embedding)
    out2 = export(make_drafter(target), "eagle3_speculators", tmp_path / "e3s2", target,
                     serve_name="org/my-target")
    assert _engine_names(out2) == ["org/my-target"] and "vllm serve org/my-target" in (out2 / README).read_text()
    assert validate(out2, None, target) == "eagle3_speculators"
    # an old export with an absolute path still loads, with a warning naming the fix
    bad = tmp_path / "old"
    shutil.copytree(out, bad)
    cfg = _cfg(bad)
    cfg["speculators_config"]["verifier"]["name_or_path"] = here
    (bad / CONFIG).write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="path on the machine that exported it"):
        validate(bad, None, target)


def test_engine_target_name_spellings():
    from models.core.target import EMBEDDED_DIR
    from models.export.shared.common import engine_target_name

    assert engine_target_name("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert engine_target_name("tiny-code") == engine_target_name(str(EMBEDDED_DIR)) == "models/tiny_code"
    snap = "/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/abc123"
    assert engine_target_name(snap) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert engine_target_name("/data/ckpts/my-llama") == "my-llama"
