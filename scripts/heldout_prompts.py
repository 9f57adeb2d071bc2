"""A recipe's held-out conversations as an eval prompt file: the first exchange's context (everything before the
first reply) of each conversation in the split no recipe trains on, so `python -m eval prompts=FILE` measures a
drafter on prompts from its own training distribution beside MT-Bench's.

    python scripts/heldout_prompts.py +recipe=eagle3_smollm2_onpolicy --out runs/heldout_prompts.jsonl
    python -m eval target=smollm2 ... prompts=runs/heldout_prompts.jsonl n_prompts=60

The held-out split is the last ``data.val_rows`` of the first regenerated tranche in dataset order (data/sources.py
``build_rows``); every picked conversation keeps its row (its first prompt fits in ``data.max_len // 2`` tokens), so
the split is those picks' last ``val_rows``. Rows carry ``category`` "T0" or "T1": the temperature its training-time
reply was sampled at. Chat data with ``data.regen_only`` (the split is then defined by the picks), or text data
(``data.kind=text``, a base model's continuations: the held-out prompts as completion prompts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def heldout_rows(data_cfg, tok, train: list[dict] | None = None) -> list[dict]:
    """The held-out conversations of ``data_cfg`` (a DataConfig) as prompt-file rows: {"question_id" (the
    conversation's index in the dataset), "category" ("T0"/"T1"), "messages" (the context before the first reply)};
    with ``train`` (build_rows' training rows) none whose context a training row shares, as build_rows holds out."""
    from data.chat import render_chat
    from data.sources import chat_conversations, context_key, regen_plan, row_context_key

    if data_cfg.kind != "chat" or not data_cfg.regenerate or not data_cfg.regen_only:
        raise ValueError("the held-out split is defined by the regenerated picks: needs chat data with "
                         "data.regenerate and data.regen_only=true")
    convs, _ = chat_conversations(data_cfg)
    temp_of = {i: t for t, group in regen_plan(data_cfg, tok, convs) for i in group}
    picks = sorted(temp_of)
    n_val = min(data_cfg.val_rows, len(picks) // 2)
    rows = []
    for i in picks[len(picks) - n_val :]:
        context = []
        for m in convs[i]:
            if m["role"] == "assistant":
                break
            context.append({"role": m["role"], "content": m["content"]})
        rows.append({"question_id": i, "category": f"T{temp_of[i]:g}", "messages": context})
    if train is not None:
        seen = {row_context_key(tok, r) for r in train}
        rows = [r for r in rows if context_key(render_chat(tok, r["messages"], True, data_cfg.chat_template,
                                                           data_cfg.enable_thinking)) not in seen]
    return rows


def heldout_text_rows(data_cfg, tok) -> list[dict]:
    """data.kind=text (a base model's continuations): the held-out prompts as completion prompts, {"question_id",
    "category" ("T0"/"T1"), "prompt" (the plain text the continuation was asked of, without special tokens)}: the
    last ``val_rows`` of the plan in dataset order, as ``text_rows`` splits it. ``text_plan`` drops a prompt whose
    content an earlier one has, so none of them is a training prompt. Read from the plan: nothing is generated."""
    from data.sources import chat_conversations, text_plan

    prompts, groups = text_plan(data_cfg, tok, chat_conversations(data_cfg)[0])
    temp_of = {i: t for t, group in groups for i in group}
    picks = sorted(temp_of)
    n_val = min(data_cfg.val_rows, len(picks) // 2)
    return [{"question_id": i, "category": f"T{temp_of[i]:g}",
             "prompt": tok.decode(prompts[i], skip_special_tokens=True)} for i in picks[len(picks) - n_val :]]


def heldout_messages(overrides: list[str]) -> list[dict]:
    """``heldout_rows`` (chat data) or ``heldout_text_rows`` (text data) of the data and target that Hydra
    ``overrides`` compose."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    from data.sources import build_rows

    data_cfg, target = instantiate(cfg.data), instantiate(cfg.target)
    if data_cfg.kind == "text":
        return heldout_text_rows(data_cfg, target.tokenizer)
    train, _ = build_rows(data_cfg, target.tokenizer, target.model)  # the held-out side of the content check
    return heldout_rows(data_cfg, target.tokenizer, train)


def config_error_line(e: BaseException) -> str | None:
    """One line for a config Hydra cannot compose: an unknown recipe (or other config group option) names what
    was asked for, where those configs live and the ones there; None for any other error."""
    from hydra.errors import MissingConfigException

    if not isinstance(e, MissingConfigException) or not e.missing_cfg_file:
        return None
    group, _, name = e.missing_cfg_file.rpartition("/")
    what = "recipe" if group == "recipe" else f"{group or 'top-level'} config"
    return (f"no {what} {name!r} in {Path('conf', group)}/ (the repo's Hydra configs); choose one of: "
            f"{', '.join(e.options or []) or 'none there'}")


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException, InstantiationException
    from omegaconf.errors import OmegaConfBaseException

    from models.core.checkpoint import check_writable_dir, write_atomic
    from train.__main__ import USER_ERRORS, user_error

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the prompt file to write (.jsonl)")
    ap.add_argument("overrides", nargs="+", help="Hydra overrides, e.g. +recipe=eagle3_smollm2_onpolicy")
    args = ap.parse_args(argv)
    try:
        # before the config and its rows (minutes of work): an --out that cannot be written is refused first
        if args.out.is_dir():
            raise ValueError(f"--out {args.out} is a directory; name the .jsonl file to write")
        check_writable_dir(args.out.parent, "--out")
        rows = heldout_messages(args.overrides)
        write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    except (*USER_ERRORS, HydraException, OmegaConfBaseException) as e:
        if isinstance(e, InstantiationException):
            err = user_error(e)
        else:
            err = (config_error_line(e) or e) if isinstance(e, HydraException) else e
        if err is None:  # a bug behind the target's constructor: its traceback is the report
            raise
        print(f"error: {(str(err).strip().splitlines() or [type(err).__name__])[0]}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} held-out prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
