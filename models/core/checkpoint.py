"""A drafter directory on disk (core: training writes it, eval and export read it).

``config.json`` is self-describing (method, draft config, target identity, layer ids, step) and
``model.safetensors`` holds the trainable weights and buffers; weights copied from the frozen target
(embedding, shared heads) are never stored. train/checkpoint.py adds the resumable trainer state.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class NoSpaceError(OSError):
    """The disk filled up while writing; one line naming where. Every writer (checkpoints, final/, exports, the
    feature and regeneration caches, eval results) turns its disk-full error into this."""

    def __init__(self, path: Path | str, fix: str = "free space, or lower train.keep_ckpts"):
        super().__init__(errno.ENOSPC, f"no space left on device at {path} ({fix})")

    def __str__(self) -> str:
        return self.strerror


# what a full disk looks like from each writer: OSError(ENOSPC) from Python's own I/O; safetensors' Rust writer:
# SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"); torch's zip
# writer: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
_NO_SPACE_TEXT = ("No space left on device", "os error 28", "unexpected pos")


def is_out_of_space(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) is a full disk, whichever writer raised it."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if isinstance(e, Exception) and any(t in str(e) for t in _NO_SPACE_TEXT):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


class out_of_space_as_error:
    """Context manager: a full disk while writing under ``path`` becomes NoSpaceError (one line)."""

    def __init__(self, path: Path | str, fix: str = "free space, or lower train.keep_ckpts"):
        self.path, self.fix = path, fix

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if e is None or isinstance(e, NoSpaceError):
            return False
        named = _named_no_space(e)
        if named is not None:  # a writer below named its own path (and Hydra's instantiate wrapped it)
            raise named from None
        if is_out_of_space(e):
            raise NoSpaceError(self.path, self.fix) from None
        return False


def file_sha256(path: Path | str) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks (shipped weights, GGUF exports: hundreds of MB)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path | str, data: bytes | str, fix: str = "free space") -> None:
    """``data`` → ``path`` through a temp file and one rename: a kill leaves the old file or the new, never a torn
    or empty one (manifests, ledgers, JSON records that git tracks)."""
    import os

    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with out_of_space_as_error(path, fix):
            with open(tmp, "wb") as fh:
                fh.write(data.encode() if isinstance(data, str) else data)
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _named_no_space(e: BaseException) -> NoSpaceError | None:
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, NoSpaceError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def nonfinite_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding NaN or inf (integer and bool tensors cannot)."""
    return [k for k, v in tensors.items()
            if (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all())]


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or inf, or None: one reduction per tensor, stopping
    at the first bad one (a whole target is checked at every load)."""
    return next((k for k, v in named
                 if (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all())), None)


def check_finite(tensors: Mapping[str, torch.Tensor], where: str | Path) -> None:
    """Refuse NaN/inf weights: a diverged drafter must never be saved, exported, validated or evaluated."""
    bad = nonfinite_tensors(tensors)
    if bad:
        raise ValueError(f"{where}: {len(bad)} of {len(tensors)} tensors hold NaN/inf (e.g. {bad[:3]}): the drafter "
                         "diverged; retrain it (lower optim.optimizer.lr)")


def trainable_state(module: nn.Module, packed: bool = True) -> dict[str, torch.Tensor]:
    """Trainable parameters and all buffers; frozen parameters (copied from the target) are skipped, except those a
    module lists in ``saved_frozen`` (frozen, but chosen per drafter: e.g. EAGLE-3's target-copied lm_head rows).
    ``packed``: as stored, through the module's ``pack_state`` when it has one (e.g. only the changed rows of a
    trainable target-initialised embedding); ``load_trainable_state`` undoes it with ``unpack_state``."""
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} - set(getattr(module, "saved_frozen", ()))
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items() if k not in frozen}
    pack = getattr(module, "pack_state", None)
    return pack(state) if packed and pack is not None else state


def load_trainable_state(module: nn.Module, path: Path) -> None:
    """Load ``model.safetensors``; every trainable weight and buffer must be present, nothing extra."""
    try:
        state = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated/corrupt file: name it, not only the reader's complaint
        raise ValueError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e}); it is truncated or "
                         "corrupt — retrain or restore it") from None
    check_finite(state, path)
    unpack = getattr(module, "unpack_state", None)
    if unpack is not None:
        try:
            state = unpack(state)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    expected = set(trainable_state(module, packed=False))
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(f"{path}: weights do not match the drafter (missing {missing[:5]}, unexpected {extra[:5]})")
    own = module.state_dict()
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, the drafter expects {tuple(own[k].shape)}")
    module.load_state_dict(state, strict=False)


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / CONFIG}: not valid JSON ({e}); the checkpoint is corrupt") from None


def check_writable_dir(path: Path | str, key: str) -> None:
    """``path`` exists (created if needed) and takes a file: else one ValueError line naming ``key`` (a read-only
    mount, no permission) or NoSpaceError (a full disk). The probe file is removed again."""
    path = Path(path)
    probe = path / f".draftsmith-probe-{__import__('os').getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with out_of_space_as_error(path, "free space"):
            probe.write_text("probe\n")
    except NoSpaceError:
        probe.unlink(missing_ok=True)
        raise
    except OSError as e:
        raise ValueError(f"{key} {path} is not writable ({e.strerror or e}); choose another {key}") from None
    probe.unlink()


class WritableDirCheck:
    """A Hydra callback (``hydra.callbacks`` in conf/config.yaml and conf/eval.yaml): Hydra creates its run
    directory inside ``output_dir`` / ``out_dir`` before the program runs, and a read-only or full one would be
    Hydra's traceback (exit 1). This checks it first: one ``error:`` line naming the key, exit 2."""

    def __init__(self, key: str):
        self.key = key

    def on_run_start(self, config, **kwargs) -> None:
        import sys

        try:
            check_writable_dir(str(config[self.key]), self.key)
        except (ValueError, NoSpaceError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    def __getattr__(self, name: str):  # the other Callback hooks: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)
