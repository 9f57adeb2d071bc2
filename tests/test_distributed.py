"""Two processes on CPU (gloo) under torchrun with DeepSpeed ZeRO-2: trains, checkpoints, resumes."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_two_process_deepspeed_run_and_resume(tmp_path, tiny_llama, tiny_tokenizer):
    tdir = tmp_path / "target"
    tiny_llama.save_pretrained(tdir)
    tiny_tokenizer.save_pretrained(tdir)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "train",
            f"target.name_or_path={tdir}", f"output_dir={out}", "tracking=none", "deepspeed=zero2",
            "data.max_rows=24", "data.val_rows=4", "data.max_len=48", f"data.cache_dir={out}/data",
            "train.steps=4", "train.batch_size=2", "train.ckpt_every=2", "train.log_every=1",
            "draft.config.draft_vocab_size=200", "draft.config.ttt_steps=2", "draft.config.layer_ids=[1,2,3]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    first = subprocess.run(args + ["train.stop_after=2"], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step_0000002" / "ds").is_dir()  # sharded engine state from both ranks
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and (out / "final" / "model.safetensors").exists()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # rank 0 logs each step once; the resumed run starts at 3
