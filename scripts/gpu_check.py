"""The GPU check, one command for the day a CUDA machine is available (`make gpu-check`).

    python scripts/gpu_check.py                       # cuda, bf16: every recipe a few steps, then decode
    python scripts/gpu_check.py --device cpu --dtype float32 --steps 2 --new-tokens 8   # smoke run on CPU

For every trainable method (models/registry.py) it trains the recipe for ``--steps`` steps on the target (default
the embedded tiny-code) in ``--dtype``, then decodes held-out prompts with AR, the n-gram proposer and every
trained drafter at T=0 (lossless check against AR, within the dtype's measured noise) and prints absolute
tokens/s per method at batch 1 and the batched tokens/s of the chain methods, one-row decoding on the step
``--decode-step`` picks (auto: the compiled static-cache step where it is faster, models/core/static_kv.py).
Results: OUT/results.json. Exits non-zero when a method is not lossless. CI never runs it (no GPU there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.bench.benchmark import run_benchmark, write_json  # noqa: E402
from eval.bench.decode_step import choose_decode_step  # noqa: E402
from eval.bench.setup import BenchSettings, build_methods, load_prompts  # noqa: E402
from models import registry  # noqa: E402
from models.core.proposal import MAX_TREE_NODES  # noqa: E402
from models.core.target import FrozenTarget  # noqa: E402
from train.loop import run as train_run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-code")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--decode-step", default="auto", help="eager | compiled | auto (eval/bench/decode_step.py)")
    ap.add_argument("--out", default="runs/gpu_check")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here (pass --device cpu --dtype float32 for a smoke run)", file=sys.stderr)
        return 2
    out = Path(args.out)
    tgt = [f"target.name_or_path={args.target}", f"target.device={args.device}", f"target.dtype={args.dtype}"]
    ckpts = {}
    for method in registry.trainable_methods():
        over = [f"+recipe={method}", *tgt, f"output_dir={out / method}", "tracking=none", f"train.steps={args.steps}",
                f"train.ckpt_every={args.steps}", f"train.eval_every={args.steps + 1}", "train.eval_rows=8",
                "optim.warmup_steps=1", "data.max_rows=256", "data.regenerate=8", "train.resume=false"]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=over)
        print(f"== train {method} ({args.steps} steps, {args.dtype} on {args.device})", flush=True)
        train_run(cfg)
        ckpts[method] = str(out / method / "final")
    target = FrozenTarget.from_pretrained(args.target, dtype=args.dtype, device=args.device)
    prompts = load_prompts(target.tokenizer, args.prompts, 128)
    step = choose_decode_step(target, args.decode_step, 128 + args.new_tokens + MAX_TREE_NODES + 1)
    print(f"== decode step: {step}", flush=True)
    names = [p for p, (spec, _) in registry.proposers().items() if spec.source == "none" or spec.name in ckpts]
    methods, skipped = build_methods(target, names, ckpts)
    settings = BenchSettings(max_new_tokens=args.new_tokens, temperatures=[0], repetitions=1, warmup=1,
                             batch_sizes=[1, 8], peers=False, cost_reps=2, progress=False)
    results = run_benchmark(target, methods, prompts, settings, skipped)
    write_json(results, out / "results.json")
    print(f"\n{'method':14s} {'tau':>6s} {'tokens/s':>10s} {'speedup':>8s} lossless")
    for e in results["runs"]:
        print(f"{e['method']:14s} {e['tau']:6.2f} {e['tokens_per_s']['median']:10.1f} "
              f"{e['speedup']['median']:7.2f}x {e['lossless']}")
    for name, m in ((results.get("batch") or {}).get("methods") or {}).items():
        print(f"{name:14s} batched: " + ", ".join(f"B={x['batch_size']} {x['speedup']['median']:.2f}x"
                                                  for x in m["by_batch"]))
    print(json.dumps({"lossless": results["lossless"], "results": str(out / "results.json")}))
    return 0 if results["lossless"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
