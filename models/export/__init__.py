"""Export trained drafters in the formats serving engines load, validate any such directory, load it back.

The formats are the rows every method declares (``ExportFormat`` in its ``models/methods/<name>/export.py``, table
in ``formats.export_formats()``): each row builds a directory, checks one, loads it back into draftsmith's module,
detects itself and writes its README sections. This package knows no format or method by name: one writer
(build, validate in memory, write atomically, re-validate), one validator for every format (the shape comparison
and the same-target check around the row's own check), one loader, the README frame and the serving manifest.

Every directory also gets ``README.md`` (serving snippets) and ``draftsmith.json`` (what we know and the engines
do not: method, our layer ids and their convention, the target's identity incl. its embedding fingerprint).

Aux-layer-id conventions (checked against the engines' loaders, see the comments at the fields):
- draftsmith: index into HF ``output_hidden_states`` (models/core/target.py): id k = residual stream entering layer k.
- vLLM top-level ``eagle_aux_hidden_state_layer_ids``: the SAME numbers. vLLM's Llama forward appends
  ``hidden_states + residual`` *before* running layer ``idx`` when ``idx`` is listed, and the runner passes the
  config's list through unchanged (vllm/model_executor/models/llama.py ``LlamaModel.forward``,
  vllm/v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``).
- SGLang ``eagle_config.eagle_aux_hidden_state_layer_ids``: "output of layer i" = our id - 1; SGLang adds 1
  (sglang/srt/models/llama.py ``set_eagle3_layers_to_capture``; read in model_executor/model_runner.py).
So the two fields hold different numbers for the same tensors; the validator checks top == sglang + 1.

Modules: api (export, load_export), validate (detect_format, validate), formats (the table), readme (the
README frame), serving (the serving-mode manifest); shared helpers in models/export_common.py,
models/export_identity.py and models/export_snippets.py (core, so the methods' exporters use them too).
"""

from models.core.spec import ExportFormat
from models.core.target import embed_fingerprint
from models.export_common import (
    CONFIG,
    LAYER_ID_CONVENTION,
    README,
    SIDECAR,
    WEIGHTS,
    ExportError,
    recommended_k_from_results,
)

from .api import export, load_export
from .formats import cli_formats, export_format, export_formats
from .validate import detect_format, validate

__all__ = [
    "cli_formats", "export_formats", "ExportFormat", "export_format", "CONFIG",
    "LAYER_ID_CONVENTION", "README",
    "SIDECAR", "WEIGHTS", "ExportError", "detect_format", "embed_fingerprint", "export", "load_export",
    "recommended_k_from_results", "validate",
]
