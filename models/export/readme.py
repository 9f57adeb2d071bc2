"""The README.md written into every export: serving snippets for vLLM/SGLang and the layer-id conventions."""

from __future__ import annotations

import json

from models.export_common import EMBEDDED_SERVE_PATH, engine_target_name
from models.export_identity import SGLANG_PLUS1_IF_FIRST_IS_1, sglang_reads, stamp_of
from models.target import EMBEDDED_NAME

# The engine releases whose loaders (read from their wheels) each snippet was checked against.
VLLM_CHECKED = "vLLM 0.33.0 and 0.32.0"
SGLANG_CHECKED = "SGLang 0.5.23"


def render_readme(fmt: str, cfg: dict, side: dict) -> str:
    k = side["num_speculative_tokens"]
    tname = side.get("serve_name") or engine_target_name(side["target_name"])
    cname = side["target_name"] if side["target_name"] == EMBEDDED_NAME else tname  # draftsmith resolves its alias
    path = "/path/to/this/export"
    lines = [f"# draftsmith export: {fmt}", "",
             f"Drafter method `{side['method']}` for target `{cname}` "
             f"({side['target']['num_hidden_layers']} layers, hidden {side['target']['hidden_size']}, "
             f"vocab {side['target']['vocab_size']}). Check this directory any time with "
             f"`python -m train.export --check {path} --target {cname}`.", "",
             f"`{tname}` below names the target (as in this export's engine-read fields"
             + (": its directory in a draftsmith checkout" if tname == EMBEDDED_SERVE_PATH else "")
             + "); serve from wherever the target lives on the serving machine, or re-export with "
             "`--serve-name`.", "",
             f"num_speculative_tokens below: {k}"
             + (" (from the eval results)." if side.get("k_from_results") else " (default; pass --results eval.json "
                "with `recommended_num_speculative_tokens` to use the measured best)."), ""]
    spec = {"model": path, "num_speculative_tokens": k, "draft_tensor_parallel_size": 1}
    sglang = None
    if fmt in ("eagle3_native", "eagle3_speculators"):
        spec = {"method": "eagle3", **spec}
        if fmt == "eagle3_native":
            sglang = "EAGLE3"
        ours = side["layer_ids"]
        lines += ["## Aux hidden-state layer ids (same tensors, three conventions)", "",
                  f"- draftsmith (index into HF `output_hidden_states`): {ours}",
                  f"- vLLM top-level `eagle_aux_hidden_state_layer_ids` (capture before decoder layer i): {ours}",
                  f"- SGLang `eagle_config.eagle_aux_hidden_state_layer_ids` (output of decoder layer i): "
                  f"{[i - 1 for i in ours]}" + ("" if fmt == "eagle3_native" else " (not written: vLLM only)"), ""]
        on = [f for f in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(f)]
        if on:
            lines += [f"EAGLE-3.1 flags {on} are set: speculators 0.9.0 reads them (tested); draftsmith has not "
                      "checked which vLLM release honours them, so compare served acceptance with `python -m eval`.",
                      ""]
        if fmt == "eagle3_native":
            mt = stamp_of(cfg).get("model_type")
            sg = [i - 1 for i in ours]
            if mt in SGLANG_PLUS1_IF_FIRST_IS_1:
                rule = (f"For this `{mt}` target {SGLANG_CHECKED} adds 1 to the SGLang ids only when the first one "
                        "is 1 (PR #25454)")
                got = sglang_reads(sg, mt)
                rule += (": here it does, so it captures the right layers." if got == ours else
                         f": here it does not, so SGLang would capture {got} instead of {ours}. Serve with vLLM, "
                         "or retrain with layer ids starting at 2 (the default).")
            else:
                rule = (f"For this `{mt or 'llama'}` target {SGLANG_CHECKED} adds 1 to every SGLang id "
                        "(llama.py `set_eagle3_layers_to_capture`), giving back the draftsmith ids above.")
            lines += [rule, ""]
    elif fmt == "medusa_vllm":
        spec, medusa = None, {"method": "medusa", **spec}
        lines += ["## vLLM 0.32 and older only", "",
                  "vLLM 0.33.0 removed Medusa (no method, model or config); this `MedusaModel` layout maps onto "
                  "vLLM 0.32.0's loader (checked). On current vLLM serve an EAGLE-3 or MTP drafter instead; "
                  "TensorRT-LLM reads the FasterDecoding layout (`--format medusa`).", "",
                  "```bash", "pip install 'vllm<=0.32.0'", f"vllm serve {tname} \\",
                  f"  --speculative-config '{json.dumps(medusa)}'", "```", ""]
    elif fmt == "medusa_fasterdecoding":
        spec = None
        lines += ["## FasterDecoding/Medusa", "", "```python",
                  "from medusa.model.medusa_model import MedusaModel",
                  f"model = MedusaModel.from_pretrained('{path}')  # base model: {tname}", "```", "",
                  "TensorRT-LLM (engine-build route): `python examples/medusa/convert_checkpoint.py --model_dir "
                  f"{tname} --medusa_model_dir {path} --num_medusa_heads {cfg['medusa_num_heads']} "
                  f"--num_medusa_layers {cfg['medusa_num_layers']} --output_dir ckpt --dtype float16` "
                  "(its weight.py reads medusa_lm_head.safetensors; TensorRT-LLM version not checked by "
                  "draftsmith). vLLM 0.33.0 removed Medusa: `--format medusa-vllm` is for vLLM <= 0.32; on "
                  "current vLLM use EAGLE-3 or MTP. SGLang has no Medusa support.", ""]
    if fmt.startswith("mtp"):
        between = stamp_of(cfg).get("mtp_hidden_between_depths")
        lines += [f"Depth >= 2 (and a module reused past its depth) was trained on the `{between}` hidden state of "
                  "the previous depth; vLLM and SGLang feed the post-norm one (shared_head.norm)"
                  + ("." if between == "post_norm" else ", so served acceptance at depth >= 2 differs from eval's."),
                  ""]
    if fmt == "mtp_deepseek":
        spec = {"method": "mtp", **spec}  # vllm/config/speculative.py: deepseek_mtp is an alias of mtp
        if cfg.get("model_type") == "deepseek_v3":
            lines += ["For SGLang export --format mtp-nextn (one module, layer renumbered to 0).", ""]
        else:
            spec = None
            lines += ["## No engine serves this block as-is", "",
                      f"The layout is DeepSeek-V3's (`model.layers.{{L+d}}.{{enorm,hnorm,eh_proj,shared_head.*,...}}`)"
                      f", but the block is the `{cfg.get('model_type')}` target's own decoder layer. vLLM's "
                      "deepseek_mtp.py and SGLang's deepseek_nextn.py build a DeepseekV2DecoderLayer (MLA + MoE), "
                      "so they cannot load it. An engine would need an MTP model class for this family: "
                      "enorm/hnorm RMSNorms, eh_proj Linear(2H→H) over cat(enorm(emb), hnorm(h)), the family's "
                      "decoder layer, shared_head.norm and the target's lm_head, fed the target's final (post-norm) "
                      "hidden state. draftsmith's eval and `models.export.load_export` run it today.", ""]
    elif fmt == "mtp_sglang_nextn":
        spec = None
        sglang = "NEXTN"
    elif fmt in ("dflash_speculators", "dflash_zlab"):
        ours, blk = side["layer_ids"], cfg.get("block_size")
        lines += ["## DFlash layer ids and block size", "",
                  f"- draftsmith / vLLM / speculators `aux_hidden_state_layer_ids` (input of decoder layer k): {ours}",
                  f"- z-lab / SGLang `dflash_config.target_layer_ids` (output of decoder layer k): "
                  f"{[i - 1 for i in ours]}",
                  f"- block size {blk}: vLLM `num_speculative_tokens` = {blk - 1} (B-1), SGLang "
                  f"`--speculative-num-draft-tokens` = {blk} (B, anchor included). vLLM 0.32 builds a block of "
                  "1 + num_speculative_tokens slots: a smaller K than B-1 attends over fewer mask slots than "
                  "trained and serves other drafts than draftsmith measured", "",
                  "Checked against vLLM `model_executor/models/qwen3_dflash.py` + speculators `algos.py` "
                  "`update_dflash`, and SGLang `srt/speculative/dflash_utils.py` (sources and commits: "
                  "shared/design/dflash.md §0).", ""]
        if fmt == "dflash_speculators":  # labelled with what it was read against, not the EAGLE-3 releases
            lines += ["## vLLM (dflash; read against the sources in shared/design/dflash.md §0)", "", "```bash",
                      f"vllm serve {tname} \\",
                      f"  --speculative-config '{json.dumps({'method': 'dflash', **spec})}'", "```", ""]
        spec = None
        if fmt == "dflash_zlab":
            lines += ["## SGLang", "", "```bash", f"python -m sglang.launch_server --model-path {tname} \\",
                      f"  --speculative-algorithm DFLASH --speculative-draft-model-path {path} \\",
                      f"  --speculative-num-draft-tokens {blk}", "```", ""]
    elif fmt in ("dspark_speculators", "dspark_zlab"):
        ours, blk = side["layer_ids"], cfg.get("block_size")
        lines += ["## DSpark: DFlash + a Markov head + a confidence head", "",
                  f"- draftsmith / vLLM / speculators `aux_hidden_state_layer_ids` (input of decoder layer k): {ours}",
                  f"- z-lab / SpecForge / SGLang `dflash_config.target_layer_ids` (output of decoder layer k): "
                  f"{[i - 1 for i in ours]}",
                  f"- block size {blk}, `sample_from_anchor: true`: the anchor slot drafts too, so a block holds "
                  f"{blk} speculative tokens (vLLM `num_speculative_tokens` <= {blk}; SGLang "
                  f"`--speculative-dspark-block-size {blk}`). Serving it with DFlash's B-1 convention shifts every "
                  "slot.", "",
                  "Read against speculators `models/dspark/*`, vLLM `update_dspark` and SpecForge "
                  "`configs/qwen3-8b-dspark.json` (shared/design/dflash.md §7); draftsmith has not run either "
                  "engine on it — compare served acceptance with `python -m eval`.", "",
                  "Check the served slot alignment: vLLM's `update_dspark` sets `dspark_bonus_anchor=true`, and a "
                  "vLLM fork patches it to `not sample_from_anchor`, saying upstream forces the DFlash-style layout "
                  "on every speculators checkpoint. vLLM's DSpark runtime does not use the confidence head (SGLang's "
                  "DSPARK sizes each verify window from it; draftsmith's eval: `options.dflash.min_confidence`).", ""]
        if fmt == "dspark_speculators":
            lines += ["## vLLM (dspark)", "", "```bash", f"vllm serve {tname} \\",
                      f"  --speculative-config '{json.dumps({'method': 'dspark', **spec})}'", "```", ""]
        else:
            lines += ["## SGLang (DSPARK, SGLang PR #30261)", "", "```bash",
                      f"python -m sglang.launch_server --model-path {tname} \\",
                      f"  --speculative-algorithm DSPARK --speculative-draft-model-path {path} \\",
                      f"  --speculative-dspark-block-size {blk}", "```", ""]
        spec = None
    elif fmt == "peagle_speculators":
        lines += ["## P-EAGLE: parallel drafting", "",
                  f"- aux layer ids (vLLM capture, input of decoder layer k; = draftsmith's): {side['layer_ids']}",
                  f"- mask (pard) token id {cfg.get('mask_token_id')}, trained for {cfg.get('para_depths')} parallel "
                  "depths: `num_speculative_tokens` must not exceed them", "",
                  "vLLM's speculators reader (`update_peagle`) maps this to architectures `PeagleLlamaForCausalLM`, "
                  "`pard_token = mask_token_id`, and the method eagle3 with `parallel_drafting` (an engine flag, not "
                  "a weight). Read against the sources in shared/design/dflash.md §6; draftsmith has not run vLLM "
                  "on it.", "",
                  "## vLLM (eagle3, parallel_drafting)", "", "```bash", f"vllm serve {tname} \\",
                  f"  --speculative-config '{json.dumps({'method': 'eagle3', **spec, 'parallel_drafting': True})}'",
                  "```", ""]
        spec = None
    elif not fmt.startswith(("eagle3", "medusa", "mtp")):
        spec = None  # a format no engine snippet is known for: no `--speculative-config` without a method in it
    if spec is not None:
        lines += [f"## vLLM (checked against {VLLM_CHECKED})", "", "```bash", f"vllm serve {tname} \\",
                  f"  --speculative-config '{json.dumps(spec)}'", "```", ""]
    if sglang is not None:
        lines += [f"## SGLang (checked against {SGLANG_CHECKED})", "", "```bash",
                  f"python -m sglang.launch_server --model-path {tname} \\",
                  f"  --speculative-algorithm {sglang} --speculative-draft-model-path {path} \\",
                  f"  --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
                  "```", "",
                  "(chain drafting; for tree drafting raise --speculative-eagle-topk and "
                  "--speculative-num-draft-tokens)", ""]
    return "\n".join(lines)
