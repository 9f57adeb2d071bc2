"""Every emitted token checked against the target on the run's own prefix, not only up to a first divergence from AR.

One teacher-forced pass per distinct output of a prompt (the prompt prefilled once; the output fed on that cache in
chunks of ``width`` tokens, then cropped back) gives the target's logits z_j before every emitted token y_j.

T = 0, the certificate: y_j must be argmax z_j. Where it is not, gap_j = max z_j − z_j[y_j] is tolerated only when
the dtype's measured noise explains it. The run chose y_j on logits z^run from a forward of its own width w (AR: 1,
a chain: K + 1, a tree: its nodes + 1); the certificate's z comes from width ``width``. Each is within the noise
measured at its width of the one-token path (eval/bench/precision.py: N(w)), so |z^run − z| ≤ D = N(w) + N(width)
elementwise, and since y_j maximised z^run, gap_j ≤ 2D. The threshold is 2 × (N(the method's widths) + N(width));
in fp32 there is none (exact: every token must be the argmax). ``width`` is the measured width with the least
noise, so the certificate adds as little as the machine allows.

T > 0, a distribution test on the same pass: for a lossless sampler every emitted token is a draw from the target's
sampling distribution p_j on its own prefix, so the randomised probability integral transform
u_j = F_j(y_j − 1) + U · p_j(y_j) (F_j: p_j's CDF in token-id order, U uniform) is i.i.d. uniform on [0, 1).
χ² over ``BINS`` equal bins; the run passes when its p-value is at least ``ALPHA``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from eval.decode.ladder import new_cache
from eval.decode.single import prefill
from models.core.target import FrozenTarget
from models.core.verify import sampling_probs

BINS = 10
ALPHA = 1e-3
MAX_LISTED = 20


@torch.no_grad()
def forced_logits(target: FrozenTarget, x: Tensor, outputs: Sequence[Sequence[int]], width: int) -> list[Tensor]:
    """Per output: [len, V] fp32 logits, row j the target's prediction of token j on the prompt ``x`` ([1, P]) and
    the output's own first j tokens."""
    cache = new_cache(target)
    z0 = prefill(target, x, cache).logits[0, -1:].float()
    out = []
    for toks in outputs:
        feed = torch.tensor([list(toks[:-1])], dtype=x.dtype, device=x.device)
        zs = [z0] + [target(feed[:, s: s + width], cache=cache, use_cache=True).logits[0].float()
                     for s in range(0, feed.shape[1], width)]
        if feed.shape[1]:
            cache.crop(-feed.shape[1])  # back to the prompt alone (this transformers crops by a negative count)
        out.append(torch.cat(zs)[: len(toks)])
    return out


def greedy_divergences(z: Tensor, toks: Sequence[int]) -> list[dict]:
    """The positions where ``toks`` is not the argmax of ``z`` ([n, V]), with the target's gap there."""
    y = torch.tensor(list(toks), device=z.device)
    best = z.argmax(-1)
    return [{"pos": int(j), "token": int(y[j]), "greedy": int(best[j]),
             "gap": float(z[j].max() - z[j, y[j]])} for j in (best != y).nonzero().flatten().tolist()]


def pit(z: Tensor, toks: Sequence[int], temperature: float, top_p: float, top_k: int, gen: torch.Generator
        ) -> Tensor:
    """The randomised probability integral transform of each sampled token under the target's sampling law."""
    p = sampling_probs(z, temperature, top_p, top_k)
    y = torch.tensor(list(toks), device=z.device)
    below = p.cumsum(-1).gather(-1, y[:, None])[:, 0] - p.gather(-1, y[:, None])[:, 0]
    return (below + torch.rand(len(y), generator=gen, device="cpu").to(z.device) * p.gather(-1, y[:, None])[:, 0]
            ).clamp(0, 1 - 1e-9)


def chi2_uniform(u: Tensor, bins: int = BINS) -> dict:
    """χ² of ``u`` against the uniform law on [0, 1) over ``bins`` equal bins, with its p-value."""
    n = int(u.numel())
    counts = torch.bincount((u.double() * bins).long().clamp(0, bins - 1), minlength=bins).double()
    stat = float(((counts - n / bins) ** 2 / (n / bins)).sum()) if n else 0.0
    df = bins - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64))) if n else None
    return {"tokens_checked": n, "chi2": stat, "bins": bins, "p_value": p, "alpha": ALPHA,
            "pass": p is not None and p >= ALPHA}


def certify_runs(target: FrozenTarget, ids: Sequence[Tensor], tokens: Mapping[tuple[str, float], list],
                 thresholds: Mapping[str, float | None], width: int, top_p: float = 1.0, top_k: int = 0, seed: int = 0
                 ) -> dict[str, dict[str, dict]]:
    """{method: {str(T): certificate}} for ``tokens`` {(method, T): [rep][prompt] tokens}: at T=0 every token
    checked against the argmax on its own prefix (``thresholds`` per method), at T>0 the χ² test above."""
    gen = torch.Generator().manual_seed(seed)
    t0: dict[str, dict] = {name: {"tokens_emitted": 0, "tokens_checked": 0, "divergences": 0, "tolerated": 0,
                                  "max_gap_tolerated": 0.0, "threshold": thresholds[name], "width": width,
                                  "failures": []} for name, t in tokens if t == 0}
    us: dict[tuple[str, float], list[Tensor]] = {k: [] for k in tokens if k[1] != 0}
    for i, x in enumerate(ids):
        runs = [(k, rep, tuple(reps[i])) for k, reps_all in tokens.items() for rep, reps in enumerate(reps_all)]
        distinct = sorted({toks for _, _, toks in runs if toks})
        z = dict(zip(distinct, forced_logits(target, x, distinct, width)))
        for (name, temp), rep, toks in runs:
            if not toks:
                continue
            if temp != 0:
                us[(name, temp)].append(pit(z[toks], toks, temp, top_p, top_k, gen))
                continue
            _judge_greedy(t0[name], greedy_divergences(z[toks], toks), len(toks), rep, i)
    out: dict[str, dict[str, dict]] = {}
    for name, c in t0.items():
        out.setdefault(name, {})["0"] = {**c, "pass": c["divergences"] == c["tolerated"]}
    for (name, temp), u in us.items():
        out.setdefault(name, {})[f"{temp:g}"] = chi2_uniform(torch.cat(u) if u else torch.zeros(0))
    return out


def _judge_greedy(c: dict, divs: list[dict], n: int, rep: int, prompt: int) -> None:
    c["tokens_emitted"] += n
    c["tokens_checked"] += n
    for d in divs:
        c["divergences"] += 1
        if c["threshold"] is not None and d["gap"] <= c["threshold"]:
            c["tolerated"] += 1
            c["max_gap_tolerated"] = max(c["max_gap_tolerated"], d["gap"])
        elif len(c["failures"]) < MAX_LISTED:
            c["failures"].append({"rep": rep, "prompt": prompt, **d})
