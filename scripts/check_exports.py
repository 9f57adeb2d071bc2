"""Round-trip every export format of real trained checkpoints (default: runs/{eagle3,medusa,mtp}/final).

    python scripts/check_exports.py [--runs runs] [--prompts 4] [--rounds 12]

For each checkpoint and each format its method exports to: export → validate against the target → load the
export back (models.export.load_export, which reads only what engines read) → drive the training checkpoint's
proposer and the export's proposer through the same speculative-decoding rounds on held-out prompts and
require identical proposals (tokens and tree shape) in every round. Prints one line per format and exits
non-zero on any difference. The unit tests do the same on tiny models; this is the check on real weights.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from data.corpus import heldout_prompts
from eval.decode.ladder import accept_proposal, new_cache
from eval.decode.single import commit_kv, prefill, verify_forward
from models import registry
from models.core.proposal import Sampling
from models.core.target import FrozenTarget
from models.export.api import export, load_export
from models.export.shared.common import ExportError
from models.registry import load_drafter


def _proposer(method: str, drafter, target: FrozenTarget, ckpt: Path):
    """The method's first proposer with its defaults (its prepare step reads e.g. Medusa's saved tree)."""
    name = registry.method(method).proposers[0].name
    return registry.make_proposer_factory(name, drafter, target, str(ckpt))[0](None)


@torch.no_grad()
def same_proposals(target: FrozenTarget, a, b, prompt: torch.Tensor, rounds: int) -> tuple[bool, int]:
    """Run greedy speculative decoding with proposer ``a``; at every round also ask ``b`` (fed identically)."""
    s = Sampling(0.0)
    cache = new_cache(target)
    pre = prefill(target, prompt, cache, a.layer_ids)
    root = pre.logits[:, -1].argmax(-1)
    ctx = torch.cat([prompt[0], root])[None]
    a.begin(ctx, pre.hidden, s)
    b.begin(ctx, pre.hidden, s)
    for r in range(rounds):
        pa, pb = a.propose(8), b.propose(8)
        if not torch.equal(pa.tokens, pb.tokens) or (pa.parents is None) != (pb.parents is None) or (
                pa.parents is not None and not torch.equal(pa.parents, pb.parents)):
            return False, r
        n0 = cache.get_seq_length()
        ver = verify_forward(target, cache, root, pa, a.layer_ids)
        path, nxt = accept_proposal(pa, ver.logits[0], s)
        commit_kv(cache, n0, path)
        new = torch.cat([pa.tokens[path], torch.tensor([nxt])])
        rows = torch.tensor([0, *(j + 1 for j in path)])
        hidden = {k: v.index_select(1, rows) for k, v in ver.hidden.items()}
        a.accept(new[None], hidden)
        b.accept(new[None], hidden)
        root = new[-1:]
    return True, rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    target = FrozenTarget.from_pretrained("tiny-code")
    prompts = [p["input_ids"] for p in heldout_prompts(target.tokenizer, args.prompts, 128)]
    ok = True
    for method in registry.trainable_methods():
        fmts = [f.name for f in registry.method(method).export_formats]
        ckpt = Path(args.runs) / method / "final"
        if not (ckpt / "model.safetensors").exists():
            print(f"{method:7s} -- no checkpoint at {ckpt}, skipped")
            continue
        drafter, meta = load_drafter(ckpt, target)
        for fmt in fmts:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    out = export(drafter, fmt, Path(tmp) / fmt, target, target_name="tiny-code", meta=meta)
                except ExportError as e:
                    print(f"{method:7s} {fmt:22s} refused: {e}")
                    continue
                back = load_export(out, target)
                files = sorted(p.name for p in out.iterdir())
                results = []
                for ids in prompts:
                    ids = torch.as_tensor(ids).view(1, -1)
                    results.append(same_proposals(target, _proposer(method, drafter, target, ckpt),
                                                  _proposer(method, back, target, ckpt), ids, args.rounds))
                good = all(r[0] for r in results)
                ok &= good
                print(f"{method:7s} {fmt:22s} {'identical' if good else 'DIFFERENT'} proposals over "
                      f"{len(prompts)} prompts x {args.rounds} rounds; files {files}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
