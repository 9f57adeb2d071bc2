"""llama.cpp (the vendored sources of llama-cpp-python 0.3.36) serves every GGUF export it can load losslessly at
T=0, with the acceptance draftsmith's harness measured (issue 22). One session fixture (served_llamacpp.py) trains,
exports (``--format gguf``) and serves everything once.

Tolerance of the acceptance comparison. The engine gets prompt + t0 (eval/llamacpp.py), so its rounds start where
the harness's do; both decode greedily in float32 with the same weights, so every round drafts and accepts the
same tokens, except in each request's last in-budget round: with one token left the harness drafts nothing, while
llama.cpp reads its draft cap 0 as "the default" and drafts K. So per prompt the engine may count one more draft
and one more accepted token at each position (never fewer): 0 <= engine - harness <= N over N prompts. A draft
served wrong (capture layers off by one: the control) changes the drafts in every round, far outside the band.
"""

from __future__ import annotations

import pytest

from tests.engines.served_llamacpp import TRAIN, llamacpp_results

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DRAFTS = list(TRAIN)


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> dict:
    return llamacpp_results(tmp_path_factory)


def _run(served: dict, name: str) -> dict:
    r = served["engine"][name]
    assert r["ok"], f"llama.cpp refused {name}: {r['error']}"
    return r


def test_prompts_are_aligned(served):
    """Enough held-out prompts tokenize, in llama.cpp, to exactly prompt + t0 (else the comparison has no data)."""
    assert served["n_prompts"] == 4, f"only {served['n_prompts']} of {served['n_candidates']} candidates aligned"


@pytest.mark.parametrize("name", ["ar", "ngram", *DRAFTS, "eagle3_shifted_control"])
def test_llamacpp_decodes_losslessly(served, name):
    """llama.cpp's text continues every prompt exactly as draftsmith's AR tokens (its AR gives exactly them)."""
    from eval.llamacpp import matches_harness
    from models.target import FrozenTarget

    tok = FrozenTarget.from_pretrained("tiny-code").tokenizer
    r = _run(served, name)
    bad = matches_harness(tok, served["prompts"], served["harness"]["ar"]["outputs"], r["texts"])
    assert not bad, f"{name}: prompts {bad} differ from draftsmith's AR"
    if name == "ar":  # the engine's AR is exactly the harness's N tokens, no more
        pairs = zip(served["prompts"], served["harness"]["ar"]["outputs"])
        full = [tok.decode([*p["input_ids"], *h]) for p, h in pairs]
        assert [p["text"] + t for p, t in zip(served["prompts"], r["texts"])] == full


def _outside_band(engine: dict, harness: dict, n: int) -> list[str]:
    bad = []
    if not 0 <= engine["num_drafts"] - harness["num_drafts"] <= n:
        bad.append(f"drafts {engine['num_drafts']} vs harness {harness['num_drafts']}")
    for j, (e, h) in enumerate(zip(engine["accepted_per_pos"], harness["accepted_per_pos"])):
        if not 0 <= e - h <= n:
            bad.append(f"position {j + 1}: accepted {e} vs harness {h}")
    return bad


@pytest.mark.parametrize("name", DRAFTS)
def test_llamacpp_acceptance_equals_the_harness(served, name):
    r, h = _run(served, name), served["harness"][name]
    assert len(r["counts"]["accepted_per_pos"]) == r["k"]
    assert not _outside_band(r["counts"], h, served["n_prompts"]), (
        f"{name}: llama.cpp {r['counts']} vs harness { {x: h[x] for x in ('num_drafts', 'accepted_per_pos')} }")
    assert h["num_accepted_tokens"] > 0  # a drafter that never accepts would make this test vacuous


def test_block_drafters_accept_past_the_first_slot(served):
    """The DFlash/DSpark checks have power only if their drafters accept at slot 2+ (a slot bug shows there)."""
    for name in ("dflash_full", "dspark_full"):
        assert served["harness"][name]["accepted_per_pos"][1] > 0, f"{name} too weak: {served['harness'][name]}"


def test_shifted_layer_ids_leave_the_band(served):
    """The check has power: the EAGLE-3 draft fed layers off by one stays lossless but accepts differently."""
    ctrl = _run(served, "eagle3_shifted_control")
    assert _outside_band(ctrl["counts"], served["harness"]["eagle3"], served["n_prompts"]), (
        f"capture ids + 1 gave the trained drafter's acceptance: {ctrl['counts']}")
