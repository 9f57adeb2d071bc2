"""A test-only fifth draft method, placed where a real one goes: what a new method has to provide, and nothing else.

It is registered only when ``DRAFTSMITH_TOY_METHOD=1`` (models/registry.py; tests/test_new_method.py runs the
real CLIs and the config and layer tests with it), so users never see it.

The "bigram head": a drafter that predicts the token after ``tok`` from ``tok``'s embedding plus a projection of
the target's final (post-norm) hidden state at the position before ``tok``:

    logits(tok, h) = out(emb(tok) + proj(h))           emb: V → r, proj: H → r, out: r → V

Training (distillation): at position i it reads (t_{i+1}, h_i) and matches the target's next-token distribution
p_{i+1} (the target's logits at position i+1, which predict t_{i+2}), scored where loss_mask[i+2] is set.
Drafting: a chain; draft 1 reads (newest token, h of the token before it), draft s+1 reads (draft s, the same h).

The pieces, as models/core/spec.py asks: ``ToyConfig`` (conf/draft/toy.yaml instantiates it), ``BigramHead``
(the models/core/drafter.py protocol), ``BigramChainProposer`` (the models/core/proposal.py protocol), ``SPEC``; and
for export one ``ExportFormat`` row (``EXPORT_FORMAT``: build, check, load back, detect, its README section).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from models.core.proposal import Proposal, Sampling, chain_proposal, check_k, pick_token
from models.core.spec import DEFAULT_NUM_SPECULATIVE_TOKENS, ExportFormat, MethodSpec, ProposerSpec
from models.core.target import FrozenTarget, validate_layer_ids
from models.export.shared.common import (
    WEIGHTS,
    Bundle,
    TargetInfo,
    Tensors,
    engine_target_name,
    fail,
    make_sidecar,
    require,
)

ARCH = "DraftsmithBigramHead"


@dataclass
class ToyConfig:
    rank: int = 16
    layer_id: int | None = None  # target hidden state read (None: the last layer, after the final norm)


class BigramHead(nn.Module):
    def __init__(self, cfg: ToyConfig, hidden_size: int, vocab_size: int, num_layers: int):
        super().__init__()
        layer = num_layers if cfg.layer_id is None else cfg.layer_id
        self.cfg = ToyConfig(rank=cfg.rank, layer_id=validate_layer_ids([layer], num_layers)[0])
        self.layer_ids = [self.cfg.layer_id]
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.emb = nn.Embedding(vocab_size, cfg.rank)
        self.proj = nn.Linear(hidden_size, cfg.rank, bias=False)
        self.out = nn.Linear(cfg.rank, vocab_size, bias=False)

    def config_dict(self) -> dict:
        return {"method": "toy", **asdict(self.cfg), "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}

    def logits(self, tok: Tensor, h: Tensor) -> Tensor:
        """tok [...] ids, h [..., H] → [..., V]."""
        return self.out(self.emb(tok) + self.proj(h.to(self.proj.weight.dtype)))

    def training_loss(self, input_ids: Tensor, loss_mask: Tensor, hidden: dict[int, Tensor],
                      target_logits: Tensor) -> tuple[Tensor, dict[str, float]]:
        h = hidden[self.layer_ids[0]][:, :-2]  # h_i for i = 0..T-3
        logits = self.logits(input_ids[:, 1:-1], h)  # reads t_{i+1}
        p = target_logits[:, 1:-1].float().softmax(-1)  # p_{i+1}: the target's distribution over t_{i+2}
        w = loss_mask[:, 2:].float()
        ce = -(p * logits.float().log_softmax(-1)).sum(-1)
        n = w.sum().clamp_min(1.0)
        loss = (ce * w).sum() / n
        acc = ((logits.argmax(-1) == p.argmax(-1)).float() * w).sum() / n
        return loss, {"loss_0": loss.item(), "acc_0": acc.item(), "n_0": float(w.sum())}


class BigramChainProposer:
    """Chain of num_speculative_tokens drafts (models/core/proposal.py protocol)."""

    def __init__(self, head: BigramHead, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 sample_drafts: bool = True):
        self.head = head.eval()
        self.layer_ids = list(head.layer_ids)
        self.num_speculative_tokens = check_k("num_speculative_tokens", num_speculative_tokens)
        self.sample_drafts = sample_drafts

    @torch.no_grad()
    def begin(self, tokens: Tensor, hidden: dict[int, Tensor], sampling: Sampling) -> None:
        self.sampling = sampling
        self.accept(tokens, hidden)

    @torch.no_grad()
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor]) -> None:
        self.newest = tokens[0, -1:]  # [1]
        self.h = hidden[self.layer_ids[0]][0, -1]  # [H]: the position before the newest token

    @torch.no_grad()
    def propose(self, max_depth: int) -> Proposal:
        tok, toks, qs = self.newest, [], []
        for _ in range(min(self.num_speculative_tokens, max_depth)):
            tok, q = pick_token(self.head.logits(tok[0], self.h), self.sampling, self.sample_drafts, None,
                                self.head.vocab_size)
            toks.append(tok)
            qs.append(q)
        return chain_proposal(toks, qs, self.h.device)


def build(cfg: ToyConfig, target: FrozenTarget, train_rows: list[dict] | None = None) -> BigramHead:
    c = target.model.config
    return BigramHead(cfg, c.hidden_size, c.vocab_size, target.num_layers)


# --------------------------------------------------------------------------------------------- its exporter
def export_build(d: BigramHead, target: FrozenTarget, name: str, num_speculative_tokens: int | None,
                 meta: dict | None) -> Bundle:
    cfg = {"architectures": [ARCH], "base_model_name_or_path": engine_target_name(name), "rank": d.cfg.rank,
           "layer_id": d.cfg.layer_id, "hidden_size": d.hidden_size, "vocab_size": d.vocab_size}
    tensors = {k: v.detach() for k, v in d.state_dict().items()}
    side = make_sidecar("toy_native", d, target, name, num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS, meta)
    return Bundle("toy_native", cfg, tensors, side)


def export_check(cfg: dict, t: Tensors, side: dict | None, target: TargetInfo | None,
                 where: str) -> tuple[dict, dict]:
    r, H, V = (require(cfg, key, where) for key in ("rank", "hidden_size", "vocab_size"))
    if target is not None and target.num_hidden_layers and not 0 <= require(cfg, "layer_id", where) <= \
            target.num_hidden_layers:
        fail(where, f"layer_id {cfg['layer_id']} out of range for a {target.num_hidden_layers}-layer target")
    exp = {"emb.weight": (V, r), "proj.weight": (r, H), "out.weight": (V, r)}
    return exp, {"hidden_size": H, "vocab_size": V, "name": cfg.get("base_model_name_or_path")}


def export_load(cfg: dict, sd: dict, target: FrozenTarget) -> BigramHead:
    head = BigramHead(ToyConfig(rank=cfg["rank"], layer_id=cfg["layer_id"]), cfg["hidden_size"], cfg["vocab_size"],
                      target.num_layers)
    head.load_state_dict(sd, strict=True)
    return head.eval()


def export_readme(cfg: dict, side: dict, serve) -> list[str]:
    """Its section of the exported README: no engine serves this format, so no engine command is invented."""
    return ["## Loading it", "", f"No engine serves `{ARCH}` (a test format): load it back with "
            "`models.export.load_export(path, target)`.", ""]


EXPORT_FORMAT = ExportFormat("toy_native", "toy", "toy", "nothing (a test format)", export_build, export_check,
                             export_load, lambda cfg, _p: ARCH in (cfg.get("architectures") or []), WEIGHTS,
                             readme=export_readme)

SPEC = MethodSpec(
    name="toy", config=ToyConfig, build=build, rebuild=build, export_formats=(EXPORT_FORMAT,),
    proposers=(ProposerSpec("toy", lambda head, _t, **o: BigramChainProposer(head, **o),
                            {"num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS},
                            # eval benchmarks it at K=1 too, as its own row
                            variants={"toy_k1": {"num_speculative_tokens": 1}}),),
)

