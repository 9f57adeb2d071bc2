"""The llama.cpp tier's one expensive step (test_llamacpp.py's session fixture): tiny-code drafters exported with
``--format gguf`` and served by llama.cpp's own tools (eval/engines/llamacpp.py), next to draftsmith's harness.

1. the drafters (tests/engines/drafters.py, trained once for both tiers): the EAGLE-3, a DFlash and a DSpark with
   the whole vocabulary (llama.cpp's converters have no draft vocabulary: both widen the vLLM tier's DFlash), and
   the vLLM tier's reduced-vocabulary DSpark;
2. convert tiny-code with the same converter, export every drafter with ``python -m train.export --format gguf``
   (the CLI users run; its serving manifest checked for the mode these runs use), the EAGLE-3 drafter also in the
   eagle3-speculators layout, plus two controls: the EAGLE-3 export with its capture layer ids shifted by one (the
   field's most reported silent bug), and the DSpark drafter in the speculators layout, which llama.cpp serves
   with a wrong head on this untied target (its converter drops a full-vocabulary draft's lm_head but keeps its
   embedding, and the loader then ties the two);
3. llama.cpp: AR (llama-completion), n-gram (``ngram-simple``) and each draft (llama-speculative-simple) at T=0 on
   the same aligned prompts (prompt + t0, see eval/engines/llamacpp.py), and AR, n-gram and one drafter of each
   spec type again through ``llama-server`` (eval/engines/llamacpp_server.py), the way users serve;
4. the harness on the same prompts at the same K.

Without the built tools the tier is skipped (one reason) unless ``DRAFTSMITH_REQUIRE_ENGINES=1``: then it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eval.engines import llamacpp as L
from eval.engines import llamacpp_server as LS
from eval.engines import serving as E
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS
from models.export import llamacpp as G
from tests.engines import drafters as D
from tests.engines.served import _root, _runs_dir, build_once, require_engine

K = DEFAULT_NUM_SPECULATIVE_TOKENS
N_PROMPTS, PROMPT_TOKENS, MAX_NEW, CANDIDATES = 4, 64, 48, 16
# served through --format gguf (the results' names); plus the eagle3-speculators layout of the EAGLE-3 drafter
SERVED = ["eagle3", "dflash_full", "dspark_full", "dspark"]
LAYOUTS = {"eagle3_speculators": "eagle3"}
SPEC_TYPES = {"eagle3": "draft-eagle3", "dflash_full": "draft-dflash", "dspark_full": "draft-dspark"}
SERVER_RUNS = ["ar", "ngram", *SPEC_TYPES]
# llama-server only: EAGLE-3 behind the engine's prompt lookup (--spec-type ngram-simple,draft-eagle3)
SERVER_ONLY = ["eagle3_lookup"]


def export_gguf(ckpt: Path, out: Path, k: int | None = None) -> Path:
    """``python -m train.export CKPT --format gguf`` as a user runs it, with the draft in f32: the tier asserts the
    engine's per-position acceptance equals the harness's, which holds for the drafter at the harness's precision
    (a q8_0 draft, the default, drafts the same tokens only up to its rounding; the bench test serves one)."""
    cmd = [sys.executable, "-m", "train.export", str(ckpt), "--format", "gguf", "--out", str(out), "--target",
           "tiny-code", "--force", "--gguf-type", "f32"]
    proc = subprocess.run(cmd, cwd=E.REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"--format gguf failed for {ckpt}: {proc.stderr[-2000:]}")
    return out


def shifted_control(src: Path, out: Path) -> Path:
    """The EAGLE-3 layout with every capture id + 1 (hf/config.json), converted again: llama.cpp then feeds the
    drafter other layers than it was trained on, and acceptance must leave the band."""
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    for f in (src / "hf").iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((hf / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    (hf / "config.json").write_text(json.dumps(cfg))
    return G.convert(hf, out / G.DRAFT, G.target_directory("tiny-code"))


def converted(ckpt: Path, fmt: str, target, out: Path) -> Path:
    """A drafter exported in layout ``fmt`` and converted by llama.cpp's converter (what --format gguf does for
    its first layout; here for the others llama.cpp also takes)."""
    from models.export.api import export
    from models.registry import load_drafter

    d, meta = load_drafter(ckpt, target)
    hf = export(d, fmt, out / "hf", target, target_name="tiny-code", meta=meta, overwrite=True)
    return G.convert(hf, out / G.DRAFT, G.target_directory("tiny-code"))


def draft_tie_gaps(target, drafter, ckpt: Path, prompts: list[list[int]], k: int) -> list[list[float]]:
    """Per prompt, per drafting round: the smallest top-2 logit gap among the harness drafter's greedy picks
    (DFlash/DSpark: models/methods/dflash/proposers.py ``pick_token``, wrapped for this pass only). A round whose
    pick is a near tie may draft another token in an engine's float32 kernels without anything being wrong."""
    import torch

    import models.methods.dflash.proposers as P
    from eval.decode.single import speculative_decode

    gaps, orig = [], P.pick_token

    def pick(logits, *a, **kw):
        top = torch.topk(logits.float(), 2).values
        gaps.append(float(top[0] - top[1]))
        return orig(logits, *a, **kw)

    out = []
    P.pick_token = pick
    try:
        for ids in prompts:
            gaps.clear()
            r = speculative_decode(target, E.chain_proposer("dflash", drafter, target, str(ckpt), k),
                                   torch.tensor([ids]), MAX_NEW)
            rounds, i = [], 0
            for d in r.drafted:
                if d > 0:
                    rounds.append(min(gaps[i:i + d]))
                i += d
            out.append(rounds)
    finally:
        P.pick_token = orig
    return out


def _build(root: Path, runs_dir: Path) -> dict:
    from data.corpus import heldout_prompts
    from models.core.target import FrozenTarget
    from models.export.validate import validate
    from models.registry import load_drafter

    target = FrozenTarget.from_pretrained("tiny-code")
    tok = target.tokenizer
    tgt_gguf = G.convert(G.target_directory("tiny-code"), root / "tiny_code.gguf")
    cands = [p["input_ids"] for p in heldout_prompts(tok, CANDIDATES, PROMPT_TOKENS)]
    first = [o[0] for o in E.ar_outputs(target, cands, 1)]
    prompts = L.aligned_prompts(tok, tgt_gguf, cands, first, N_PROMPTS)
    ids = [p["input_ids"] for p in prompts]
    train_seconds = D.train_all(runs_dir)  # whichever tier runs first trains every drafter (same runs directory)
    ckpts = {n: D.final(runs_dir, n) for n in SERVED}
    runs = [{"name": "ar", "spec_type": None},
            L.ngram_run(K)]
    harness = {"ar": {"outputs": E.ar_outputs(target, ids, MAX_NEW)}}
    manifests = {}
    for n in SERVED:
        ck = ckpts[n]
        out = export_gguf(ck, root / "exports" / n)
        manifests[n] = G.check_gguf(out)
        validate(out / "hf", None, target, enable_thinking=False)  # the serving mode of these runs (manifest)
        k = manifests[n]["num_speculative_tokens"]
        runs.append({"name": n, "spec_type": manifests[n]["spec_type"], "draft": str(out / G.DRAFT),
                     "num_speculative_tokens": k})
        d, _ = load_drafter(ck, target)
        harness[n] = E.harness_counts(target, d.config_dict()["method"], d, str(ck), ids, MAX_NEW, k)
        if d.config_dict()["method"] == "dflash":
            harness[n]["tie_gaps"] = draft_tie_gaps(target, d, ck, ids, k)
    ctrl = shifted_control(root / "exports" / "eagle3", root / "exports" / "eagle3_shifted")
    runs.append({"name": "eagle3_shifted_control", "spec_type": "draft-eagle3", "draft": str(ctrl),
                 "num_speculative_tokens": manifests["eagle3"]["num_speculative_tokens"]})
    for fmt, n in LAYOUTS.items():
        runs.append({"name": fmt, "spec_type": manifests[n]["spec_type"],
                     "num_speculative_tokens": manifests[n]["num_speculative_tokens"],
                     "draft": str(converted(ckpts[n], fmt, target, root / "exports" / fmt))})
    runs.append({"name": "dspark_speculators_control", "spec_type": "draft-dspark",
                 "draft": str(converted(ckpts["dspark_full"], "dspark_speculators", target,
                                        root / "exports" / "dspark_spec")),
                 "num_speculative_tokens": manifests["dspark_full"]["num_speculative_tokens"]})
    engine = L.serve(tgt_gguf, prompts, MAX_NEW, runs)
    # llama-server, as users serve: AR, n-gram and the drafters of each spec type, one server process each
    eagle = next(r for r in runs if r["name"] == "eagle3")
    lookup = {**eagle, **L.lookup_run(eagle["spec_type"], eagle["num_speculative_tokens"]), "name": "eagle3_lookup"}
    server = LS.serve(tgt_gguf, prompts, MAX_NEW, [r for r in runs if r["name"] in SERVER_RUNS] + [lookup],
                      repetitions=2)
    return {"engine": engine, "server": server, "harness": harness, "prompts": prompts, "manifests": manifests,
            "train_seconds": train_seconds,
            "n_candidates": len(cands), "n_prompts": len(prompts)}


def llamacpp_results(tmp_path_factory) -> dict:
    require_engine(L.available() and LS.available(), f"llama.cpp tools {(*L.TOOLS, LS.TOOL)} not built in "
                   f"{G.llamacpp_dir()} (scripts/build_llama_cpp.sh)")
    shared = _root(tmp_path_factory)  # the vLLM tier's: its trained drafters are reused (same recipes)
    root = shared.with_name("llamacpp_tier")
    return build_once(root, lambda: _build(root, _runs_dir(shared)), "DRAFTSMITH_LLAMACPP_RESULTS")
