"""DeepSeek-V3-style multi-token prediction (MTP) modules trained on a frozen target (``SPEC``).

The package, one seam per module:

    config.py     ``MTPConfig`` (``draft.config``) and the decoder-block config derived from the target's
    net.py        the MTP modules and their training loss (``MTPDrafter``; the method's maths), cached module run
    native.py     the DeepSeek-V3 checkpoint layout of the weights (a target's own MTP layers load from it)
    proposers.py  the greedy chain and the KV-cached ``MTPProposer``
    export.py     the mtp_deepseek (vLLM) and mtp_sglang_nextn (SGLang) formats
    here          its K (one draft per module unless told) and ``SPEC``
"""

from __future__ import annotations

from models.core.spec import MethodSpec, ProposerSpec
from models.methods.mtp import export
from models.methods.mtp.config import MTPConfig, check_config
from models.methods.mtp.net import MTPDrafter
from models.methods.mtp.proposers import MTPProposer


def _prepare_num_speculative_tokens(drafter: MTPDrafter, _ckpt_dir: str | None, o: dict) -> dict:
    n = o["num_speculative_tokens"]
    return {**o, "num_speculative_tokens": int(n or drafter.cfg.num_modules)}  # None → one draft per module


SPEC = MethodSpec(
    name="mtp", config=MTPConfig, build=lambda cfg, target, rows=None: MTPDrafter.from_target(cfg, target),
    rebuild=MTPDrafter.from_target, export_formats=export.FORMATS,
    default_num_speculative_tokens=lambda d: d.cfg.num_modules,
    check_config=check_config,
    # checkpoints written before hidden_between_depths existed chained the pre-norm state
    checkpoint_defaults={"hidden_between_depths": "pre_norm"},
    proposers=(ProposerSpec("mtp", lambda d, _t, **o: MTPProposer(d, **o), {"num_speculative_tokens": None},
                            prepare=_prepare_num_speculative_tokens, recommend_rank=2),),
)
