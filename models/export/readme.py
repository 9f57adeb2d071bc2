"""The README.md written into every export: serving snippets for vLLM/SGLang and the layer-id conventions."""

from __future__ import annotations

import json

from .common import engine_target_name


def render_readme(fmt: str, cfg: dict, side: dict) -> str:
    k = side["num_speculative_tokens"]
    tname = engine_target_name(side["target_name"])
    path = "/path/to/this/export"
    lines = [f"# draftsmith export: {fmt}", "",
             f"Drafter method `{side['method']}` for target `{side['target_name']}` "
             f"({side['target']['num_hidden_layers']} layers, hidden {side['target']['hidden_size']}, "
             f"vocab {side['target']['vocab_size']}). Check this directory any time with "
             f"`python -m train.export --check {path} --target {side['target_name']}`.", "",
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
        if fmt == "eagle3_native" and ours[0] != 2:
            lines += ["Note: SGLang versions carrying PR #25454 add 1 to these ids only when the first one is 1 "
                      "(the default layers); with other layer ids check the server log for the captured layers.", ""]
    elif fmt == "medusa_vllm":
        spec = {"method": "medusa", **spec}
    elif fmt == "medusa_fasterdecoding":
        spec = None
        lines += ["## FasterDecoding/Medusa", "", "```python",
                  "from medusa.model.medusa_model import MedusaModel",
                  f"model = MedusaModel.from_pretrained('{path}')  # base model: {tname}", "```", "",
                  "TensorRT-LLM (engine-build route): `python examples/medusa/convert_checkpoint.py --model_dir "
                  f"{tname} --medusa_model_dir {path} --num_medusa_heads {cfg['medusa_num_heads']} "
                  f"--num_medusa_layers {cfg['medusa_num_layers']} --output_dir ckpt --dtype float16` "
                  "(its weight.py reads medusa_lm_head.safetensors). For vLLM export --format medusa-vllm; "
                  "SGLang has no Medusa support.", ""]
    elif fmt == "mtp_deepseek":
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
    else:  # a format no engine snippet is known for: no `--speculative-config` without a method in it
        spec = None
    if spec is not None:
        lines += ["## vLLM", "", "```bash", f"vllm serve {tname} \\",
                  f"  --speculative-config '{json.dumps(spec)}'", "```", ""]
    if sglang is not None:
        lines += ["## SGLang", "", "```bash", f"python -m sglang.launch_server --model-path {tname} \\",
                  f"  --speculative-algorithm {sglang} --speculative-draft-model-path {path} \\",
                  f"  --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
                  "```", "",
                  "(chain drafting; for tree drafting raise --speculative-eagle-topk and "
                  "--speculative-num-draft-tokens)", ""]
    return "\n".join(lines)
