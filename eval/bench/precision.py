"""The T=0 lossless check under low precision: every divergence judged against the dtype's measured noise.

In fp32 the check is exact: a method's T=0 tokens must equal AR's, and any divergence is a failure.

In fp16/bf16 the verification forward (several tokens at once) and AR's one-token step are different kernels
over the same numbers, and their logits differ by far more than in fp32, so a greedy near-tie can flip between
them. Measured on SmolLM2-135M in bf16 with fp32 logits (MT-Bench prompts, AMD EPYC with AVX2 only,
bench/results_smollm2_certified_mt_bench ``precision.noise_per_width``): 0.78-1.02 logits at every width from 2 to
33, the same as with bf16 logits, so the noise is the hidden states', not the logits' rounding; fp32 logits remove
the exact ties instead (eval/bench/certificate.py counts what remains). A divergence is then a failure only when
the target's own logit gap at that position exceeds what the noise can explain:

    noise     max |logits(w-token forward) − logits(one-token steps)| over the benchmark's verification widths w
              and the last positions of the first prompts, measured on this target and dtype at the start of the
              benchmark (``measure_noise``);
    gap       at the first differing position, from a recomputation of the target's logits z on AR's prefix:
              max(z) − min(z[AR's token], z[the method's token]) — top-1 minus top-2 when the two tokens are the
              top two, larger when the method took a lower-ranked token (a bug cannot pass as a near-tie);
    threshold 2 × noise: each run's logits are within ``noise`` of the recomputation, so two runs that ordered
              the two tokens oppositely can leave them up to 2 × noise apart in it.

Every divergence is reported (results.json ``methods.*.divergences``, results.md), tolerated or not, with its
gap, top-1 − top-2 gap, noise and threshold, so a real bug cannot hide behind the tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eval.decode.ladder import new_cache
from eval.decode.single import prefill
from models.core.packed import Fp32Head
from models.core.target import FrozenTarget

EXACT_DTYPES = (torch.float32, torch.float64)
SLACK = 2.0  # threshold = SLACK × noise (module docstring)
NOISE_PROMPTS = 4


def first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@torch.no_grad()
def measure_noise(target: FrozenTarget, prompts: Sequence[Tensor], widths: Sequence[int],
                  n_prompts: int = NOISE_PROMPTS) -> dict:
    """max |logits of a w-token forward on a KV cache − logits of the same tokens fed one at a time (AR's path)|
    for every verification width w in ``widths`` (kernels switch with the width: on CPU bf16 a 4-token forward
    can match the one-token step bit for bit where a 16-token one does not), over the last positions of the
    first ``n_prompts`` prompts ([1, P] each), on this target in its dtype."""
    worst, positions, per_width = 0.0, 0, {1: 0.0}  # width 1 is AR's own path: no difference by definition
    for x in prompts[:n_prompts]:
        ws = sorted({min(w, x.shape[1] - 1) for w in widths if w > 1} - {0})
        if not ws:
            continue
        top = ws[-1]
        cache = new_cache(target)  # AR's path: the last `top` positions one token at a time
        prefill(target, x[:, : x.shape[1] - top], cache)
        steps = torch.cat([target(x[:, j: j + 1], cache=cache, use_cache=True).logits[0].float()
                           for j in range(x.shape[1] - top, x.shape[1])])
        for w in ws:  # the verification path: the last w positions in one forward
            cache = new_cache(target)
            prefill(target, x[:, : x.shape[1] - w], cache)
            wide = target(x[:, x.shape[1] - w:], cache=cache, use_cache=True).logits[0].float()
            d = float((wide - steps[top - w:]).abs().max())
            worst, per_width[w] = max(worst, d), max(per_width.get(w, 0.0), d)
            positions += w
    return {"noise": worst, "positions": positions, "width": max(widths, default=1), "per_width": per_width}


@dataclass
class Judge:
    """Judges T=0 divergences from AR for one target (module docstring). ``prompts``: the benchmark's [1, P] ids."""

    target: FrozenTarget
    prompts: Sequence[Tensor]
    noise: float
    positions: int = 0
    width: int = 0
    per_width: dict[int, float] = field(default_factory=dict)  # the noise at each width measured

    @classmethod
    def measure(cls, target: FrozenTarget, prompts: Sequence[Tensor], widths: Sequence[int]) -> Judge:
        return cls(target, prompts, **measure_noise(target, prompts, widths))

    @property
    def dtype(self) -> torch.dtype:
        return self.target.model.dtype

    @property
    def exact(self) -> bool:
        return self.dtype in EXACT_DTYPES

    @property
    def threshold(self) -> float:
        return 0.0 if self.exact else SLACK * self.noise

    def summary(self) -> dict:
        fp32_head = isinstance(self.target.model.get_output_embeddings(), Fp32Head)
        return {"dtype": str(self.dtype).removeprefix("torch."), "exact": self.exact, "noise": self.noise,
                "logits_dtype": "float32" if fp32_head else str(self.dtype).removeprefix("torch."),
                "threshold": self.threshold, "slack": SLACK, "noise_positions": self.positions,
                "noise_width": self.width, "noise_per_width": {str(w): n for w, n in sorted(self.per_width.items())}}

    def noise_at(self, widths: Sequence[int]) -> float:
        """The largest noise measured at any of ``widths`` (a width not measured: the largest measured at all)."""
        return max((self.per_width.get(w, self.noise) for w in widths), default=0.0)

    @torch.no_grad()
    def divergence(self, prompt: int, ref: Sequence[int], got: Sequence[int]) -> dict:
        """The first divergence of ``got`` from ``ref`` (AR's tokens) after prompt ``prompt``: where, the two
        tokens, the target's gap there, and whether the dtype's noise explains it (``tolerated``)."""
        i = first_diff(ref, got)
        out = {"first_diff": i, "ar_token": ref[i] if i < len(ref) else None,
               "token": got[i] if i < len(got) else None, "gap": None, "top2_gap": None, "noise": self.noise,
               "threshold": self.threshold, "tolerated": False}
        if out["ar_token"] is None or out["token"] is None:
            return out  # one stopped early (eos) where the other did not: no near-tie explains a length change
        x = self.prompts[prompt]
        ctx = torch.cat([x, torch.tensor([list(ref[:i])], dtype=x.dtype, device=x.device)], dim=1)
        z = self.target(ctx, logits_to_keep=1).logits[0, -1].float()
        top2 = z.topk(2).values
        out["gap"] = float(z.max() - torch.minimum(z[out["ar_token"]], z[out["token"]]))
        out["top2_gap"] = float(top2[0] - top2[1])
        out["tolerated"] = not self.exact and out["gap"] <= self.threshold
        return out


def failures(divergences: Sequence[dict]) -> list[dict]:
    """The divergences that fail the lossless check (all of them in fp32; unjudged ones always)."""
    return [d for d in divergences if not d.get("tolerated", False)]
