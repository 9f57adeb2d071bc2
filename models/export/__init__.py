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

Modules: api (export, load_export), validate (detect_format, validate), formats (the table: export_format,
export_formats, cli_formats), readme (the README frame), serving (the serving-mode manifest), llamacpp (GGUF);
the helpers the methods' exporters share are in models/export/shared/ (common: file names, ``ExportError``,
``num_speculative_tokens_from_results``; identity; snippets), a layer below the methods (tests/test_layers.py).

This file imports nothing: a method's export.py imports models/export/shared/, which runs this file first, and
the modules here import the registry, which imports the methods.
"""
