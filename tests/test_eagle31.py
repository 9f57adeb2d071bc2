"""EAGLE-3.1 options (speculators' norm_before_fc, fc_norm, norm_output): defaults are EAGLE-3, each one is
honoured the same way by training (TTT), the no-cache proposal, the KV-cached proposer and the exports."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from models.core.proposal import Sampling
from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab
from models.export.api import export, load_export
from models.export.shared.common import CONFIG, ExportError
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.net import Eagle3Drafter
from models.methods.eagle3.proposers import Eagle3ChainProposer

FLAGS = [{}, {"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
         {"fc_norm": True, "norm_output": True, "norm_before_residual": True}]


def _drafter(tc: LlamaConfig, layer_ids=(0, 1, 2), seed: int = 1, **flags) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d2t, t2d = build_draft_vocab(torch.arange(tc.vocab_size), 12)
    d = Eagle3Drafter(Eagle3Config(layer_ids=list(layer_ids), draft_vocab_size=12, ttt_steps=4, **flags), tc,
                      3 * torch.randn(tc.vocab_size, tc.hidden_size), d2t, t2d)
    with torch.no_grad():  # norm weights away from 1, so a norm applied or dropped in the wrong place shows
        for n, p in d.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return d.eval()


@pytest.fixture(scope="module")
def tc():
    return LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)


def _hidden(T: int, ids=(0, 1, 2), seed: int = 0, B: int = 2) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: 2 * torch.randn(B, T, 16, generator=g) + 1 for k in ids}


def test_defaults_are_eagle3_and_names_follow_speculators(tc):
    c = Eagle3Config()
    assert (c.norm_before_fc, c.fc_norm, c.norm_output, c.norm_before_residual) == (False,) * 4
    assert not any("input_norm" in k or "fc_norm" in k for k in _drafter(tc).state_dict())
    assert _drafter(tc, norm_before_fc=True).state_dict()["input_norm.weight"].shape == (48,)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(_drafter(tc, fc_norm=True).state_dict())
    with pytest.raises(ValueError, match="mutually exclusive"):
        _drafter(tc, norm_before_fc=True, fc_norm=True)


def test_fc_norms_by_hand(tc):
    h = _hidden(3)
    cat = torch.cat([h[k] for k in (0, 1, 2)], -1)
    d = _drafter(tc, norm_before_fc=True)
    with torch.no_grad():
        w = d.input_norm.weight
        ref = d.fc(w * cat * torch.rsqrt(cat.pow(2).mean(-1, keepdim=True) + d.rms_norm_eps))
        torch.testing.assert_close(d.fuse(h), ref, atol=1e-5, rtol=1e-5)
        d = _drafter(tc, fc_norm=True)
        parts = [n.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d.rms_norm_eps)
                 for n, x in zip(d.fc_norm, (h[0], h[1], h[2]))]
        torch.testing.assert_close(d.fuse(h), d.fc(torch.cat(parts, -1)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags", FLAGS[1:], ids=lambda f: "+".join(f))
def test_each_flag_changes_the_draft(tc, flags):
    n, k = 5, 3
    prefix = torch.randint(0, 16, (2, n + 2), generator=torch.Generator().manual_seed(5))
    h = _hidden(n + 1)
    _, base = _drafter(tc).draft_greedy(h, prefix, k, return_logits=True)
    _, got = _drafter(tc, **flags).draft_greedy(h, prefix, k, return_logits=True)
    step = 1 if flags == {"norm_output": True} else 0  # norm_output first shows in what step 1 reads
    assert (got[:, step] - base[:, step]).abs().max() > 1e-3


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f) or "eagle3")
def test_training_and_both_proposers_compute_the_same_chain(tc, flags):
    """TTT step s at position n == the s-th greedy draft (no cache) == the KV-cached chain proposer."""
    d = _drafter(tc, **flags)
    n, k = 5, 4
    prefix = torch.randint(0, 16, (2, n + 2), generator=torch.Generator().manual_seed(5))
    hidden = _hidden(n + 1 + k)
    ph = {key: v[:, : n + 1] for key, v in hidden.items()}
    drafts, chain = d.draft_greedy(ph, prefix, k, return_logits=True)
    with torch.no_grad():
        steps = d.ttt_forward(torch.cat([prefix, drafts[:, : k - 1]], dim=1), hidden)
    for s in range(k):
        torch.testing.assert_close(steps[s][:, n], chain[:, s], atol=1e-5, rtol=1e-5)
    prop = Eagle3ChainProposer(d, num_speculative_tokens=k)
    prop.begin(prefix[:1], {key: v[:1] for key, v in ph.items()}, Sampling())
    assert torch.equal(prop.propose(k).tokens, drafts[0])


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("llama31")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return FrozenTarget.from_pretrained(str(d))


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f) or "eagle3")
def test_exports_write_every_flag_and_round_trip(target, tmp_path, flags):
    tc = target.model.config
    d2t, t2d = build_draft_vocab(torch.arange(tc.vocab_size), 100)
    torch.manual_seed(0)
    d = Eagle3Drafter(Eagle3Config(layer_ids=[3, 1, 2], draft_vocab_size=100, **flags), tc,
                      target.embed.weight.detach().clone(), d2t, t2d).eval()
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    out = export(d, "eagle3_speculators", tmp_path / "spec", target)
    cfg = json.loads((out / CONFIG).read_text())
    for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert cfg[f] is bool(flags.get(f, False)), f
    back = load_export(out, target)
    toks = torch.randint(3, tc.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    hid = target(toks[:, :9], layer_ids=[1, 2, 3]).hidden
    torch.testing.assert_close(back.draft_greedy(hid, toks, 3, return_logits=True)[1],
                               d.draft_greedy(hid, toks, 3, return_logits=True)[1], atol=1e-5, rtol=1e-5)
    if any(flags.get(f) for f in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")):
        with pytest.raises(ExportError, match="cannot be expressed in the native EAGLE-3 format"):
            export(d, "eagle3_native", tmp_path / "nat", target)
    else:
        nat = json.loads((export(d, "eagle3_native", tmp_path / "nat", target) / CONFIG).read_text())
        assert all(nat[f] is False for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
