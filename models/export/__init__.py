"""Export trained drafters in the formats serving engines load, validate any such directory, load it back.

One writer per format (each writes a directory), one validator for all of them (run on the in-memory export
*before* anything is written, and available on any directory), one loader back into draftsmith's modules:

    format                  files                                        served by
    eagle3_native           config.json, model.safetensors               SGLang (EAGLE3), vLLM (eagle3)
    eagle3_speculators      config.json, model.safetensors               vLLM (speculators format), speculators
    medusa_fasterdecoding   config.json, medusa_lm_head.safetensors      FasterDecoding/Medusa, TensorRT-LLM
    medusa_vllm             config.json, model.safetensors               vLLM <= 0.32 (medusa; removed in 0.33.0)
    mtp_deepseek            config.json, model.safetensors               vLLM (mtp) for DeepSeek-V3 targets
    mtp_sglang_nextn        config.json, model.safetensors               SGLang (NEXTN) for DeepSeek-V3 targets

Every directory also gets ``README.md`` (serving snippets) and ``draftsmith.json`` (what we know and the engines
do not: method, our layer ids and their convention, the target's identity incl. its embedding fingerprint).

Aux-layer-id conventions (checked against the engines' loaders, see the comments at the fields):
- draftsmith: index into HF ``output_hidden_states`` (models/target.py): id k = residual stream entering layer k.
- vLLM top-level ``eagle_aux_hidden_state_layer_ids``: the SAME numbers. vLLM's Llama forward appends
  ``hidden_states + residual`` *before* running layer ``idx`` when ``idx`` is listed, and the runner passes the
  config's list through unchanged (vllm/model_executor/models/llama.py ``LlamaModel.forward``,
  vllm/v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``).
- SGLang ``eagle_config.eagle_aux_hidden_state_layer_ids``: "output of layer i" = our id - 1; SGLang adds 1
  (sglang/srt/models/llama.py ``set_eagle3_layers_to_capture``; read in model_executor/model_runner.py).
So the two fields hold different numbers for the same tensors; the validator checks top == sglang + 1.

Modules: api (export, load_export), validate (detect_format, validate), eagle3 / medusa / mtp (build, check
and load back each family's two formats), readme (the README.md), common (constants, ExportError, helpers).
"""

from models.export_common import (
    CONFIG,
    DEFAULT_K,
    LAYER_ID_CONVENTION,
    MEDUSA_WEIGHTS,
    README,
    SIDECAR,
    WEIGHTS,
    ExportError,
    recommended_k_from_results,
)
from models.methods.mtp.export import fuse_experts, unfuse_experts
from models.spec import ExportFormat
from models.target import embed_fingerprint

from .api import export, load_export
from .formats import cli_formats, export_format, export_formats
from .validate import detect_format, validate

__all__ = [
    "cli_formats", "export_formats", "ExportFormat", "export_format", "CONFIG", "DEFAULT_K",
    "LAYER_ID_CONVENTION", "MEDUSA_WEIGHTS", "README",
    "SIDECAR", "WEIGHTS", "ExportError", "detect_format", "embed_fingerprint", "export", "load_export",
    "recommended_k_from_results", "validate", "fuse_experts", "unfuse_experts",
]
