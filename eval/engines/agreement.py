"""Does the converted target compute what llama.cpp computes on the same GGUF? Greedy continuations, token by token.

    python -m eval.engines.agreement --target gemma3_270m --prompts humaneval --n-prompts 32 --max-new-tokens 32 \\
        --out bench/gemma3/agreement

A GGUF target (``smollm2``, ``gemma3_270m``) is dequantized once into an HF directory, and every harness number is
against that model. llama.cpp runs the quantized file itself, with its own kernels (quantized dot products over
8-bit activations), so the two agree exactly only where the target's choice is clear. Each prompt goes to
``llama-server`` as token ids (no re-tokenization) and is decoded greedily by both; at the first token where they
part, both top-2 logit gaps are reported: the harness's (from the dequantized model in fp32) and the engine's (its
``n_probs``). A divergence at a gap of ~1e-2 is a near tie that the two kernels break differently; at an ordinary gap
it is a conversion error. Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path


def harness_gaps(target, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """The dequantized target's top-2 logit gap (fp32) before each token of its own continuation, in one
    teacher-forced forward: where its choice is clear and where it is a near tie."""
    import torch

    ids = torch.tensor([[*prompt, *tokens[:-1]]])
    with torch.no_grad():
        logits = target.model(ids).logits[0, len(prompt) - 1 :].float()
    top = torch.topk(logits, 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def measure(target_name: str, prompts_from: str, n_prompts: int, prompt_tokens: int, max_new: int,
            threads: int = 1) -> dict:
    from eval.bench.setup import load_prompts
    from eval.engines import llamacpp_server as LS
    from eval.engines.serving import ar_outputs
    from models.core.gguf import gguf_file_of
    from models.core.target import FrozenTarget

    gguf = gguf_file_of(target_name)
    if gguf is None:
        raise SystemExit(f"error: --target {target_name!r} is not a GGUF file or alias: nothing to agree with")
    target = FrozenTarget.from_pretrained(target_name)
    prompts = [p.ids for p in load_prompts(target.tokenizer, n_prompts, prompt_tokens, prompts_from)]
    harness = ar_outputs(target, prompts, max_new)
    rows = []
    with LS.Server(gguf, threads) as s:
        for ids, h in zip(prompts, harness):
            e = s.complete(list(ids), max_new, n_probs=2)
            i = LS.first_difference(h, e["tokens"])
            gaps = harness_gaps(target, ids, h)
            row = {"prompt_tokens": len(ids), "harness": h, "engine": e["tokens"], "diverges_at": i,
                   "harness_gaps": [round(g, 4) for g in gaps]}
            if i is not None and i < min(len(h), len(e["tokens"])):
                row.update(harness_gap=gaps[i], engine_gap=e["top2_gaps"][i])
            rows.append(row)
    same = sum(r["diverges_at"] is None for r in rows)
    checked = sum(min(len(r["harness"]), len(r["engine"])) if r["diverges_at"] is None else r["diverges_at"] + 1
                  for r in rows)
    worst = max((r["harness_gap"] for r in rows if "harness_gap" in r), default=None)
    # every position both decoded alike up to (and including) the first difference: how rare a gap that small is
    seen = [g for r in rows for g in r["harness_gaps"][: (len(r["harness_gaps"]) if r["diverges_at"] is None
                                                           else r["diverges_at"] + 1)]]
    return {"target": target_name, "gguf": gguf.name, "prompts": prompts_from, "n_prompts": len(rows),
            "max_new_tokens": max_new, "threads": threads, "identical": same, "tokens_compared": checked,
            "max_gap_at_divergence": worst,
            "share_of_positions_at_or_below_it": (sum(g <= worst for g in seen) / len(seen)
                                                  if worst is not None and seen else None),
            "median_gap": statistics.median(seen) if seen else None, "rows": rows}


def render(res: dict) -> str:
    lines = [f"# {res['target']}: the dequantized model (harness, fp32) against llama.cpp on {res['gguf']}", "",
             f"{res['n_prompts']} prompts ({res['prompts']}), {res['max_new_tokens']} greedy tokens each, llama-server "
             f"with {res['threads']} thread(s), prompts sent as token ids. Identical continuations: "
             f"**{res['identical']} of {res['n_prompts']}**; the others part where the harness's top-2 logit gap is "
             "small, both gaps at that token below (harness | engine)."
             + (f" Over the {res['tokens_compared']} positions compared, the harness's median gap is "
                f"{res['median_gap']:.2f} and {res['share_of_positions_at_or_below_it']:.1%} of them are at or below "
                f"the largest gap where the two part ({res['max_gap_at_divergence']:.3f})"
                if res.get("share_of_positions_at_or_below_it") is not None else ""), "",
             "| prompt | tokens | parts at token | harness gap | engine gap |", "|---|---|---|---|---|"]
    for i, r in enumerate(res["rows"]):
        if r["diverges_at"] is not None:
            gaps = " | ".join(f"{r.get(k, float('nan')):.4f}" for k in ("harness_gap", "engine_gap"))
            lines.append(f"| {i} | {r['prompt_tokens']} | {r['diverges_at']} | {gaps} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.engines.agreement", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", default="humaneval", help="a prompt file or shipped name (completion prompts)")
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from eval.engines import llamacpp_server as LS

    if not LS.available():
        print("error: llama-server not built (scripts/build_llama_cpp.sh)", file=sys.stderr)
        return 2
    res = measure(a.target, a.prompts, a.n_prompts, a.prompt_tokens, a.max_new_tokens, a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
