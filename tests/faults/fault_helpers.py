"""Fault-injection helpers: a config factory (shapes as in tests/test_train_loop.py) and weight/metrics checks.
The tiny target on disk is the ``target_dir`` fixture of tests/conftest.py. (Not a conftest.py: a second module
named ``conftest`` would shadow tests/conftest.py for the tests that ``from conftest import ...``.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def cfg_for(target_dir, out, *overrides, config="config"):
    base = [f"target.name_or_path={target_dir}", f"output_dir={out}", "tracking=none",
            "data.max_rows=24", "data.val_rows=4", "data.max_len=48", f"data.cache_dir={out}/data",
            "train.steps=4", "train.batch_size=2", "train.ckpt_every=2", "train.log_every=1",
            "train.eval_every=100", "optim.warmup_steps=1", "draft=eagle3",
            "draft.config.draft_vocab_size=200", "draft.config.ttt_steps=3", "draft.config.layer_ids=[1,2,3]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config, overrides=base + list(overrides))


def weights(d) -> dict[str, torch.Tensor]:
    return load_file(str(Path(d) / "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0, msg=k)


def metrics_steps(out) -> list[int]:
    """Steps in metrics.jsonl, parsed strictly (bare NaN/Infinity tokens are not JSON)."""
    def no_const(c):
        raise ValueError(f"non-JSON constant {c}")

    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x, parse_constant=no_const)["step"] for x in lines if x.strip()]
