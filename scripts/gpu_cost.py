"""What the GPU recipe costs on one GPU, measured: conf/recipe/eagle3_gpu.yaml's own pipeline (the target answers
ShareGPT prompts, then EAGLE-3 trains against it, online) for a target of Llama-3.1-8B-Instruct's shape.

    python scripts/gpu_cost.py --source sharegpt.jsonl --rows 400 --regenerate 128 --steps 30 --out runs/gpu_cost
    python scripts/gpu_cost.py --shape tiny --device cpu --rows 40 --regenerate 4 --steps 2   # smoke run on CPU

No model hub is reachable on the machines this project runs on, so the target is built in code with random weights:
every matrix product, byte read and token of the real model's shape is there, the text it writes is not (its
replies never end early, so regeneration is timed at full length: an upper bound). The tokenizer is SmolLM2's
(49152 ids inside Llama 3's 128256-row embedding). The numbers it writes (OUT/cost.json) are the recipe's rates on
this GPU: regenerated tokens/s, and target tokens/s through a training step; with them, the hours of the recipe's
40k steps and of regenerating and training on ShareGPT at the EAGLE papers' scale.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.core.target import FrozenTarget  # noqa: E402
from train.loop import run as train_run  # noqa: E402

SHAPES = {  # Llama-3.1-8B-Instruct's config.json; "tiny" for a CPU smoke run
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, rope_theta=10000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=4096, tie_word_embeddings=False),
}
# ShareGPT at the EAGLE papers' scale (EAGLE-3: ShareGPT + UltraChat-200k), as conversations
SCALES = {"sharegpt_68k": 68_000, "sharegpt_ultrachat_532k": 532_000}
ARGS: argparse.Namespace | None = None


def random_target(name_or_path: str, dtype: str = "bfloat16", trust_remote_code: bool = False, device: str = "cuda",
                  gguf_file: str | None = None) -> FrozenTarget:
    """The recipe's ``target`` (Hydra ``_target_``): a Llama of ``name_or_path``'s shape, random weights, seed 0."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(ARGS.tokenizer)
    cfg = LlamaConfig(**SHAPES[name_or_path], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg._name_or_path = f"random-{name_or_path}"
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    print(f"gpu_cost: random {name_or_path} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, "
          f"{dtype}, {device}) built in {time.time() - t0:.0f} s", flush=True)
    return FrozenTarget(model.eval().requires_grad_(False), tok)


def regen_rate(cache_dir: Path) -> dict:
    """Generated tokens and seconds from the regeneration ledgers beside the cache (models/core/generate.py)."""
    secs = toks = 0.0
    for f in glob.glob(str(cache_dir / "ledger_*.jsonl")):
        for line in Path(f).read_text().splitlines():
            r = json.loads(line)
            secs += r.get("seconds", 0.0)
            toks += r.get("new_tokens", r.get("generated_tokens", 0))
    return {"seconds": round(secs, 1), "new_tokens": int(toks), "tokens_per_s": round(toks / secs, 1) if secs else None}


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", default=str(ROOT / ".gpu" / "tokenizer"))
    ap.add_argument("--source", default=str(ROOT / ".gpu" / "sharegpt.jsonl"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--regenerate", type=int, default=128)
    ap.add_argument("--regen-new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="runs/gpu_cost")
    ARGS = args = ap.parse_args()
    out = Path(args.out)
    over = ["+recipe=eagle3_gpu", "target._target_=__main__.random_target", f"target.name_or_path={args.shape}",
            f"target.device={args.device}", f"data.source={args.source}", f"data.max_rows={args.rows}",
            "data.val_rows=8", f"data.regenerate={args.regenerate}", f"data.regen_new_tokens={args.regen_new_tokens}",
            f"output_dir={out}", "tracking=none", f"train.steps={args.steps}", f"train.ckpt_every={args.steps}",
            f"train.eval_every={args.steps + 1}", "train.eval_rows=8", "train.log_every=1", "train.resume=false"]
    if args.device == "cpu":
        over += ["target.dtype=float32", "draft.config.draft_vocab_size=512"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=over)
    t0 = time.time()
    train_run(cfg)
    wall = time.time() - t0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    stats = json.loads((out / "data_stats.json").read_text())
    steady = recs[len(recs) // 3:]  # after the first third: allocator and kernel choices settled
    step_s = (steady[-1]["elapsed_s"] - steady[0]["elapsed_s"]) / max(steady[-1]["step"] - steady[0]["step"], 1)
    tok_step = (steady[-1]["tokens_seen"] - steady[0]["tokens_seen"]) / max(steady[-1]["step"] - steady[0]["step"], 1)
    regen = regen_rate(Path(cfg.data.cache_dir))
    tok_per_conv = stats["train_target_tokens"] / max(stats["train_rows"], 1)
    train_tps = tok_step / step_s
    res = {"gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "shape": args.shape, "recipe": "eagle3_gpu", "wall_s": round(wall, 1),
           "regeneration": {**regen, "batch": cfg.data.regen_batch_size, "new_tokens_per_reply": args.regen_new_tokens},
           "training": {"steps": args.steps, "rows_per_step": cfg.train.batch_size * cfg.train.grad_accum,
                        "step_s": round(step_s, 3), "target_tokens_per_step": round(tok_step),
                        "target_tokens_per_s": round(train_tps), "ttt_steps": cfg.draft.config.ttt_steps,
                        "draft_vocab": cfg.draft.config.draft_vocab_size, "max_len": cfg.data.max_len},
           "data": {"train_rows": stats["train_rows"], "target_tokens_per_conversation": round(tok_per_conv)},
           "recipe_40k_steps_h": round(cfg.train.steps and 40000 * step_s / 3600, 1)}
    if regen["tokens_per_s"]:
        res["at_scale"] = {name: {"conversations": n, "regenerate_h": round(n * tok_per_conv / regen["tokens_per_s"]
                                                                            / 3600, 1),
                                  "train_h_per_epoch": round(n * tok_per_conv / train_tps / 3600, 1)}
                           for name, n in SCALES.items()}
    (out / "cost.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
