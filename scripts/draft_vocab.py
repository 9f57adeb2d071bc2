"""The EAGLE-3 draft vocabulary by measurement: for each size, how much of the target's own greedy output it can draft
(coverage of held-out T=0 continuations, the vocabulary counted on the training split), and what a drafted token
costs with it (an untrained drafter of that size drafting chains, against the target's AR step).

    python scripts/draft_vocab.py +recipe=eagle3_gemma3_270m --sizes 8192 16384 32768 65536 \\
        --out bench/gemma3/draft_vocab [--threads 1] [--n-prompts 4]

Reads the recipe's regeneration cache as it stands (nothing is generated: a partial cache gives an estimate and
says how many rows it read). At T=0 a token outside the draft vocabulary is never drafted, so the coverage bounds
the acceptance at every depth; the cost is what the vocabulary's lm_head rows add to a draft step. The ``est.
speedup`` column combines the two under a stated assumption (``--alpha``: per-position acceptance of an in-vocabulary
token, equal at every size), which orders the sizes, not predicts a speedup. Timings need a quiet CPU.
Writes OUT/draft_vocab.json and OUT/draft_vocab.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cached_rows(data_cfg, target) -> tuple[list[dict], list[dict], int]:
    """(training rows, held-out T=0 rows, planned rows) read from the regeneration cache (complete records only),
    split as data/sources.py ``text_rows`` splits the full plan: the last ``val_rows`` conversations held out."""
    from data.regen_cache import parse_records, regen_cache_path
    from data.sources import chat_conversations, text_plan

    tok = target.tokenizer
    prompts, groups = text_plan(data_cfg, tok, chat_conversations(data_cfg)[0])
    planned = sorted(i for _, g in groups for i in g)
    held = set(planned[len(planned) - min(data_cfg.val_rows, len(planned) // 2):])
    train, val = [], []
    for temp, group in groups:
        path = regen_cache_path(data_cfg, target.model, tok, "text", [prompts[i] for i in group], temp)
        payload = path.read_bytes() if path.exists() else b""
        # a running regeneration may be mid-line at the end: only whole lines are records
        recs = parse_records(payload[: payload.rfind(b"\n") + 1], path)
        for j, rec in recs.items():
            i = group[j]
            if i in held:
                if temp == 0:
                    val.append(rec)
            else:
                train.append(rec)
    return train, val, len(planned)


def held_out_coverage(counts, val: list[dict], sizes: list[int]) -> dict[int, float]:
    """Share of the held-out rows' continuation tokens (the target's greedy choices) among the ``n`` tokens most
    frequent in training, for each ``n``."""
    from models.core.vocab import build_draft_vocab, count_tokens

    if not val:
        return {n: float("nan") for n in sizes}
    held = count_tokens(val, counts.numel())
    total = int(held.sum()) or 1
    return {n: int(held[build_draft_vocab(counts, n)[1]].sum()) / total for n in sizes}


def draft_cost(target, train: list[dict], config, prompts: list, k: int, max_new: int, ar_step_s: float) -> dict:
    """An untrained EAGLE-3 of ``config`` (an Eagle3Config: the recipe's, at the draft vocabulary measured)
    drafting K-token chains on ``prompts`` (its acceptance is irrelevant: every round drafts K): seconds in the
    proposer per drafted token, and as AR steps (c)."""
    from eval.decode.single import speculative_decode
    from eval.engines.serving import chain_proposer
    from models import registry
    drafter = registry.build_drafter("eagle3", config, target, train).eval()
    proposer = chain_proposer("eagle3", drafter, target, None, k)
    spent = [0.0]
    for name in ("begin", "propose", "accept"):  # every proposer call: drafting and absorbing the target's states
        fn = getattr(proposer, name)

        def timed(*a, _fn=fn, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
        setattr(proposer, name, timed)
    speculative_decode(target, proposer, prompts[0], 4)  # warm-up
    spent[0], drafted = 0.0, 0
    for p in prompts:
        drafted += sum(speculative_decode(target, proposer, p, max_new).drafted)
    per = spent[0] / max(drafted, 1)
    return {"draft_ms": 1000 * per, "c": per / ar_step_s, "drafted": drafted,
            "lm_head_params_M": drafter.lm_head.weight.numel() / 1e6}


def est_speedup(cov: float, alpha: float, c: float, k: int) -> float:
    """Chain K's tokens per round over its cost in AR steps, each position accepted with ``alpha * cov`` given the
    one before (verify of K+1 tokens taken as one step: an ordering, not a prediction)."""
    a = alpha * cov
    tau = sum(a ** j for j in range(k + 1))
    return tau / (1 + k * c)


def main(argv: list[str] | None = None) -> int:
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from eval.bench.setup import load_prompts
    from eval.decode.single import decode_ar
    from models.core.vocab import count_tokens, coverage

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides composing the recipe (e.g. +recipe=...)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cost", action="store_true", help="coverage only (no timing: any CPU)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=a.overrides)
    target, data_cfg = instantiate(cfg.target), instantiate(cfg.data)
    train, val, planned = cached_rows(data_cfg, target)
    if not train:
        print("error: the regeneration cache holds no training rows yet; run train.regenerate first "
              "(docs/gemma3.md)", file=sys.stderr)
        return 2
    counts = count_tokens(train, target.vocab_size)
    res = {"target": cfg.target.get("name_or_path"), "vocab_size": target.vocab_size, "rows_read": len(train),
           "held_out_t0_rows": len(val), "rows_planned": planned, "train_tokens": int(counts.sum()),
           "k": a.k, "alpha": a.alpha, "threads": a.threads, "sizes": {}}
    train_cov = coverage(counts, a.sizes)
    held_cov = held_out_coverage(counts, val, a.sizes)
    if not a.no_cost:
        from eval.bench.quiet import OTHER_CORES_MAX, CpuWatch
        from models.core.kernels import cpu_features

        watch = CpuWatch()  # other processes' CPU use over the timings: a contended run says so
        prompts = [torch.tensor([p.ids]) for p in load_prompts(target.tokenizer, a.n_prompts, 256, "humaneval")]
        decode_ar(target, prompts[0], 4)
        t0 = time.perf_counter()
        for p in prompts:
            decode_ar(target, p, a.max_new_tokens)
        ar_step_s = (time.perf_counter() - t0) / (len(prompts) * a.max_new_tokens)
        res["ar_step_ms"] = 1000 * ar_step_s
        res["machine"] = cpu_features()
    for n in a.sizes:
        row = {"train_coverage": train_cov[n], "held_out_greedy_coverage": held_cov[n]}
        if not a.no_cost:
            config = dataclasses.replace(instantiate(cfg.draft.config), draft_vocab_size=n)
            row.update(draft_cost(target, train, config, prompts, a.k, a.max_new_tokens, ar_step_s))
            row["est_speedup"] = est_speedup(held_cov[n], a.alpha, row["c"], a.k)
        res["sizes"][str(n)] = row
        print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if not a.no_cost:
        res["cpu"] = watch.stop()
        res["contended"] = res["cpu"]["other_cores"] > OTHER_CORES_MAX
        # no held-out greedy rows generated yet (the regeneration goes shortest prompt first): no coverage, no choice
        res["choice"] = (max(res["sizes"], key=lambda n: res["sizes"][n]["est_speedup"]) if val else None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_vocab.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "draft_vocab.md").write_text(render(res))
    print(render(res))
    return 0


def render(res: dict) -> str:
    cost = "ar_step_ms" in res
    lines = ["CONTENDED RUN (another process used the CPU): timings not to quote", ""] if res.get("contended") else []
    lines += [f"# Draft vocabulary for {res['target']} ({res['vocab_size']:,} tokens)", "",
             f"Counted on {res['rows_read']} training rows ({res['train_tokens']:,} target tokens) of "
             f"{res['rows_planned']} planned; held-out coverage on {res['held_out_t0_rows']} T=0 rows."
             + (f" Cost: chain K={res['k']}, {res['threads']} thread(s), AR step {res['ar_step_ms']:.1f} ms; "
                f"{res['machine']['cpu']} ({res['machine']['torch_cpu_capability']}); "
                f"est. speedup assumes per-position acceptance {res['alpha']} x coverage." if cost else ""), "",
             "| draft vocab | training coverage | held-out greedy coverage |"
             + (" lm_head params | draft ms / token | c (AR steps) | est. speedup |" if cost else ""),
             "|---|---|---|" + ("---|---|---|---|" if cost else "")]
    for n, r in res["sizes"].items():
        line = f"| {int(n):,} | {r['train_coverage']:.4f} | {r['held_out_greedy_coverage']:.4f} |"
        if cost:
            line += (f" {r['lm_head_params_M']:.1f} M | {r['draft_ms']:.2f} | {r['c']:.3f} | "
                     f"{r['est_speedup']:.3f}{' (chosen)' if n == res.get('choice') else ''} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
