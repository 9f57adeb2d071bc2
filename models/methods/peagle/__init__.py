"""P-EAGLE: EAGLE-3 made parallel — one forward drafts K tokens (the method: module, COD loss, proposer).

Method (P-EAGLE, arXiv 2602.01469; speculators ``models/peagle/*``, SpecForge ``algorithms/peagle``; facts in
shared/design/dflash.md §6). Its own method rather than an EAGLE-3 variant: its training (no TTT unroll, COD
chains), its trainable embedding and its decode loop share nothing with models/methods/eagle3
but the layer shapes.

- Fused target states g_i = fc(cat(h_{l0}, h_{l1}, h_{l2})) (fc: 3H → H, no bias; ids ascending, EAGLE-3's
  defaults 2, L//2, L−3 in this project's HF-index convention = vLLM capture ids).
- Entry i (a "real" token): (emb(t_{i+1}), g_i) at RoPE position i predicts t_{i+2} — EAGLE-3's step 0.
- Depth d >= 1 of a chain anchored at a: (emb(mask_token_id), fc(mask_hidden)) at position a+d predicts
  t_{a+d+2}. ``mask_hidden`` [1, 1, 3H] is ONE learnable vector shared by all depths, in the pre-fc space.
- Layer 0 is EAGLE-3's: attention over cat(input_layernorm(emb), hidden_norm(g)) (2H), residual g; layers 1..
  are plain Llama decoder layers; then ``norm`` and ``lm_head`` (the target's head rows of the draft vocabulary,
  frozen, as in speculators). The embedding is trainable (speculators ``embed_requires_grad=True``).
- Attention: a real entry sees real entries j <= i (causal); depth d of the chain at a sees real entries j <= a
  and depths 1..d of its own chain — exactly what decoding sees (below).

Training (COD sampling, speculators ``data.py``): depth 0 keeps every position; depth d keeps the first
``ceil(n·max(r^d, r_min))`` of one random order of the valid anchors (so depth d's chains are a subset of depth
d−1's, r = ``down_sample_ratio``). Loss per depth: soft cross-entropy against the target's softmax on the draft
ids (labels outside the draft vocabulary are not scored), each depth's mean weighted equally. Slot d's label
conditions on tokens a+2..a+d+1, so (``label_path: greedy``) it is scored only where those are the target's own
greedy choices. ``acc_d`` = agreement of depth d given depths < d agreed (what a greedy verifier accepts).

Decoding: the draft cache holds the K/V of real entries only. A round runs ONE forward over [the real entries
not yet cached (the tokens committed last round), K−1 mask entries], causal, on top of the cache; the newest
real entry's output drafts depth 0, the mask entries depths 1..K−1; only the real entries' K/V are kept.
Drafts are parallel (q_d does not depend on the earlier samples), so any q is verified losslessly.

The package: ``config.py`` (PEagleConfig), ``net.py`` (the network and its COD loss, what training and export read),
``proposers.py`` (the parallel-drafting proposer), ``export.py`` (the speculators format); here: build/rebuild, SPEC.
"""

from __future__ import annotations

from models.core.spec import MethodSpec, ProposerSpec
from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab, choose_mask_token, count_tokens
from models.methods.peagle import export
from models.methods.peagle.config import PEagleConfig, check_config
from models.methods.peagle.net import PEagleDrafter
from models.methods.peagle.proposers import PEagleProposer


# --------------------------------------------------------------------------------------------- the method
def build(cfg: PEagleConfig, target: FrozenTarget, train_rows: list[dict]) -> PEagleDrafter:
    V = target.vocab_size
    if cfg.mask_token_id is None:
        cfg.mask_token_id = choose_mask_token(target, train_rows)
    d2t = t2d = None
    if cfg.draft_vocab_size and cfg.draft_vocab_size < V:
        d2t, t2d = build_draft_vocab(count_tokens(train_rows, V), cfg.draft_vocab_size)
    return PEagleDrafter(cfg, target.model.config, target.embed.weight,
                         target.model.get_output_embeddings().weight, d2t, t2d)


def rebuild(cfg: PEagleConfig, target: FrozenTarget) -> PEagleDrafter:
    return PEagleDrafter(cfg, target.model.config, target.embed.weight, target.model.get_output_embeddings().weight)


def _prepare_num_speculative_tokens(d: PEagleDrafter, _ckpt_dir: str | None, o: dict) -> dict:
    n = o["num_speculative_tokens"]
    return {**o, "num_speculative_tokens": d.cfg.num_depths if n is None else int(n)}  # None → every depth


SPEC = MethodSpec(
    name="peagle", config=PEagleConfig, build=build, rebuild=rebuild, export_formats=export.FORMATS,
    default_num_speculative_tokens=lambda d: d.cfg.num_depths, check_config=check_config,
    proposers=(ProposerSpec("peagle", lambda d, _t, **o: PEagleProposer(d, **o), {"num_speculative_tokens": None},
                            prepare=_prepare_num_speculative_tokens),),
)
