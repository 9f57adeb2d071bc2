"""vLLM-CPU/GPU as regeneration's generator: one engine kept warm, batches of token-id prompts in, new tokens out.

Runs in vLLM's own venv (scripts/install_vllm_cpu.sh → .venv-vllm), by its path, and imports nothing from draftsmith;
data/regen_vllm.py starts it and speaks to it in JSON lines:

    .venv-vllm/bin/python eval/engines/vllm_generate.py '{"model": DIR, "dtype": "float32", "max_model_len": N,
                                                         "max_num_seqs": 64}'

It answers ``{"ready": true, "vllm": version}`` once the engine is built, then one line per request line:

    in:  {"prompts": [[ids...]], "seeds": [int...], "temperature": t, "max_new_tokens": n, "stop_token_ids": [...]}
    out: {"outputs": [[ids...]]}   (or {"error": "..."}; the worker stays up)

A reply ends at the first of ``stop_token_ids`` (kept, as models/core/generate.py keeps it) or after
``max_new_tokens``: the model's own eos is not added (``ignore_eos``), so both backends stop on the same ids. Sampling
is pure temperature (top-k/top-p off), each prompt with its own seed. The protocol goes to the process's original
stdout; everything else (vLLM's logs, prints) is sent to stderr so it cannot corrupt a reply.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# set in main(), before vLLM is imported (importing this file elsewhere, e.g. for _with_stop, changes no environment)
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
              "VLLM_NO_USAGE_STATS": "1"}


def _reply(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _with_stop(ids: list[int], stop_reason, stops: set[int]) -> list[int]:
    """The reply cut after its first stop token, that token kept (vLLM leaves a stop_token_ids hit out of
    ``token_ids`` in some versions and keeps it in others)."""
    for j, t in enumerate(ids):
        if t in stops:
            return ids[: j + 1]
    if isinstance(stop_reason, int) and stop_reason in stops:
        return ids + [stop_reason]
    return ids


def generate(llm, req: dict) -> list[list[int]]:
    from vllm import SamplingParams

    stops = [int(s) for s in req["stop_token_ids"]]
    temp = float(req["temperature"])
    params = [SamplingParams(temperature=temp, seed=int(s),  # top-k/top-p: vLLM's defaults, both off
                             max_tokens=int(req["max_new_tokens"]), stop_token_ids=stops, ignore_eos=True,
                             detokenize=False)
              for s in req["seeds"]]
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in req["prompts"]], params, use_tqdm=False)
    return [_with_stop(list(o.outputs[0].token_ids), o.outputs[0].stop_reason, set(stops)) for o in outs]


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[1])
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    proto = os.fdopen(os.dup(1), "w")  # replies go here; fd 1 becomes stderr for everything else
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm
    from vllm import LLM

    llm = LLM(model=cfg["model"], dtype=cfg.get("dtype", "float32"), max_model_len=int(cfg["max_model_len"]),
              max_num_seqs=int(cfg.get("max_num_seqs", 64)), enforce_eager=bool(cfg.get("enforce_eager", True)),
              skip_tokenizer_init=True, seed=0, trust_remote_code=False)
    _reply(proto, {"ready": True, "vllm": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            _reply(proto, {"outputs": generate(llm, json.loads(line))})
        except Exception as e:  # noqa: BLE001 - the caller raises it with the engine's own words
            _reply(proto, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
