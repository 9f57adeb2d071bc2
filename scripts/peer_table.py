"""The peer table: our EAGLE-3 recipe against speculators 0.9.0's own trainer at equal target tokens, from what
`make peer-ours`, `make peer-speculators` and `make peer-compare` wrote. The raw training records are copied beside
the table, so every figure in it has its file:

    python scripts/peer_table.py --ours runs/peer_ours --peer runs/peer_speculators --bench bench/peer_smollm2

writes ``BENCH/summary.json``, ``BENCH/summary.md`` and ``BENCH/train_{ours,peer}/``. Refuses (exit 2, one line)
runs that did not train on the same rows and draft vocabulary, or a harness run missing either drafter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.bench.training import read_records  # noqa: E402

SETS = {"heldout": "held-out prompts (clean split)", "mt_bench": "MT-Bench, 80 first turns"}
NAMES = {"eagle3": "ours (draftsmith)", "eagle3_peer": "speculators 0.9.0"}


class TableError(ValueError):
    pass


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise TableError(f"{path} is missing: run the make target that writes it (docs/training.md)")
    return json.loads(path.read_text())


def same_vocabulary(ours: Path, peer_data: Path) -> int:
    """Both drafters' draft vocabulary must be one: ours stores d2t in its weights, the peer read d2t.npy."""
    ours_d2t = load_file(str(ours / "final" / "model.safetensors")).get("d2t")
    peer_d2t = np.load(peer_data / "d2t.npy")
    if ours_d2t is None or not np.array_equal(ours_d2t.numpy(), peer_d2t):
        raise TableError(f"{ours}/final and {peer_data} have different draft vocabularies: prepare the peer without "
                         "--vocab-from, so both use the recipe's")
    return int(peer_d2t.size)


def harness_rows(bench: Path) -> dict:
    """Per prompt set and drafter: τ, acceptance by position, emitted tokens, rounds and the lossless verdict."""
    out = {}
    for name in SETS:
        res = read_json(bench / name / "results.json")
        runs = {r["method"]: r for r in res["runs"] if r.get("temperature") == 0}
        missing = [m for m in NAMES if m not in runs]
        if missing:
            raise TableError(f"{bench / name}/results.json has no T=0 run of {missing}: rerun make peer-compare")
        out[name] = {m: {"tau": runs[m]["tau"], "acceptance_by_pos": runs[m]["acceptance_by_pos"],
                         "tokens": runs[m]["tokens"], "rounds": runs[m]["rounds"], "lossless": runs[m]["lossless"],
                         "n_prompts": res["prompts"].get("n", res["prompts"].get("n_prompts"))}
                     for m in NAMES}
    return out


def training_costs(ours: Path, peer: Path, manifest: dict) -> dict:
    """Wall seconds on one core each, whole (ours online: its steps run the target too; the peer: its target states,
    scaled to every row when a resumed prepare wrote only part, plus its training) and the trainer's own (ours:
    minus ``target_s``; from a run that predates that record, minus the peer's measured states time of the same
    training rows, marked estimated)."""
    recs = read_records(ours / "metrics.jsonl")
    if not recs:
        raise TableError(f"{ours}/metrics.jsonl is missing or empty: run make peer-ours")
    last = recs[-1]
    states = manifest.get("states_written") or {}
    rows = manifest["train_rows"] + manifest["val_rows"]
    states_s = states["seconds"] * rows / states["rows"] if states.get("rows") else None
    train = read_json(peer / "checkpoints" / "train_result.json")
    if "target_s" in last:
        own, estimated = last["elapsed_s"] - last["target_s"], False
    else:
        own = last["elapsed_s"] - states_s * manifest["train_rows"] / rows if states_s else None
        estimated = True
    return {"ours": {"steps": last["step"], "tokens_seen": last["tokens_seen"], "seconds": last["elapsed_s"],
                     "train_seconds": own and round(own, 1), "train_seconds_estimated": estimated,
                     "includes": "the target's forward inside each step"},
            "peer": {"steps": train["steps"], "seconds": round((states_s or 0) + train["seconds"], 1),
                     "states_seconds": states_s and round(states_s, 1), "train_seconds": train["seconds"],
                     "packed_tokens_per_s": train["tokens_per_s"], "includes": "target states (prepare), training"}}


def copy_records(ours: Path, peer: Path, bench: Path) -> None:
    for src, dst in [(ours / "metrics.jsonl", "train_ours"), (ours / "val.jsonl", "train_ours"),
                     (ours / "data_stats.json", "train_ours"), (peer / "data" / "manifest.json", "train_peer"),
                     (peer / "checkpoints" / "metrics.jsonl", "train_peer"),
                     (peer / "checkpoints" / "train_result.json", "train_peer")]:
        if src.is_file():
            (bench / dst).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, bench / dst / src.name)


def markdown(s: dict) -> str:
    m, c = s["data"], s["cost"]
    lines = [f"Both from scratch on the same {m['train_rows']} on-policy rows ({m['train_tokens']:,} target tokens "
             f"scored, one pass), the same {m['draft_vocab_size']}-token draft vocabulary and layers "
             f"{m['layer_ids']}, {m['hidden_states_dtype']} states, one core each; scored by one harness at T=0, "
             "chain K=4, 32 new tokens.", "",
             "| trainer | set | τ | acceptance by position | lossless | min, all (1 core) | min, trainer's own |",
             "|---|---|---|---|---|---|---|"]
    for name, title in SETS.items():
        for meth, who in NAMES.items():
            r = s["harness"][name][meth]
            acc = " / ".join(f"{a:.2f}" for a in r["acceptance_by_pos"])
            cost = c["ours" if meth == "eagle3" else "peer"]
            own = "–" if cost["train_seconds"] is None else f"{cost['train_seconds'] / 60:.0f}"
            own += " (est.)" if cost.get("train_seconds_estimated") else ""
            lines.append(f"| {who} | {title} | {r['tau']:.2f} | {acc} | {'yes' if r['lossless'] else 'NO'} | "
                         f"{cost['seconds'] / 60:.0f} | {own} |")
    lines += ["", f"Held-out τ ours / theirs: {s['ratio_heldout_tau']:.3f}; MT-Bench: {s['ratio_mt_bench_tau']:.3f}."]
    return "\n".join(lines) + "\n"


def build(ours: Path, peer: Path, bench: Path) -> dict:
    manifest = read_json(peer / "data" / "manifest.json")
    vocab = same_vocabulary(ours, peer / "data")
    cost = training_costs(ours, peer, manifest)
    if cost["ours"]["steps"] != manifest["our_steps"]:
        raise TableError(f"{ours} trained {cost['ours']['steps']} steps, not the {manifest['our_steps']} that draw "
                         f"the peer's rows: run make peer-ours with the same PEER_DIR")
    harness = harness_rows(bench)
    s = {"data": {k: manifest[k] for k in ("train_rows", "val_rows", "train_tokens", "layer_ids", "recipe",
                                           "hidden_states_dtype", "our_steps")} | {"draft_vocab_size": vocab},
         "cost": cost, "harness": harness,
         "ratio_heldout_tau": harness["heldout"]["eagle3"]["tau"] / harness["heldout"]["eagle3_peer"]["tau"],
         "ratio_mt_bench_tau": harness["mt_bench"]["eagle3"]["tau"] / harness["mt_bench"]["eagle3_peer"]["tau"]}
    copy_records(ours, peer, bench)
    (bench / "summary.json").write_text(json.dumps(s, indent=1))
    (bench / "summary.md").write_text(markdown(s))
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", required=True, help="our run's output_dir (make peer-ours)")
    p.add_argument("--peer", required=True, help="PEER_DIR of make peer-speculators")
    p.add_argument("--bench", required=True, help="make peer-compare's PEER_BENCH")
    a = p.parse_args(argv)
    try:
        s = build(Path(a.ours), Path(a.peer), Path(a.bench))
    except (TableError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(s), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
