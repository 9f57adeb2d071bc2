"""The speculators package's own code runs our eagle3-speculators export and drafts what draftsmith drafts.

speculators 0.9.0 (vllm-project/speculators; pinned in the Makefile's install, --no-deps) is the reference
implementation of the speculators format that vLLM serves. Its Eagle3DraftModel is loaded from the export with its
own ``from_pretrained`` (which also reads the verifier's config and lm_head from the target directory) and run with
its own training-time-test forward; every TTT step's draft logits must equal draftsmith's ``ttt_forward`` at every
position whose inputs exist in both (speculators pads the shifted tokens with id 0, we with a zero embedding).
Layer ids are deliberately out of order ([3, 1, 2]): speculators, like the engines, fuses the states in ascending
order, so this also checks the fc column-block permutation of the export.
"""

from __future__ import annotations

import pytest
import torch

from models.core.target import FrozenTarget
from models.export.api import export, load_export
from tests.test_export_engines import make_drafter

speculators = pytest.importorskip(
    "speculators", reason="speculators==0.9.0 not installed (make install adds it with --no-deps; see Makefile)")


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("verifier")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return FrozenTarget.from_pretrained(str(d))


def _speculators_model(path, attn: str):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(path))
    # speculators defaults to flex attention (a compiled kernel); eager and sdpa are its CPU paths
    cfg.transformer_layer_config._attn_implementation = attn
    return Eagle3DraftModel.from_pretrained(str(path), config=cfg).eval()


def _speculators_logits(model, hidden_cat: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=hidden_cat, input_ids=input_ids,
                  document_ids=torch.zeros_like(input_ids), ttt_steps=steps)
    finally:
        hook.remove()
    return seen


CASES = [({"norm_before_residual": False}, "eager"), ({"norm_before_residual": True}, "eager"),
         ({"norm_before_residual": False}, "sdpa"), ({"norm_before_residual": True}, "sdpa"),
         ({"norm_before_fc": True}, "eager"), ({"fc_norm": True, "norm_output": True}, "eager")]


@pytest.mark.parametrize("flags,attn", CASES, ids=lambda x: x if isinstance(x, str) else "+".join(
    f"{k}={v}" for k, v in x.items()))
def test_speculators_drafts_the_same_logits(target, tmp_path, flags, attn):
    d = make_drafter(target, (3, 1, 2), **flags)
    # speculators' from_pretrained loads the verifier from verifier.name_or_path: the user sets where it lives
    # (by default the export names the target's id, not this machine's path to it)
    out = export(d, "eagle3_speculators", tmp_path / "spec", target,
                    serve_name=target.model.config._name_or_path)
    model = _speculators_model(out, attn)
    for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(model.config, f) is bool(flags.get(f, False)), f  # read from our config.json, not defaulted
    assert torch.equal(model.embed_tokens.weight, target.embed.weight)  # from the file (else NaN-initialised)
    T, K = 12, 3
    toks = torch.randint(3, target.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(0))
    hidden = target(toks[:, :T], layer_ids=[1, 2, 3]).hidden
    engine_cat = torch.cat([hidden[k] for k in (1, 2, 3)], dim=-1)  # ascending ids, as vLLM/speculators fuse
    # speculators' step 0 at position i reads (token input_ids[i], state i): our t_{i+1}
    theirs = _speculators_logits(model, engine_cat, toks[:, 1:], K)
    ours = d.ttt_forward(toks[:, :T], hidden, steps=K)
    assert len(theirs) == K
    for k in range(K):
        n = T - 1 - k  # positions whose step-k token t_{i+1+k} exists
        torch.testing.assert_close(theirs[k][0, :n], ours[k][0, :n].detach(), rtol=0, atol=2e-5)


def test_speculators_loads_our_dspark_and_peagle_exports(target, tmp_path):
    """speculators 0.9.0's own DSparkDraftModel / PEagleDraftModel ``from_pretrained`` read our dspark and peagle
    exports with every tensor in place (no key left initialised): the Markov W1 over target ids and W2 over the
    draft vocabulary, the confidence head, P-EAGLE's mask_hidden, trained embedding and second layer."""
    from speculators.models.dspark import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.models.peagle.core import PEagleDraftModel

    from models.methods.dflash.config import DFlashConfig
    from models.methods.dflash.net import DFlashDrafter
    from models.methods.peagle.config import PEagleConfig
    from models.methods.peagle.net import PEagleDrafter
    from tests.test_dflash import scramble

    V, head = target.vocab_size, target.model.get_output_embeddings().weight
    d = scramble(DFlashDrafter(DFlashConfig(layer_ids=[1, 2, 3], block_size=4, mask_token_id=V - 1, markov_rank=8,
                                            num_layers=2,
                                            block_head="markov", sample_from_anchor=True, draft_vocab_size=100),
                               target.model.config, target.embed.weight, head))
    p = scramble(PEagleDrafter(PEagleConfig(layer_ids=[1, 2, 3], num_depths=3, mask_token_id=V - 1, num_layers=2),
                               target.model.config, target.embed.weight, head))
    for drafter, fmt, cfg_cls, model_cls in ((d, "dspark_speculators", DSparkSpeculatorConfig, DSparkDraftModel),
                                            (p, "peagle_speculators", PEagleSpeculatorConfig, PEagleDraftModel)):
        # speculators loads the verifier from verifier.name_or_path: the user sets where it lives (serve_name)
        out = export(drafter, fmt, tmp_path / fmt, target, serve_name=target.model.config._name_or_path)
        cfg = cfg_cls.from_pretrained(str(out))
        cfg.transformer_layer_config._attn_implementation = "sdpa"
        model = model_cls.from_pretrained(str(out), config=cfg)
        theirs = model.state_dict()
        from safetensors.torch import load_file

        file = load_file(str(out / "model.safetensors"))
        assert set(file) <= set(theirs), (fmt, sorted(set(file) - set(theirs)))  # no tensor of ours is dropped
        own = {k for k in theirs if not k.startswith("verifier_")}  # their verifier copies come from the target
        assert own <= set(file) | {"d2t", "t2d"}, (fmt, sorted(own - set(file)))  # none of theirs left at init
        for k, v in file.items():
            assert torch.equal(theirs[k].to(v.dtype), v), (fmt, k)
        ours = load_export(out, target)
        if fmt == "dspark_speculators":
            assert cfg.sample_from_anchor is True and cfg.markov_rank == 8 and cfg.enable_confidence_head
            pairs = {"markov_head.markov_w1.weight": d.block_head.markov_head.markov_w1.weight,
                     "markov_head.markov_w2.weight": d.block_head.markov_head.markov_w2.weight,
                     "confidence_head.proj.weight": d.block_head.confidence_head.proj.weight,
                     "fc.weight": d.fc.weight, "layers.1.mlp.down_proj.weight": d.layers[1].mlp["down_proj"].weight}
        else:
            assert cfg.mask_token_id == V - 1 and cfg.norm_before_residual is False
            pairs = {"mask_hidden": p.mask_hidden, "embed_tokens.weight": p.embed_tokens.weight,
                     "layers.1.self_attn.q_proj.weight": p.layers[1].self_attn["q_proj"].weight,
                     "layers.0.self_attn.q_proj.weight": p.layers[0].self_attn["q_proj"].weight}
        for k, v in pairs.items():
            torch.testing.assert_close(theirs[k].float(), v.detach().float(), rtol=0, atol=0, msg=f"{fmt} {k}")
        assert ours is not None
