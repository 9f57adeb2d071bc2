"""DFlash (and DSpark): a block-parallel drafter — one forward drafts a block (build, K sizing, SPEC).

The package, one seam per module:

    config.py     ``DFlashConfig`` (``draft.config``) and the z-lab layer-id default
    net.py        the network and its training loss (block mask, ``DFlashDrafter``; the method's maths)
    heads.py      intra-block heads (DSpark's Markov + confidence head)
    proposers.py  the B=1 and batched proposers (one block forward per round)
    export.py     the speculators / z-lab formats, DFlash and DSpark (build, load back, README)
    check.py      their validator (headers, block conventions, layer ids, shapes, vocabulary maps)
    here          a new drafter (mask token, draft vocabulary, warm start), the eval-time K sizing, ``SPEC``
"""

from __future__ import annotations

from torch import Tensor

from models.core.acceptance import best_by_cost, chain_taus
from models.core.spec import MethodSpec, ProposerSpec
from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab, choose_mask_token, count_tokens
from models.methods.dflash import export
from models.methods.dflash.config import DFlashConfig, check_config
from models.methods.dflash.net import DFlashDrafter
from models.methods.dflash.proposers import DFlashProposer


def build(cfg: DFlashConfig, target: FrozenTarget, train_rows: list[dict]) -> DFlashDrafter:
    """A new drafter: the mask token and (if reduced) the draft vocabulary chosen from the training data — or,
    with ``warm_start``, taken from that DFlash checkpoint together with its weights."""
    note = whole_block_note(cfg, train_rows)
    if note and _is_main_process():  # training prints it once, not once per rank
        print(note, flush=True)
    if cfg.warm_start:
        return _warm_start(cfg, target)
    V = target.vocab_size
    if cfg.mask_token_id is None:
        cfg.mask_token_id = choose_mask_token(target, train_rows)
    d2t = t2d = None
    if cfg.draft_vocab_size and cfg.draft_vocab_size < V:
        d2t, t2d = build_draft_vocab(count_tokens(train_rows, V), cfg.draft_vocab_size)
    return DFlashDrafter(cfg, target.model.config, target.embed.weight, _lm_head(target), d2t, t2d)


def whole_block_note(cfg: DFlashConfig, rows: list[dict]) -> str | None:
    """A one-line warning when no training row holds a whole block: the drafts past the longest run of trainable
    tokens after an anchor are never scored (their loss_k stay 0), so the drafter learns only its first slots while
    the run looks healthy. None when some row holds one (the scan stops there: usually the first row)."""
    drafts = int(cfg.block_size) - (0 if cfg.sample_from_anchor else 1)  # labels a+1..a+drafts
    best = 0
    for row in rows:
        run = 0
        for i, m in enumerate(row.get("loss_mask") or ()):
            run = run + 1 if m and i >= 1 else 0  # token 0 is no anchor's label
            best = max(best, run)
        if best >= drafts:
            return None
    if not rows:
        return None
    return (f"warning: draft.config.block_size={cfg.block_size}: no training row holds a whole block ({drafts} "
            f"drafts need {drafts} trainable tokens in a row after the anchor; the longest run is {best}), so drafts "
            f"{best}..{drafts - 1} are never trained (loss_{best}..loss_{drafts - 1} stay 0); lower "
            "draft.config.block_size or raise data.max_len")


def _is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _warm_start(cfg: DFlashConfig, target: FrozenTarget) -> DFlashDrafter:
    """DSpark's contract is "DFlash + extra tensors": start from a trained DFlash checkpoint's backbone (every
    tensor it has; a block head it lacks starts fresh — W2 = 0, so the drafts start as the checkpoint's). The
    checkpoint fixes what its weights were trained with: target, layer ids, layers, vocabulary, mask id; only a
    reduced vocabulary may be widened to the target's whole one (``draft_vocab_size`` = its vocab size)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from models.core.checkpoint import CONFIG, WEIGHTS, check_finite

    src = Path(cfg.warm_start)
    if not (src / WEIGHTS).exists():
        raise ValueError(f"draft.config.warm_start={src}: no {WEIGHTS} there; pass a DFlash run's …/final")
    meta = json.loads((src / CONFIG).read_text())
    if meta.get("method") != "dflash":
        raise ValueError(f"draft.config.warm_start={src} is a {meta.get('method')!r} checkpoint, not a DFlash one")
    if (meta.get("target") or {}).get("embed_fingerprint") not in (None, target.identity()["embed_fingerprint"]):
        raise ValueError(f"draft.config.warm_start={src} was trained for another target "
                         f"({meta['target'].get('name_or_path')!r})")
    had = meta.get("draft") or {}
    V = target.vocab_size
    # the head is the target's frozen lm_head, so a reduced vocabulary widens to the whole one exactly: the drafted
    # tokens keep their logits and the rest gain theirs (llama.cpp's DFlash converter takes only a whole vocabulary)
    had_vocab = had.get("draft_vocab_size") or V
    widen = cfg.draft_vocab_size == V and had_vocab < V
    if cfg.draft_vocab_size not in (None, had_vocab) and not widen:
        raise ValueError(f"draft.config.draft_vocab_size={cfg.draft_vocab_size} but the warm-start checkpoint {src} "
                         f"has {had_vocab}; pass draft.config.draft_vocab_size=null to keep the checkpoint's"
                         + (f" (or {V}: widen it to the whole vocabulary)" if had_vocab < V else ""))
    cfg.draft_vocab_size = None if widen or had_vocab == V else had_vocab
    for key in ("layer_ids", "num_layers", "mask_token_id", "intermediate_size"):
        mine, theirs = getattr(cfg, key), had.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"draft.config.{key}={mine} but the warm-start checkpoint {src} has {theirs}; drop the "
                             "override (the checkpoint's weights fix it)")
        setattr(cfg, key, theirs if theirs is not None else mine)
    state = load_file(str(src / WEIGHTS))
    check_finite(state, src)
    if widen:
        state = {k: v for k, v in state.items() if k not in ("lm_head", "d2t", "t2d")}
    d = DFlashDrafter(cfg, target.model.config, target.embed.weight, _lm_head(target), state.get("d2t"),
                      state.get("t2d"))
    own = d.state_dict()
    bad = sorted(k for k, v in state.items() if k not in own or own[k].shape != v.shape)
    if bad:
        raise ValueError(f"draft.config.warm_start={src}: tensors {bad[:4]} do not fit this drafter")
    d.load_state_dict(state, strict=False)
    return d


def rebuild(cfg: DFlashConfig, target: FrozenTarget) -> DFlashDrafter:
    return DFlashDrafter(cfg, target.model.config, target.embed.weight, _lm_head(target))


def _lm_head(target: FrozenTarget) -> Tensor:
    return target.model.get_output_embeddings().weight


def _prepare_num_speculative_tokens(d: DFlashDrafter, _ckpt_dir: str | None, o: dict) -> dict:
    n = o["num_speculative_tokens"]
    auto = n in (None, "auto")
    if o.get("verify_costs") == "auto" and getattr(d.block_head, "confidence_head", None) is None:
        raise ValueError("options.dflash.verify_costs=auto schedules K from a confidence head; this drafter has none "
                         "(train with draft.config.block_head=markov, confidence_head=true)")
    return {**o, "num_speculative_tokens": d.num_spec if auto else int(n), "auto_size": n == "auto"}


def _size_num_speculative_tokens(d: DFlashDrafter, ckpt_dir: str | None, o: dict, verify_cost,
                                 t1_s: float | None = None) -> dict | None:
    """``num_speculative_tokens: auto``: verify the k <= B-1 slots that maximise E(k) / v(k) — E from the held-out
    conditional slot agreement saved with the checkpoint (final/eval.json, acc_0..), v the measured verify cost of
    k drafted tokens. One draft forward writes every slot, so the draft cost does not grow with k.
    ``verify_costs: auto`` (a confidence head): v(1..S) measured here, and every round verifies the K the head's
    own acceptance estimates make best (models/methods/dflash/heads.py ``draft_block``), up to k."""
    import json
    from pathlib import Path

    out = None
    if o.get("verify_costs") == "auto":
        costs = [round(float(verify_cost(k)), 4) for k in range(1, d.num_spec + 1)]
        out = {**o, "verify_costs": costs}
    path = Path(ckpt_dir or "") / "eval.json"
    if not o.get("auto_size") or not path.exists():
        return out
    o = out or o
    ev = json.loads(path.read_text())
    acc = [ev[f"acc_{i}"] for i in range(d.num_spec) if f"acc_{i}" in ev]
    tau = chain_taus(acc)  # τ(k) of the first k slots' conditional agreement; an unscored slot (null) adds nothing
    best, pred = best_by_cost(range(1, len(acc) + 1), tau.__getitem__, verify_cost)
    if o.get("verify_costs"):  # the head schedules each round's K: the block is its cap
        best = d.num_spec
    return {**o, "num_speculative_tokens": best,
            "num_speculative_tokens_sized": {"num_speculative_tokens": best,
                                             "predicted_bound": {k: round(v, 3) for k, v in pred.items()}}}


SPEC = MethodSpec(
    name="dflash", config=DFlashConfig, build=build, rebuild=rebuild,
    export_formats=export.FORMATS, default_num_speculative_tokens=lambda d: d.num_spec, check_config=check_config,
    # num_speculative_tokens: null → the whole block (B-1; DSpark: B); auto → sized by the cost model from the
    # held-out slot agreement.
    # DSpark's confidence head: min_confidence stops a block where the running acceptance estimate drops below it;
    # verify_costs: auto → each round verifies the K maximising the head's expected tokens / measured v(K)
    proposers=(ProposerSpec("dflash", lambda d, _t, **o: DFlashProposer(d, **o),
                            {"num_speculative_tokens": "auto", "min_confidence": 0.0, "verify_costs": None},
                            prepare=_prepare_num_speculative_tokens, size=_size_num_speculative_tokens,
                            batched=DFlashProposer.batched, recommend_rank=1,
                            # what vLLM drafts (eval/engines/serving.py): K slots every round, DSpark's Markov head
                            # on, no confidence-scheduled K (vLLM 0.32 runs that head only with
                            # enable_adaptive_verification)
                            engine_options=lambda n: {"num_speculative_tokens": int(n), "min_confidence": 0.0,
                                                      "verify_costs": None}),),
)
