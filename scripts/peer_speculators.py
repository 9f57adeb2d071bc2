"""speculators 0.9.0's own EAGLE-3 trainer on the rows, loss masks, draft vocabulary and target-token budget of one of
our recipes, on a CPU, from a launcher we own: the peer our recipe is compared with (docs/training.md).

    python scripts/peer_speculators.py prepare --out runs/peer_speculators/data --max-tokens 500000 \\
        +recipe=eagle3_smollm2_onpolicy
    python scripts/peer_speculators.py train --data runs/peer_speculators/data \\
        --save-path runs/peer_speculators/checkpoints [any speculators train flag: --max-steps 200 --lr 1e-3 ...]

``prepare`` writes what speculators' file backend reads, with plain transformers (no vLLM server): ``data/`` (an HF
``datasets`` directory: the training rows our run draws first, up to ``--max-tokens`` loss-masked tokens, then the
held-out rows it scores), ``hidden_states/hs_{i}.safetensors`` (our layer ids ascending, then the last decoder
layer's output BEFORE the final norm, which speculators applies itself), ``d2t.npy`` / ``t2d.npy`` (our draft
vocabulary) and ``manifest.json``; an argmax gate on a few rows stops it before the long part. ``train`` runs
speculators' own ``main`` in this process with three CPU patches and the flags that keep it off a GPU and a vLLM
server, checks its checkpoint with our validator and writes it as our drafter directory (``<save-path>/final``).
Exit status 2 with one ``error:`` line for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, load_from_disk
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from omegaconf.errors import OmegaConfBaseException
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from peer_cpu import cpu_patches  # noqa: E402

from data.sources import build_rows  # noqa: E402
from models.core.checkpoint import write_atomic  # noqa: E402
from models.core.target import parse_dtype, resolve_name  # noqa: E402
from models.core.target_view import TargetView  # noqa: E402
from models.core.vocab import build_draft_vocab, check_mapping, count_tokens  # noqa: E402
from models.export.api import load_export  # noqa: E402
from models.export.serving import training_serving  # noqa: E402
from models.export.shared.common import ExportError  # noqa: E402
from models.export.validate import validate  # noqa: E402
from models.methods.eagle3.config import fused_layer_ids  # noqa: E402
from train.__main__ import USER_ERRORS, user_error  # noqa: E402
from train.batches import batch_indices  # noqa: E402
from train.checkpoint import save_final  # noqa: E402
from train.distributed import Dist  # noqa: E402

INSTALL_HINT = "speculators 0.9.0 is not installed in this environment: run `make install` (it adds it with --no-deps)"
MANIFEST = "manifest.json"
GATE_ROWS = 4


def compose_recipe(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def budget_rows(cfg, train_rows: list[dict], max_tokens: int | None) -> tuple[list[int], int, int, int | None]:
    """(the training rows our run draws first, in first-draw order, until ``max_tokens`` loss-masked tokens; the
    tokens our run has trained on by then, repeats included; the passes over those rows that makes; the steps our
    run takes to draw them: its train.steps for the same budget). Without a budget: every training row, once."""
    tokens = [sum(r["loss_mask"]) for r in train_rows]
    if max_tokens is None:
        return list(range(len(train_rows))), sum(tokens), 1, None
    t = cfg.train
    lengths = tuple(len(r["input_ids"]) for r in train_rows) if t.length_bucket > 1 else None
    picks: dict[int, None] = {}
    seen, step = 0, 0
    while seen < max_tokens:
        for micro in range(t.grad_accum):
            for i in batch_indices(len(train_rows), step, micro, t.batch_size, t.grad_accum, Dist(), cfg.seed,
                                   lengths, t.length_bucket):
                picks.setdefault(i)
                seen += tokens[i]
        step += 1
    distinct = sum(tokens[i] for i in picks)
    return list(picks), seen, max(1, round(seen / max(distinct, 1))), step


def peer_mask(loss_mask: list[int]) -> list[int]:
    """Our loss mask in speculators' convention. Ours marks the predicted token (EAGLE-3 step k at i is scored where
    mask[i+2+k]); speculators scores that same prediction where its mask[i+1+k] is set (models/eagle3/data.py
    shift_batch, metrics.py align_for_step): shifted left by one, so both score the same predictions."""
    return list(loss_mask[1:]) + [0]


def draft_vocab(draft_cfg, target, train_rows: list[dict], vocab_from: str | None):
    """(d2t, t2d) of the recipe's drafter: from ``vocab_from``'s weights, or built as models/methods/eagle3 builds
    a new drafter's (the most frequent loss-masked tokens of every training row)."""
    if vocab_from:
        f = Path(vocab_from) / "model.safetensors"
        if not f.is_file():
            raise FileNotFoundError(f"--vocab-from {vocab_from}: no model.safetensors there (pass a drafter's final/)")
        with safe_open(str(f), "pt") as st:
            if not {"d2t", "t2d"} <= set(st.keys()):
                raise ValueError(f"--vocab-from {f} holds no d2t/t2d (not an EAGLE-3 drafter)")
            d2t, t2d = st.get_tensor("d2t"), st.get_tensor("t2d")
        if t2d.numel() != target.vocab_size:
            raise ValueError(f"--vocab-from {f}: its vocabulary covers {t2d.numel()} target ids, the target has "
                             f"{target.vocab_size}: a drafter of another target")
        check_mapping(d2t, t2d)
        return d2t, t2d
    size = int(draft_cfg.draft_vocab_size)
    if not 0 < size <= target.vocab_size:
        raise ValueError(f"draft.config.draft_vocab_size={size}: must be in 1..{target.vocab_size}")
    return build_draft_vocab(count_tokens(train_rows, target.vocab_size), size)


def target_states(target, ids, aux_ids: list[int], keep: int = 0):
    """([B, T, 4, H] float: the ``aux_ids`` states, then the last decoder layer's output before the final norm;
    [B, T, V] logits, or the last ``keep`` positions' only) of one target forward."""
    pre: dict = {}
    handle = target.norm.register_forward_pre_hook(lambda _m, args: pre.__setitem__("final", args[0]))
    try:
        out = target(ids, layer_ids=aux_ids, logits_to_keep=keep)
    finally:
        handle.remove()
    return torch.stack([*(out.hidden[k] for k in aux_ids), pre["final"]], dim=2).float(), out.logits.float()


def hs_path(out: Path, i: int) -> Path:
    return out / "hidden_states" / f"hs_{i}.safetensors"


def hs_complete(path: Path, ids: list[int], layers: int, hidden: int) -> bool:
    """A file speculators will read as row ``ids``: both tensors, the row's tokens, [T, layers, H] states."""
    try:
        with safe_open(str(path), "pt") as st:
            shape = tuple(st.get_slice("hidden_states").get_shape())
            tok = st.get_tensor("token_ids")
    except Exception:  # noqa: BLE001 - a torn or foreign file is rewritten, whatever its damage
        return False
    return shape == (len(ids), layers, hidden) and torch.equal(tok, torch.tensor(ids, dtype=torch.int64))


def write_hs(path: Path, states, ids: list[int], dtype) -> None:
    data = save({"hidden_states": states.to(dtype).contiguous(),
                 "token_ids": torch.tensor(ids, dtype=torch.int64)})
    write_atomic(path, data, "free space, or lower --max-tokens")


def write_states(out: Path, target, rows: list[dict], indices: list[int], aux_ids: list[int], dtype,
                 batch_size: int, pad_id: int) -> int:
    """hs files of ``rows[i]`` for i in ``indices`` that are not complete yet (batched, right-padded: a causal
    target's positions never read the padding after them; longest first, so batches pad little and the peak memory
    comes at once); how many were written."""
    todo = [i for i in indices if not hs_complete(hs_path(out, i), rows[i]["input_ids"], len(aux_ids) + 1,
                                                  target.hidden_size)]
    todo.sort(key=lambda i: -len(rows[i]["input_ids"]))
    bar = tqdm(total=sum(len(rows[i]["input_ids"]) for i in todo), unit="tok", desc="target states",
               disable=len(todo) <= batch_size)
    for b in range(0, len(todo), batch_size):
        chunk = todo[b : b + batch_size]
        width = max(len(rows[i]["input_ids"]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for j, i in enumerate(chunk):
            ids[j, : len(rows[i]["input_ids"])] = torch.tensor(rows[i]["input_ids"])
        states, _ = target_states(target, ids.to(target.embed.weight.device), aux_ids, keep=1)  # no lm_head
        for j, i in enumerate(chunk):
            n = len(rows[i]["input_ids"])
            write_hs(hs_path(out, i), states[j, :n].cpu(), rows[i]["input_ids"], dtype)
            bar.update(n)
    bar.close()
    return len(todo)


def write_dataset(out: Path, rows: list[dict]) -> None:
    """The HF datasets directory speculators loads (``load_from_disk``), replaced whole only when its rows changed."""
    cols = {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [peer_mask(r["loss_mask"]) for r in rows],
            "seq_len": [len(r["input_ids"]) for r in rows]}
    dest = out / "data"
    if (dest / "state.json").is_file():
        old = load_from_disk(str(dest)).with_format(None).to_dict()
        if all(old.get(k) == v for k, v in cols.items()):
            return
    tmp = out / f"data.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    Dataset.from_dict(cols).with_format("torch").save_to_disk(str(tmp))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


class GateError(ValueError):
    pass


def argmax_gate(out: Path, target, rows: list[dict], indices: list[int], aux_ids: list[int]) -> dict:
    """The target's lm_head over its final norm of each stored final state must give the target's own argmax at
    every position, except where the target's two logits are closer than the storage dtype's rounding can move them
    (measured on the same position: the exact state rounded to the stored dtype). Raises GateError (one line)."""
    head = target.model.get_output_embeddings()
    read = lambda s: head(target.norm(s.to(target.embed.weight))).float()  # what speculators' teacher computes
    n = exact = 0
    with torch.no_grad():
        for i in indices:
            f = load_file(str(hs_path(out, i)))
            ids = torch.tensor([rows[i]["input_ids"]], device=target.embed.weight.device)
            states, logits = target_states(target, ids, aux_ids)
            ref, final = logits[0], states[0, :, -1]
            got = read(f["hidden_states"][:, -1].float().to(final.device))
            noise = (read(final.to(f["hidden_states"].dtype).float()) - read(final)).abs().amax(-1)
            top, pick = ref.argmax(-1), got.argmax(-1)
            gap = ref.gather(-1, top[:, None])[:, 0] - ref.gather(-1, pick[:, None])[:, 0]
            bad = (pick != top) & (gap > 2 * noise + 1e-5 * ref.abs().amax(-1))
            if bool(bad.any()):
                p = int(bad.nonzero()[0])
                raise GateError(f"argmax gate failed on row {i}: {int(bad.sum())} of {len(top)} positions give "
                                f"another token than the target (position {p}: {int(pick[p])} for {int(top[p])}); "
                                f"{hs_path(out, i)} does not hold the pre-norm final state")
            n += len(top)
            exact += int((pick == top).sum())
    return {"rows": len(indices), "positions": n, "exact": exact}


def recipe_rows(cfg, target) -> tuple[list[dict], list[dict]]:
    if cfg.draft.method != "eagle3":
        raise ValueError(f"draft.method={cfg.draft.method}: the speculators peer trains EAGLE-3; use an eagle3 recipe")
    train_rows, val_rows = build_rows(instantiate(cfg.data), target.tokenizer, target.model)
    val_rows = val_rows[: cfg.train.eval_rows]
    if not val_rows:
        raise ValueError("the recipe holds out no rows (data.val_rows / train.eval_rows is 0): speculators' "
                         "validation split needs at least one")
    return train_rows, val_rows


def verifier_dir(cfg) -> str:
    """The target's local HF directory (a GGUF's converted one): what speculators reads the verifier from."""
    path = Path(resolve_name(cfg.target.name_or_path, cfg.target.get("gguf_file"))).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"target {cfg.target.name_or_path!r} is not a local HF directory ({path} has no "
                         "config.json): speculators reads the verifier's config and weights from one")
    return str(path.resolve())


def check_same_target(out: Path, identity: dict) -> None:
    path = out / MANIFEST
    if path.is_file():
        old = json.loads(path.read_text()).get("target", {})
        keys = ("num_hidden_layers", "hidden_size", "vocab_size", "embed_fingerprint")
        if any(old.get(k) != identity.get(k) for k in keys):
            raise ValueError(f"{out} was prepared for another target ({old.get('name_or_path')!r}, embedding "
                             f"{old.get('embed_fingerprint')}); this recipe's is {identity.get('name_or_path')!r} "
                             f"({identity.get('embed_fingerprint')}): use another --out")


def prepare(args: argparse.Namespace) -> dict:
    cfg = compose_recipe(args.overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = instantiate(cfg.target)
    verifier = verifier_dir(cfg)
    out = Path(args.out)
    check_same_target(out, target.identity())
    train_rows, val_rows = recipe_rows(cfg, target)
    draft_cfg = instantiate(cfg.draft.config)
    aux_ids = sorted(fused_layer_ids(draft_cfg, target.num_layers))
    if max(aux_ids) >= target.num_layers or min(aux_ids) < 1:
        raise ValueError(f"layer ids {aux_ids}: speculators captures ids 1..{target.num_layers - 1}")
    d2t, t2d = draft_vocab(draft_cfg, target, train_rows, args.vocab_from)
    picks, seen, epochs, steps = budget_rows(cfg, train_rows, args.max_tokens)
    rows = [train_rows[i] for i in picks] + val_rows
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    write_dataset(out, rows)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    dtype = parse_dtype(args.dtype)
    pad = getattr(target.tokenizer, "pad_token_id", None) or 0
    gate_idx = list(range(min(args.gate_rows, len(picks))))
    write_states(out, target, rows, gate_idx, aux_ids, dtype, args.batch_size, pad)
    gate = argmax_gate(out, target, rows, gate_idx, aux_ids)  # before the hours the rest takes
    t0 = time.time()
    written = write_states(out, target, rows, list(range(len(rows))), aux_ids, dtype, args.batch_size, pad)
    states = {"rows": written, "seconds": round(time.time() - t0, 1), "threads": torch.get_num_threads()}
    if not written and (out / MANIFEST).is_file():  # a rerun over complete files keeps the ledger of the build
        states = json.loads((out / MANIFEST).read_text()).get("states_written", states)
    n_train = len(picks)
    manifest = {
        "recipe": list(args.overrides), "verifier": verifier,
        "target": target.identity(), "layer_ids": aux_ids, "draft_vocab_size": int(d2t.numel()),
        "train_rows": n_train, "val_rows": len(val_rows), "max_tokens": args.max_tokens,
        "train_tokens": sum(sum(train_rows[i]["loss_mask"]) for i in picks), "budget_tokens_seen": seen,
        "epochs": epochs, "our_steps": steps, "total_seq_len": int(cfg.train.batch_size * cfg.data.max_len),
        "train_data_ratio": (n_train + 0.5) / len(rows), "hidden_states_dtype": args.dtype, "gate": gate,
        # the target's cost of the states (a resumed prepare counts the part it wrote)
        "states_written": states,
    }
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1))
    print(f"prepare: {n_train} training rows ({manifest['train_tokens']} target tokens; our run has trained on "
          f"{seen} by then, {epochs} pass(es)) + {len(val_rows)} held-out rows in {out}; {written} hs files written "
          f"now; argmax gate: {gate['exact']}/{gate['positions']} positions exact on {gate['rows']} rows, the rest "
          "within rounding", flush=True)
    return manifest


def flag(argv: list[str], name: str) -> str | None:
    """The last value given to ``name`` in ``argv`` (argparse keeps the last)."""
    val = None
    for j, a in enumerate(argv):
        val = (argv[j + 1] if a == name and j + 1 < len(argv)
               else a.split("=", 1)[1] if a.startswith(name + "=") else val)
    return val


def train_argv(data: Path, m: dict, extra: list[str]) -> list[str]:
    """speculators' flags: our data, vocabulary, layers and split; the CPU path (sdpa dense masks, the eager loss,
    no worker processes, one full-attention draft layer as our drafter has); then the caller's flags, which win."""
    epochs = m["epochs"]
    if flag(extra, "--max-steps") is not None and flag(extra, "--epochs") is None:
        epochs = 1  # its loop trains one more step for each epoch left after --max-steps stops one
    save = flag(extra, "--save-path") or str(data.parent / "checkpoints")
    return ["--speculator-type", "eagle3", "--verifier-name-or-path", m["verifier"],
            "--data-path", str(data / "data"), "--hidden-states-path", str(data / "hidden_states"),
            "--on-missing", "raise", "--target-layer-ids", *map(str, m["layer_ids"]),
            "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
            "--draft-vocab-size", str(m["draft_vocab_size"]), "--train-data-ratio", str(m["train_data_ratio"]),
            "--total-seq-len", str(m["total_seq_len"]), "--epochs", str(epochs),
            "--hidden-states-dtype", m["hidden_states_dtype"], "--draft-attn-impl", "sdpa",
            "--loss-implementation", "eager", "--num-workers", "0", "--full-attention-indices", "0",
            "--save-path", save, "--log-dir", str(Path(save) / "logs"), *extra]


def read_manifest(data: Path) -> dict:
    path = data / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"--data {data}: no {MANIFEST} there; run `scripts/peer_speculators.py prepare "
                                f"--out {data} +recipe=...` first")
    m = json.loads(path.read_text())
    if not Path(m["verifier"], "config.json").is_file():
        raise FileNotFoundError(f"the target {m['verifier']} that {data} was prepared with is gone (no config.json)")
    return m


def last_checkpoint(save: Path) -> Path | None:
    done = [p for p in save.glob("[0-9]*") if p.name.isdigit() and (p / "model.safetensors").is_file()]
    return max(done, key=lambda p: int(p.name)) if done else None


def train(args: argparse.Namespace, extra: list[str]) -> dict:
    data = Path(args.data)
    m = read_manifest(data)
    try:
        import speculators.train.cli as cli
        from speculators.train.config import TrainConfig
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    given = flag(extra, "--verifier-name-or-path")
    if given is not None and Path(given).resolve() != Path(m["verifier"]):
        raise ValueError(f"--verifier-name-or-path {given} is not the target {data} was prepared with "
                         f"({m['verifier']}): its hidden states would train a drafter for another target")
    if args.threads:
        torch.set_num_threads(args.threads)
    argv = train_argv(data, m, extra)
    save = Path(flag(argv, "--save-path"))
    cfg = TrainConfig.resolve(argv)
    t0 = time.time()
    with cpu_patches(save / "metrics.jsonl"):
        cli.main(cfg)
    ckpt = last_checkpoint(save)
    if ckpt is None:
        raise ValueError(f"speculators wrote no checkpoint under {save}")
    result = {"checkpoint": str(ckpt), "seconds": round(time.time() - t0, 1),
              **summarise(save / "metrics.jsonl", t0), "check": check_export(ckpt, m["verifier"])}
    flat = cfg.flatten()
    adopt(ckpt, m, save / "final", int(flat["ttt_steps"]), float(flat["ttt_step_loss_decay"]))
    result = {**result, "final": str(save / "final"), "threads": torch.get_num_threads()}
    write_atomic(save / "train_result.json", json.dumps(result, indent=1))  # the record scripts/peer_table.py reads
    return result


def summarise(path: Path, since: float) -> dict:
    """This run's steps and mean packed tokens/s from its metric records."""
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    steps = [r for r in recs if "train" in r and r["time"] >= since]
    tps = [r["profile"]["tokens_per_s"] for r in steps if r.get("profile")]
    return {"steps": len(steps), "tokens_per_s": round(sum(tps) / len(tps), 1) if tps else None}


def check_export(ckpt: Path, verifier: str) -> str:
    """Our validator (``python -m train.export --check``) on speculators' checkpoint, against the target; its
    warnings as ``warning:`` lines."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fmt = validate(ckpt, None, TargetView.from_pretrained(verifier))
    for w in seen:
        print(f"warning: {w.message}", file=sys.stderr)
    return f"{ckpt}: valid {fmt} export against {verifier}"


def adopt(ckpt: Path, m: dict, out: Path, ttt_steps: int, step_decay: float) -> None:
    """speculators' checkpoint as our drafter directory (what ``python -m eval checkpoints.eagle3=OUT`` loads):
    loaded back through our eagle3_speculators loader, recorded with the recipe's target and serving mode and the
    TTT steps it trained (EAGLE-2 trees are sized up to that depth)."""
    cfg = compose_recipe(m["recipe"])
    target = instantiate(cfg.target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # check_export has said them
        d = load_export(ckpt, target, "eagle3_speculators").float()
    d.cfg = dataclasses.replace(d.cfg, ttt_steps=ttt_steps, step_weight=step_decay)
    meta = {"method": "eagle3", "target": target.identity(), "draft": d.config_dict(), "layer_ids": list(d.layer_ids),
            "layer_id_convention": "hf_output_hidden_states_index",
            "serving": training_serving(target, cfg.data.get("chat_template"), cfg.data.get("enable_thinking"),
                                        cfg.data.get("kind")),
            "trained_by": {"trainer": "speculators 0.9.0 (scripts/peer_speculators.py)", "checkpoint": str(ckpt),
                           "recipe": m["recipe"]}}
    save_final(out, d, meta)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/peer_speculators.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="rows, hidden states, draft vocabulary and the argmax gate")
    p.add_argument("--out", required=True, help="the data directory to write (resumable)")
    p.add_argument("--max-tokens", type=int, help="target-token budget: our run's first rows up to this many "
                                                 "loss-masked tokens (default: every training row once)")
    p.add_argument("--vocab-from", help="a drafter directory whose d2t/t2d to use (default: the recipe's own)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="hidden-state storage")
    p.add_argument("--batch-size", type=int, default=8, help="rows per target forward")
    p.add_argument("--gate-rows", type=int, default=GATE_ROWS, help="rows the argmax gate checks")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the default)")
    p.add_argument("overrides", nargs="+", help="Hydra overrides, e.g. +recipe=eagle3_smollm2_onpolicy")
    t = sub.add_parser("train", help="speculators' trainer on a prepared directory; other flags go to it")
    t.add_argument("--data", required=True, help="a directory `prepare` wrote")
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: the default)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args, extra = parser().parse_known_args(argv)
    if args.cmd == "prepare" and (extra or (args.max_tokens is not None and args.max_tokens < 1)):
        why = f"prepare does not take {extra[0]}" if extra else "--max-tokens must be >= 1"
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        result = prepare(args) if args.cmd == "prepare" else train(args, extra)
    except (*USER_ERRORS, ExportError, HydraException, OmegaConfBaseException) as e:
        err = user_error(e) if isinstance(e, InstantiationException) else e
        if err is None:  # a bug behind the target's constructor: its traceback is the report
            raise
        print(f"error: {(str(err).strip().splitlines() or [type(err).__name__])[0]}", file=sys.stderr)
        return 2
    if args.cmd == "train":
        print(f"train: {result['steps']} steps in {result['seconds']} s ({result['tokens_per_s']} packed tokens/s); "
              f"checkpoint {result['checkpoint']}; {result['check']}; our drafter directory: {result['final']}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
