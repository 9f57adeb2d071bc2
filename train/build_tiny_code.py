"""Build the embedded default target, `tiny-code`, from the Python standard library source.

    python -m train.build_tiny_code --out models/tiny_code            # everything (~80 min, 2 cores)
    python -m train.build_tiny_code --out /tmp/t --steps 3 --tiny    # a smoke run (tests do this)
    python -m train.build_tiny_code --draft --out runs/tiny_code_draft  # eval draft-model baseline (~6 min)

``--draft`` trains a 2-layer model on the same data with tiny-code's own tokenizer (copied, so token ids
match): the "separate small draft model" baseline of the eval harness and HF assisted generation.

Stages, each resumable: held-out split + manifest → tokenizer → training (atomic checkpoints
every ``--ckpt-every`` steps; rerunning the command resumes) → fp16 safetensors export → held-out
loss. The shipped result lives in ``models/tiny_code/`` so no user has to run this.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from data import corpus
from models.core.target import EMBEDDED_DIR
from models.core.tokenizer import train_tokenizer


@dataclass
class Recipe:
    vocab_size: int = 8192
    hidden_size: int = 320
    intermediate_size: int = 864
    num_hidden_layers: int = 8
    num_attention_heads: int = 5
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.1
    steps: int = 1400
    ckpt_every: int = 100
    seed: int = 0
    compile: bool = True
    threads: int = 0  # 0: torch default

    @classmethod
    def draft(cls) -> Recipe:
        # ~1/5 of tiny-code's per-token cost; its lm_head [8192, 256] is most of it
        return cls(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                   lr=3e-3, warmup=30, steps=300, ckpt_every=50)

    @classmethod
    def tiny(cls, steps: int = 3) -> Recipe:
        return cls(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, seq_len=32, batch_size=2, steps=steps, warmup=1,
                   ckpt_every=2, compile=False)


def model_config(r: Recipe, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_hidden_layers,
        num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_attention_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def stage_data(out: Path, files: list[corpus.SourceFile] | None = None) -> list[corpus.SourceFile]:
    files = files if files is not None else corpus.iter_stdlib_files()
    train, held = corpus.split_files(files)
    corpus.write_heldout(held, out / "heldout.jsonl")
    (out / "manifest.json").write_text(json.dumps(corpus.manifest(train, held), indent=1))
    return train


def stage_tokenizer(out: Path, train: list[corpus.SourceFile], vocab_size: int) -> PreTrainedTokenizerFast:
    if (out / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(out)
    tok = train_tokenizer((f.text for f in train), vocab_size=vocab_size)
    tok.save_pretrained(out)
    return tok


def token_stream(tok: PreTrainedTokenizerFast, train: list[corpus.SourceFile]) -> np.ndarray:
    """All training files as one stream: <bos> file <eos> <bos> file <eos> …"""
    ids: list[int] = []
    for f in train:
        ids.append(tok.bos_token_id)
        ids.extend(tok(f.text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int32)


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    progress = (step - r.warmup) / max(1, r.steps - r.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * cos)


def batch_at(stream: np.ndarray, step: int, r: Recipe) -> torch.Tensor:
    # Windows drawn from a generator seeded by (seed, step): the data order is a pure function
    # of the step, so resuming needs no saved RNG state.
    rng = np.random.default_rng([r.seed, step])
    starts = rng.integers(0, len(stream) - r.seq_len - 1, size=r.batch_size)
    return torch.from_numpy(np.stack([stream[s : s + r.seq_len + 1] for s in starts]).astype(np.int64))


def save_ckpt(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # atomic: a kill leaves either the old or the new checkpoint


def stage_train(out: Path, r: Recipe, tok: PreTrainedTokenizerFast, train: list[corpus.SourceFile]) -> LlamaForCausalLM:
    work = out / "build"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(r.seed)
    model = LlamaForCausalLM(model_config(r, tok))
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=r.weight_decay)
    ckpt = work / "last.pt"
    start = 0
    if ckpt.exists():
        # Our own file, written by this script; weights_only keeps it from running code.
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    stream = token_stream(tok, train)
    log = open(work / "train_log.jsonl", "a")
    v = model.config.vocab_size

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=x[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, v).float(), x[:, 1:].reshape(-1))

    step_fn = torch.compile(loss_fn) if r.compile else loss_fn
    model.train()
    t0, toks = time.time(), 0
    bar = tqdm(range(start, r.steps), initial=start, total=r.steps, desc="tiny-code", mininterval=10)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        loss = step_fn(batch_at(stream, step, r))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        toks += r.batch_size * r.seq_len
        if step % 10 == 0 or step == r.steps - 1:
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr_at(step, r),
                   "tok_per_s": round(toks / (time.time() - t0), 1), "stream_tokens": len(stream)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=rec["loss"], tps=rec["tok_per_s"])
        if (step + 1) % r.ckpt_every == 0 or step == r.steps - 1:
            save_ckpt(ckpt, model, opt, step + 1)
    log.close()
    return model


def stage_export(out: Path, model: LlamaForCausalLM, r: Recipe) -> None:
    sd = model.state_dict()
    peak = max(t.abs().max().item() for t in sd.values())
    assert peak < 6e4, f"weight magnitude {peak} would overflow fp16"
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    model.float()
    (out / "recipe.json").write_text(json.dumps(asdict(r), indent=1))
    shutil.copy(out / "build" / "train_log.jsonl", out / "train_log.jsonl")


def build(out: Path, r: Recipe, files: list[corpus.SourceFile] | None = None,
          tokenizer_from: Path | None = None) -> dict:
    """All stages; ``tokenizer_from``: reuse that directory's tokenizer (a draft model for a target must
    share its token ids) instead of training one."""
    from data.perplexity import heldout_loss

    out.mkdir(parents=True, exist_ok=True)
    if r.threads:
        torch.set_num_threads(r.threads)
    if tokenizer_from is not None and not (out / "tokenizer.json").exists():
        PreTrainedTokenizerFast.from_pretrained(tokenizer_from).save_pretrained(out)
    train = stage_data(out, files)
    tok = stage_tokenizer(out, train, r.vocab_size)
    model = stage_train(out, r, tok, train)
    stage_export(out, model, r)
    shipped = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    result = heldout_loss(shipped, tok, corpus.load_heldout(out / "heldout.jsonl"), seq_len=r.seq_len)
    (out / "heldout_loss.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=EMBEDDED_DIR)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny config for smoke tests")
    p.add_argument("--draft", action="store_true",
                   help="2-layer draft model, tiny-code tokenizer (default --out runs/tiny_code_draft)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    r = Recipe.tiny() if a.tiny else Recipe.draft() if a.draft else Recipe()
    if a.draft and a.out == EMBEDDED_DIR:
        a.out = Path("runs/tiny_code_draft")
    if a.steps is not None:
        r.steps = a.steps
    if a.no_compile:
        r.compile = False
    r.threads = a.threads
    print(json.dumps(build(a.out, r, tokenizer_from=EMBEDDED_DIR if a.draft else None), indent=1))


if __name__ == "__main__":
    main()
