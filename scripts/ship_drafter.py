"""Copy a trained run into the repo as a shipped drafter: ``final/`` with its weights in fp16, plus the run's
training record (metrics.jsonl, val.jsonl, data_stats.json), so the benchmark runs, and reports what the drafter
cost to train, on a fresh machine without retraining. Every machine this project runs on starts bare; a drafter
that took an hour of CPU to train is kept only in git.

    python scripts/ship_drafter.py runs/eagle3_smollm2 models/smollm2_drafters/eagle3 --recipe eagle3_smollm2

The copy is checked before it is kept: it loads as a drafter of the target it was trained for (config.json's
target identity), every tensor finite. ``manifest.json`` says where it came from (recipe, steps, source sha256,
this commit) and the fp16 file's sha256.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.core.checkpoint import file_sha256
from models.export.shared.common import load_json

RECORD = ("metrics.jsonl", "val.jsonl", "data_stats.json")
# what a damaged file of the run being shipped asks for: it is not shippable as it is
DAMAGED_FIX = "the run's copy is damaged: restore it, retrain, or ship another checkpoint (--best / a backup)"




def check_finite(state: dict[str, torch.Tensor]) -> None:
    """Refuses weights with a NaN or an inf, naming the first such tensor: a diverged run must not ship (fp16
    keeps a NaN as it is, and the load against a target runs only with --target)."""
    for k, v in state.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            bad = int((~torch.isfinite(v)).sum())
            raise ValueError(f"{k}: {bad} of its {v.numel()} values are not finite (NaN/inf); the run diverged, "
                             "ship an earlier checkpoint")


def to_fp16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 weights → fp16; integer buffers (vocabulary maps) unchanged. Refuses non-finite weights first, then
    finite ones fp16 cannot hold."""
    check_finite(state)
    out = {}
    for k, v in state.items():
        if v.is_floating_point():
            if v.abs().max() > torch.finfo(torch.float16).max:
                raise ValueError(f"{k}: a weight exceeds fp16's range; ship this drafter in fp32")
            v = v.to(torch.float16)
        out[k] = v.contiguous()
    return out


def ship(run: Path, dest: Path, recipe: str | None, target: str | None, which: str = "final",
         replace: bool = False) -> dict:
    """``which``: the run's ``final/`` or its ``best/`` (train.keep_best: the best held-out drafter so far, shipped
    while the run goes on). ``replace``: an earlier shipped copy at ``dest`` (one with this script's manifest) is
    swapped for the new one; anything else there is refused."""
    final = run / which
    if not (final / "model.safetensors").exists():
        raise FileNotFoundError(f"{final}/model.safetensors: " + ("no best drafter yet (train with "
                                "train.keep_best=true)" if which == "best" else "not a finished run (train it first)"))
    # the run's own records are read before any staging: a damaged one is one line naming its file and the fix,
    # not the decoder's complaint alone
    if not (final / "config.json").is_file():
        raise FileNotFoundError(f"{final}/config.json: missing; {DAMAGED_FIX}")
    meta = load_json(final / "config.json", DAMAGED_FIX)
    steps = meta.get("step") or _last_step(run / "metrics.jsonl")
    # first: a copy a killed --replace moved aside is dest again, so a ship without --replace refuses it
    recover(dest)
    if dest.exists() and not (replace and (dest / "manifest.json").is_file() and (dest / "final").is_dir()):
        raise FileExistsError(f"{dest} exists; remove it yourself to ship a new drafter there"
                              + ("" if replace else " (or --replace an earlier shipped copy)"))
    # staged next to dest: os.replace cannot cross file systems (the system temp dir often is another one)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".ship_{os.getpid()}_", dir=dest.parent))
    try:
        _stage(run, final, tmp, target)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        manifest = {"method": meta.get("method"), "recipe": recipe, "source": str(run),
                    "source_sha256": file_sha256(final / "model.safetensors"),
                    "fp16_sha256": file_sha256(tmp / "final" / "model.safetensors"),
                    "bytes": (tmp / "final" / "model.safetensors").stat().st_size, "commit": commit,
                    "steps": steps, "from": which,
                    "loaded_against": target}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if dest.exists():  # --replace: the old copy moves aside first, and goes once the new one is in place
            old = dest.with_name(f".ship_old_{dest.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only what this call wrote; gone already once it is dest


def recover(dest: Path) -> None:
    """What a killed ship left next to ``dest``: its staging directories (``.ship_<pid>_*`` of a process that is
    gone) are removed, and a copy moved aside by ``--replace`` (``.ship_old_<name>``) is put back when the new one
    never arrived, or removed when it did. Each is said; nothing else is touched."""
    for d in dest.parent.glob(".ship_*_*"):
        pid = d.name.split("_")[1]
        if d.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            print(f"ship: removed {d} (the staging of a ship that was killed, pid {pid})", file=sys.stderr)
    old = dest.with_name(f".ship_old_{dest.name}")
    if old.is_dir() and not dest.exists():
        os.replace(old, dest)
        print(f"ship: put back {dest} (a killed --replace had moved it aside)", file=sys.stderr)
    elif old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
        print(f"ship: removed {old} (the copy a finished --replace had moved aside)", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def _stage(run: Path, final: Path, tmp: Path, target: str | None) -> None:
    """The fp16 copy of ``final`` (a drafter directory of ``run``) as ``tmp/final`` and the run's training record,
    in ``tmp``; loaded against ``target``."""
    (tmp / "final").mkdir()
    for f in final.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, tmp / "final" / f.name)
    weights = final / "model.safetensors"
    try:
        state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors' own error (truncated, not safetensors) names no file
        raise ValueError(f"{weights}: unreadable safetensors file ({type(e).__name__}: {e}); {DAMAGED_FIX}") from None
    try:
        fp16 = to_fp16(state)
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from None
    save_file(fp16, str(tmp / "final" / "model.safetensors"))
    for name in RECORD:
        if (run / name).exists():
            shutil.copy2(run / name, tmp / name)
    if target is not None:  # loads as a drafter of its target
        from models.core.target import FrozenTarget
        from models.registry import load_drafter

        load_drafter(tmp / "final", FrozenTarget.from_pretrained(target))


def _last_step(path: Path) -> int | None:
    if not path.exists():
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (offset {e.start}); {DAMAGED_FIX}") from None
    steps = []
    for n, x in enumerate(lines, 1):
        if not x.strip():
            continue
        try:
            rec = json.loads(x)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n} is not valid JSON ({e}); {DAMAGED_FIX}") from None
        steps.append(rec.get("step") if isinstance(rec, dict) else None)
    return max((s for s in steps if s is not None), default=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run directory (its final/ and training record)")
    ap.add_argument("dest", type=Path, help="where the shipped copy goes (must not exist)")
    ap.add_argument("--recipe", help="the recipe that trained it, for the manifest")
    ap.add_argument("--target", help="load the copy against this target (e.g. the GGUF-converted directory)")
    ap.add_argument("--best", action="store_true", help="ship the run's best/ (train.keep_best) instead of final/")
    ap.add_argument("--replace", action="store_true", help="replace an earlier shipped copy at dest")
    a = ap.parse_args(argv)
    try:
        m = ship(a.run, a.dest, a.recipe, a.target, "best" if a.best else "final", a.replace)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"shipped {a.run} → {a.dest} ({m['bytes'] / 1e6:.1f} MB fp16, steps {m['steps']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
