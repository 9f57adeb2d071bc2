"""Fault-injection helpers: a config factory (shapes as in tests/test_train_loop.py) and weight/metrics checks.
The tiny target on disk is the ``target_dir`` fixture of tests/conftest.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
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


PAGE = 4096


@contextmanager
def small_tmpfs(path: Path, size: str = "4m", readonly: bool = False):
    """A real tmpfs of ``size`` mounted at ``path`` (remounted read-only with ``readonly``: root ignores
    permission bits, not a read-only mount). Skips the test where mounting is impossible (not root, no
    CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_readonly(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def fill_disk(path: Path, leave: int = 0) -> Path:
    """Fill the file system holding ``path`` with a filler file until ENOSPC, then give back ``leave`` bytes
    (rounded up to pages): the next larger write fails with a real 'No space left on device'."""
    filler = path / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 20, PAGE, 1):
            block = b"\0" * chunk
            while True:
                try:
                    os.write(fd, block)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)
    if leave:
        size = filler.stat().st_size
        os.truncate(filler, max(0, size - -(-leave // PAGE) * PAGE))
    return filler


def one_error_line(capsys) -> str:
    """The single ``error:`` line a CLI printed (no traceback)."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def eval_error(target, out: Path, capsys, monkeypatch, *overrides: str) -> str:
    """``python -m eval`` (in process, AR for 2 tokens) on a ``target`` or ``overrides`` that must be refused: exit
    2, no results written, and its one error line."""
    import sys

    from eval.__main__ import main

    monkeypatch.setattr(sys, "argv", ["eval", "methods=[ar]", f"target.name_or_path={target}", f"out_dir={out}",
                                      "n_prompts=2", "max_new_tokens=2", "batch_sizes=[]", "peers=false",
                                      "decode_step=eager", *overrides])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert not (Path(out) / "results.json").exists()
    return one_error_line(capsys)


def eval_prompts_error(target_dir, prompts: Path, out: Path, capsys, monkeypatch) -> str:
    """``python -m eval`` on a prompts file that must be refused: exit 2 and its one error line."""
    return eval_error(target_dir, out, capsys, monkeypatch, f"prompts={prompts}")


def write_small_gguf(path, note: str):
    """A whole GGUF file holding one small tensor and ``note``: what ``check_gguf`` parses, for tests of the
    manifest that need no llama.cpp converter (``note`` makes two such files differ)."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_string("draftsmith.test_note", note)
    w.add_tensor("note.weight", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def package_source(tmp_path, monkeypatch, alias: str, module: str, rel: str) -> Path:
    """An importable package ``module`` shipping the file ``rel``, registered as the data alias ``alias`` (what a
    PyPI data package looks like to data/packaged.py); the file's path, for the test to write."""
    from data.packaged import PACKAGE_SOURCES

    pkg = tmp_path / "site" / module
    (pkg / Path(rel).parent).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(PACKAGE_SOURCES, alias, (f"{module.replace('_', '-')}==0.0.1", module, rel))
    return pkg / rel
